"""The single-rank head's selection strategies: which tokens to score, then the certificate.

* :func:`select_two_sided`: a threshold on the screen values (screens with a lower bound: every
  screen but the one-sided ball); one read of ``y [B, V]`` (block maxima), the rest on the few
  candidate blocks.
* :func:`select_one_sided`: grow ``S`` per row until the certificate holds or the budget is
  spent (the one-sided ball).
* :func:`select_fused`: the fused GPU step (:class:`vllm_csv.gpu.step.FusedStep`), the same
  certificate on each row's own candidate blocks.

Each takes the head (:class:`~vllm_csv.head.CertifiedHead`) and reads only its public parts:
``prepare``, ``intervals``, ``score``, ``screen``, ``errors``, ``engine``, ``backend``,
``config``. Each returns a :class:`~vllm_csv.head.types.Selection`; rows that stop uncertified
are dense in the caller.
"""

from __future__ import annotations

import math

import torch

from ..ops.select import exclude_columns
from . import certificate
from .types import Selection


def select_two_sided(head, hidden: torch.Tensor, k: torch.Tensor, need_values: torch.Tensor,
                     temp: torch.Tensor | None = None, exclude: torch.Tensor | None = None) -> Selection:
    """Certify with a threshold on the screen values.

    Token ``j`` has half-width ``m_j <= delta |y_j| + spread`` with
    ``spread = rad_max ||h|| + act + tiny + max_i bslack_i`` (:meth:`ErrorModel.spread`). With
    ``y_k`` a lower bound of a row's k-th largest screen value (the k-th largest of its
    block maxima: those are k distinct tokens) and ``g(y) = y + delta |y|`` (increasing),
    the k tokens with the largest ``y`` have ``lo >= tau := y_k - delta |y_k| - spread``, a
    lower bound on the k-th largest dense logit. A token with ``g(y_i) < s := tau - spread``
    has ``hi_i < tau``; so ``S`` = the union over rows of ``{i : y_i >= thr = g^-1(s)}``
    contains every row's dense top-k, every token outside ``S`` has ``hi < tau``, and
    :func:`~vllm_csv.head.certificate.certify` decides with ``outside_high = tau``. Only blocks
    whose maximum reaches ``thr`` can hold candidates. A row may be certified only when
    ``g(y_(1)) + spread + max|b|`` (a bound of every dense value and pre-bias product of the
    row) is below :attr:`DenseEngine.limit`.

    Parameters
    ----------
    hidden : torch.Tensor
        ``[B, d]`` model dtype.
    k : torch.Tensor
        ``[B]`` int64, ``k >= 1``.
    need_values : torch.Tensor
        ``[B]`` bool: the row's values are read (certified bit for bit).
    temp : torch.Tensor, optional
        ``[B]`` fp32: sampled rows' temperatures (0: greedy; None: every row greedy).
    exclude : torch.Tensor, optional
        ``[n]`` int64: tokens left out of the vocabulary (a model sets them to ``-inf`` after
        the head): their screen values are ``-inf`` to the search
        (:func:`~vllm_csv.ops.select.exclude_columns`), so they are never a row's largest or
        k-th value, no bound is asked of them (nor is the overflow check: the model's ``-inf``
        replaces even an overflowing dense value), and their exact scores never count; ``T`` is
        the top-k of the other tokens, every other one of which is proven below it, and each
        row holds ``-inf`` on them.
    """
    B, V = hidden.shape[0], head.vocab_size
    dev = hidden.device
    errors, backend = head.errors, head.backend
    hidden, hnorm, ok = head.prepare(hidden)
    out = head.screen.center_radius(hidden, **({"defer_row_scale": True} if head.defer_row_scale else {}))
    y, rs, bmax = out.y, out.row_scale, out.block_max  # the center is fl(y * rs) (rs None: y); monotone
    if exclude is not None:
        bmax = exclude_columns(y, bmax, exclude)
    _, rad_max = errors.rad_total(out.radius)  # (cached while the screen's radius is the same tensor)
    delta = errors.delta + out.rel
    kmax = int(k.max())
    budget = head.config.budget_columns(V, kmax)
    act_coef = errors.max_of(out.n) * (1 + delta) if out.n is not None else 0.0
    # tau, thr, the candidate blocks and columns (ops.select.select_candidates_ref is this
    # docstring's search, step by step; one fused kernel on the CPU)
    ids, tau, ok, live = backend.select_candidates(
        y, rs, k, hnorm, out.e if out.n is not None else None, ok, rad_max, act_coef, errors.tiny,
        errors.bias_slack(out.rel)[1], delta, head.engine.limit, errors.babs_max, budget, bmax)
    n_scored = ids.numel()
    if n_scored >= kmax:
        z, lower, upper = head.score(hidden, ids, hnorm)
        # a left-out token's exact score never counts (where fewer than k tokens are left in
        # some row, its k-th screen value is -inf and every column is a candidate, left-out ones too)
        if exclude is not None:
            gone = torch.isin(ids, exclude)[None]
            z, lower, upper = (x.masked_fill(gone, -math.inf) for x in (z, lower, upper))
        cert, in_top = certificate.certify(head.engine, z, lower, upper, k, tau, need_values, ids, temp,
                                           backend.certify_plain)
    else:  # fewer candidates than k: nothing to certify (every row's outcome below)
        z = torch.empty((B, 0), dtype=head.dtype, device=dev)
        in_top = torch.empty((B, 0), dtype=torch.bool, device=dev)
        cert, ids = torch.zeros(B, dtype=torch.bool, device=dev), ids[:0]
    exact, code = backend.finish_selection(V, ids, z, in_top, ok, live, cert)  # fused on the CPU
    # k = 1 everywhere: each certified row's one column in T, read off [B, S] (no pass over [B, V])
    top1 = ids[in_top.to(torch.uint8).argmax(1)] if kmax == 1 and in_top.shape[1] else None
    return Selection(exact, torch.full((B,), n_scored, device=dev), code == 0, certificate.reason_names(code), top1)


