"""Certify vLLM's Model Runner V2 verification of drafts (``standard`` rejection sampling; CUDA):
for each sampled request of a speculative step, how many of its draft tokens are accepted and
which token follows them, from bounds on its target rows. What V2 computes, and the bounds on
its arithmetic: :mod:`.verify_v2_bounds`.

The certificate (:func:`certify_verification_v2`): ``x``'s bounds from the head's screen
(:class:`.HeadAdapter`) through :func:`~.gumbel_v2.temperature_bounds`, every draft token scored
exactly; :func:`~.verify_v2_bounds.decide` answers accept, reject or undecided per row; an undecided
row gets the tokens of highest upper bound scored (they carry its mass), up to :data:`ROUNDS` times
within the head's budget. A request is certified when every row up to its first rejection is decided
and the draw from ``r_a`` (with ``d_a`` masked) is certified (:func:`~.rows_v2.certify_rows_v2`);
otherwise its rows go dense.

What is handed to V2's kernels for a certified request (:class:`Verified`), so that its unchanged
code takes the same decisions: rows ``r_j, j < a``: ``0`` at ``d_j``, ``-inf`` elsewhere (then ``lse
= x_d``, ``x_d - lse = 0 > log(u) + q_d``: accepted, since the kernel's ``log(u) + q_d < 0`` was
certified, :func:`~.verify_v2_bounds.decide`); row ``r_a``: with one-hot drafts the draw's exact
values on its scored set, ``-inf`` elsewhere and at ``d_a`` (``x_d - lse = -inf``: rejected; the
residual draw returns the certified winner, :mod:`.rows_v2`); with probabilistic drafts the residual
draw's winner alone (:func:`_residual_draws`); the bonus row: the draw's exact values; rows after
``r_a``: ``-inf`` (not read). A probabilistic rejected row's residual compares tokens through the
row's lse, so its tokens of highest upper bound are scored until the lse is within :data:`LSE_WIDTH`
before the draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..gumbel_noise import philox_uniform
from .gumbel_v2 import min_p_bounds, temperature_bounds
from .head_adapter import HeadAdapter
from .rows_v2 import Bounds, certify_rows_v2
from .scoring import screen
from .types import RowsResult, Screened
from .verify_v2_bounds import (ACCEPT, REJECT, UNDECIDED, decide, draft_logprob_bounds, first_undecided, lse_bounds,
                               residual_alone_ok, residual_bounds)

ROUNDS = 4  # scoring rounds for undecided acceptances
FIRST = 32  # tokens of highest upper bound scored per row before the first decision (with the drafts)
LSE_WIDTH = 0.01  # a rejected row's lse is pinned this tightly before its residual draw (probabilistic drafts)


@dataclass
class Verified:
    """:func:`certify_verification_v2`'s result for ``R`` requests over ``N`` rows."""

    values: torch.Tensor  # [N, V] model dtype: the rows to hand to V2 (module docstring); certified requests only
    certified: torch.Tensor  # [R] bool (host)
    accepted: list[int]  # per request: drafts accepted (meaningful where certified)
    token: list[int]  # per request: the token after them (meaningful where certified)
    reason: list[str | None]  # per request: None if certified, else why not
    scored: int  # tokens scored in the acceptance rounds plus the draws'