def select_one_sided(head, hidden: torch.Tensor, k: torch.Tensor, need_values: torch.Tensor,
                     temp: torch.Tensor | None = None) -> Selection:
    """Grow ``S`` per row until the top-k certificate holds or ``budget`` is reached.

    First ``S`` of a row: every token with ``hi >= tau``, ``tau`` the k-th largest ``lo``
    (this already certifies: outside ``hi < tau <=`` k-th lower bound in ``S``). Screens
    without a lower bound, and rows whose first ``S`` exceeds the budget, take the
    ``m`` highest ``hi`` instead, ``m`` doubling each round. All rows of a batch share
    the scored columns (the union), so each round is one GEMM over new rows of ``W``.
    Arguments as :func:`select_two_sided`."""
    B, V = hidden.shape[0], head.vocab_size
    dev = hidden.device
    lo, hi, hnorm, ok = head.intervals(hidden)
    hidden = hidden.masked_fill(~ok[:, None], 0)  # rows never certified: no NaN in the scores
    kmax = int(k.max())
    budget = head.config.budget_columns(V, kmax)
    m = torch.zeros(B, dtype=torch.long, device=dev)
    if lo is not None:
        tau = (lo.amax(1, keepdim=True) if kmax == 1
               else lo.topk(kmax, dim=1).values.gather(1, (k - 1)[:, None]))
        mask = hi >= tau
        m = mask.sum(1)
    by_mask = ok & (m > 0) & (m <= budget)
    m = torch.where(by_mask, m, torch.clamp(k * 8, max=budget))
    exact = torch.full((B, V), -math.inf, dtype=head.dtype, device=dev)
    done = torch.zeros(V, dtype=torch.bool, device=dev)
    cols = torch.empty(0, dtype=torch.long, device=dev)
    zs = torch.empty((B, 0), dtype=head.dtype, device=dev)
    lower, upper = (torch.empty((B, 0), device=dev) for _ in range(2))
    certified = torch.zeros(B, dtype=torch.bool, device=dev)
    in_top = torch.zeros((B, 0), dtype=torch.bool, device=dev)
    active = ok.clone()
    first = True
    while bool(active.any()):  # (host sync a round: the loop's condition)
        parts = []
        by_rank = active & ~by_mask if first else active
        if first and bool(by_mask.any()):
            parts.append(mask[by_mask].any(0).nonzero().squeeze(1))
        if bool(by_rank.any()):  # hi of scored columns is -inf: topk finds new tokens
            mm = min(int(m[by_rank].max()), V)
            top = hi[by_rank].topk(mm, dim=1)
            keep = (torch.arange(mm, device=dev)[None] < m[by_rank][:, None]) & (top.values > -math.inf)
            parts.append(top.indices[keep])
        need = torch.cat(parts).unique()
        new = need[~done[need]]
        if new.numel():
            z, lo_new, up_new = head.score(hidden, new, hnorm)
            cols = torch.cat([cols, new])
            zs, lower, upper = (torch.cat([a, b], 1) for a, b in ((zs, z), (lower, lo_new), (upper, up_new)))
            done[new] = True
            hi.index_fill_(1, new, -math.inf)
        if zs.shape[1] >= kmax:
            cert, in_top = certificate.certify(head.engine, zs, lower, upper, k, hi.amax(1), need_values, cols,
                                               temp, head.backend.certify_plain)
            certified |= active & cert
        active &= ~certified & (m < budget) & ~done.all()
        m = torch.where(active, torch.clamp(m * 2, max=budget), m)
        first = False
    if cols.numel() >= kmax:
        exact[:, cols] = zs.masked_fill(~in_top, -math.inf)
    scored = torch.full((B,), int(done.sum()), device=dev)
    # a row that stops uncertified has spent its budget, or every token was scored
    return Selection(exact, scored, certified, certificate.reasons(certified, ok, m < budget))


def select_fused(fused, hidden: torch.Tensor, k: torch.Tensor, need_values: torch.Tensor) -> Selection:
    """The selection by the fused GPU step ``fused`` (:class:`vllm_csv.gpu.step.FusedStep`): the
    same certificate on each row's own candidate blocks (:mod:`vllm_csv.gpu`), ``exact``
    the certified values on their ids."""
    ids, vals, code, count = fused.run(hidden, k.to(torch.int32), need_values.to(torch.int8), int(k.max()))
    return Selection(fused.logits(ids, vals), fused.scored(count).long(), code == 0, certificate.reason_names(code))