def certify_verification_v2(adapter: HeadAdapter, hidden: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                            temp: torch.Tensor, drafts: torch.Tensor, cu: list[int],
                            draft_logits: torch.Tensor | None = None, process: Bounds | None = None,
                            min_p: torch.Tensor | None = None) -> Verified:
    """Certify V2's verification (module docstring) of ``R`` sampled requests.

    Parameters
    ----------
    adapter : HeadAdapter
    hidden : torch.Tensor
        ``[N, d]`` model dtype: each request's rows, its target rows then its bonus row,
        request after request.
    seeds, pos : torch.Tensor
        ``[N]`` int64: each row's request seed and position (V2's ``pos`` of the row).
    temp : torch.Tensor
        ``[N]`` float32, each row's request temperature (``> 0``; V2 divides by it unless 1).
    drafts : torch.Tensor
        ``[N]`` int64: the draft token each target row verifies; ``-1`` on bonus rows.
    cu : list of int
        ``[R + 1]``: request ``i``'s rows are ``cu[i] .. cu[i + 1] - 1``.
    draft_logits : torch.Tensor, optional
        ``[N, V]``: probabilistic drafts, the drafter's logits (pre-temperature) each target row's
        draft was drawn from (bonus rows: anything); None: one-hot drafts.
    process : callable, optional
        ``(lo, hi) -> (lo, hi)``: vLLM's logits processors V2 runs before the temperature, on
        ``[N, V]`` float32 bounds of all the rows (out of place; each monotone per token, as in
        :func:`~.rows_v2.certify_rows_v2`). None: no processor acts on these rows.
    min_p : torch.Tensor, optional
        ``[N]`` float32, each row's ``min_p`` (0: none; None: no row has one). V2 applies it in
        ``apply_sampling_params``, after the temperature, on the whole row (a rejected draft
        included), before the kernels verify and draw (:func:`_one_hot_draws`).

    Returns
    -------
    Verified
    """
    N, V, R = hidden.shape[0], adapter.vocab_size, len(cu) - 1
    dev = hidden.device
    values = torch.full((N, V), -math.inf, dtype=adapter.dtype, device=dev)
    certified = torch.zeros(R, dtype=torch.bool)
    reasons: list[str | None] = ["uncertified"] * R
    accepted, token = [0] * R, [0] * R
    state = screen(adapter, hidden)
    lo, hi, hnorm, finite, scored = state.lo, state.hi, state.hnorm, state.finite, state.scored
    budget = adapter.budget_columns
    target = drafts >= 0
    first = torch.cat([drafts[target].unique(), hi.topk(min(FIRST, V), 1).indices[target].flatten().unique()])
    adapter.score_columns(hidden, hnorm, first.unique(), state.values, lo, hi, scored)
    u = philox_uniform(seeds, pos)
    dlp = None if draft_logits is None else draft_logprob_bounds(draft_logits, temp)
    fin = finite.cpu().tolist()
    req_finite = [all(fin[cu[i]:cu[i + 1]]) and float(temp[cu[i]]) > 0 for i in range(R)]
    # Each row's decision and lse bounds, taken from its bounds then: every row in the first
    # round, then only the rows a request is waiting on (its first row not accepted, once
    # undecided, or rejected with its lse still wide): the bounds only tighten, so a decision once
    # taken stands, and the other rows' [V]-wide passes are not redone.
    dec = torch.zeros(N, dtype=torch.int8, device=dev)
    llo = torch.full((N,), -math.inf, dtype=torch.float64, device=dev)
    lhi = torch.full((N,), math.inf, dtype=torch.float64, device=dev)
    todo = list(range(N))
    for rnd in range(ROUNDS + 1):
        fresh: dict[int, torch.Tensor] = {}  # row -> its processed upper bounds, this round's
        while todo:
            rows = torch.tensor(todo, device=dev)
            qlo, qhi = _processed(lo[rows], hi[rows], temp[rows], process_rows(process, rows, N, len(todo) < N),
                                  None if min_p is None else min_p[rows])
            llo[rows], lhi[rows] = lse = lse_bounds(qlo, qhi)
            dec[rows] = decide(qlo, qhi, drafts[rows], u[rows], None if dlp is None else (dlp[0][rows], dlp[1][rows]),
                               lse)
            fresh.update(zip(todo, qhi))
            a, what = first_undecided(dec, cu)
            open_rows = [cu[i] + a[i] for i in range(R) if req_finite[i] and what[i] == UNDECIDED]
            if dlp is not None:  # a residual draw compares tokens through the row's lse: pin it first
                open_rows += [cu[i] + a[i] for i in range(R) if req_finite[i] and what[i] == REJECT
                              and not float(lhi[cu[i] + a[i]] - llo[cu[i] + a[i]]) < LSE_WIDTH]
            todo = [r for r in open_rows if r not in fresh]  # (rows an acceptance just exposed)
        room = budget - int(scored.sum())
        if not open_rows or rnd == ROUNDS or room <= 0:
            break
        # the open rows' mass: their tokens of highest upper bound not scored yet
        width = min(V, FIRST << (2 * (rnd + 1)), max(1, room // len(open_rows)))
        cand = torch.stack([fresh[r] for r in open_rows]).masked_fill(scored[None], -math.inf).topk(width, 1)
        new = cand.indices[torch.isfinite(cand.values)].unique()
        if new.numel() == 0:
            break
        adapter.score_columns(hidden, hnorm, new[:room], state.values, lo, hi, scored)
        todo = open_rows
    n_first = n_scored = int(scored.sum())
    draw = [i for i in range(R) if req_finite[i] and what[i] != UNDECIDED]
    for i in range(R):
        if not req_finite[i]:
            reasons[i] = "nonfinite"
        elif what[i] == UNDECIDED and n_scored >= budget:
            reasons[i] = "budget"
    # the draws: row r_a of each decided request (the bonus row; with one-hot drafts also a
    # rejected row, d_a removed: _one_hot_draws; with probabilistic drafts a rejected row's
    # residual: _residual_draws, its lse held within the rounds' bounds), each going on from the
    # rounds' bounds and scored columns (the columns a draw adds are counted once per group)
    one_hot = [i for i in draw if what[i] == ACCEPT or dlp is None]
    d_list = drafts.tolist()
    for group, residual in ((one_hot, False), ([i for i in draw if i not in one_hot], True)):
        if not group:
            continue
        rows = torch.tensor([cu[i] + a[i] for i in group], device=dev)
        sub = process_rows(process, rows, N)
        if residual:
            res = _residual_draws(adapter, hidden[rows], seeds[rows], pos[rows], temp[rows],
                                  (dlp[0][rows], dlp[1][rows]), drafts[rows], (llo[rows], lhi[rows]), sub,
                                  None if min_p is None else min_p[rows], start=state.rows(rows))
        else:
            removed = torch.tensor([d_list[cu[i] + a[i]] if what[i] == REJECT else -1 for i in group], device=dev)
            res = _one_hot_draws(adapter, hidden[rows], seeds[rows], pos[rows], temp[rows], removed, sub,
                                 None if min_p is None else min_p[rows], start=state.rows(rows))
        n_scored += res.scored - n_first
        ok, win = res.certified.cpu().tolist(), res.winner.cpu().tolist()
        for j, i in enumerate(group):
            if not ok[j]:
                reasons[i] = res.reason[j]
                continue
            certified[i], reasons[i], accepted[i], token[i] = True, None, a[i], win[j]
            r0 = cu[i]
            for k in range(a[i]):  # accepted rows: one finite token, the draft
                values[r0 + k, d_list[r0 + k]] = 0.0
            values[r0 + a[i]] = res.values[j]
    return Verified(values, certified, accepted, token, reasons, n_scored)


def _processed(lo: torch.Tensor, hi: torch.Tensor, temp: torch.Tensor, process: Bounds | None,
               min_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on what V2's kernels read of rows with head values within ``lo, hi``: vLLM's
    processors (``process``), the temperature, then min-p, in ``apply_sampling_params``' order."""
    qlo, qhi = temperature_bounds(*((lo, hi) if process is None else process(lo, hi)), temp)
    return (qlo, qhi) if min_p is None else min_p_bounds(qlo, qhi, min_p)[:2]


def process_rows(process: Bounds | None, rows: torch.Tensor, N: int, subset: bool = True) -> Bounds | None:
    """``process`` (a map of all ``N`` rows' bounds) as a map of the bounds of ``rows`` alone: run
    on ``[N, V]`` tensors holding them (vLLM's processors read a row's context by its place among
    the rows: a request's earlier drafts for the penalties), the other rows zeros. ``process``
    itself where ``subset`` is False (``rows`` are all ``N`` rows in order); None stays None."""
    if process is None or not subset:
        return process

    def sub(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = [torch.zeros((N, x.shape[1]), dtype=x.dtype, device=x.device).index_copy_(0, rows, x) for x in (lo, hi)]
        plo, phi = process(*full)
        return plo[rows], phi[rows]

    return sub


def _one_hot_draws(adapter: HeadAdapter, hidden: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                   temp: torch.Tensor, removed: torch.Tensor, process: Bounds | None = None,
                   min_p: torch.Tensor | None = None, start: Screened | None = None):
    """V2's draw from the rows after a rejection of a one-hot draft ``removed`` (``>= 0``; ``-1``:
    none, a bonus row): V2 processes the whole row (min-p's threshold taken with the draft still
    in it), then its kernel draws with the draft removed: :func:`~.rows_v2.certify_rows_v2` with
    the draft ``removed`` after min-p (its certified rows carry ``-inf`` on the tokens min-p
    certainly drops and on the draft)."""
    gone = torch.zeros(hidden.shape[0], adapter.vocab_size, dtype=torch.bool, device=hidden.device)
    rows = (removed >= 0).nonzero().squeeze(1)
    gone[rows, removed[rows]] = True
    return certify_rows_v2(adapter, hidden, seeds, pos, temp, process=process, min_p=min_p,
                           removed=gone if rows.numel() else None, start=start)


def _residual_draws(adapter: HeadAdapter, hidden: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                    temp: torch.Tensor, dlp: tuple[torch.Tensor, torch.Tensor], drafts: torch.Tensor,
                    lse: tuple[torch.Tensor, torch.Tensor], process: Bounds | None = None,
                    min_p: torch.Tensor | None = None, start: Screened | None = None):
    """V2's draw from rejected rows' residuals (probabilistic drafts): :func:`~.rows_v2.certify_rows_v2`
    on :func:`residual_bounds` (``T = 1`` there: the residual is drawn undivided), the rows' lse
    held within ``lse`` (float64 ``[R]`` bounds from the acceptance rounds' scoring, which the
    draw's own rounds would otherwise have to pin again). A certified
    row is handed over holding its winner alone (``0``; every other token ``-inf``), where
    :func:`~.verify_v2_bounds.residual_alone_ok` holds; the others are not certified."""
    def residual(lo, hi):  # (the residual of the row min-p left)
        return residual_bounds(*_processed(lo, hi, temp, process, min_p), *dlp, lse=lse)

    res = certify_rows_v2(adapter, hidden, seeds, pos, torch.ones_like(temp), process=residual, start=start)
    w = res.winner[:, None]
    ok = res.certified & residual_alone_ok(res.winner, drafts, dlp[1].gather(1, w).squeeze(1))
    values = torch.full_like(res.values, -math.inf).scatter_(1, w, 0.0)
    reason = [r if c else (r or "uncertified") for r, c in zip(res.reason, ok.tolist())]
    return RowsResult(values, ok, res.winner, reason, res.scored)
