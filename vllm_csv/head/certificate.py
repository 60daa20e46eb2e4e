"""The top-k certificate, as pure functions: given the bounds and the exact scores, which rows
are proven, and which tokens they return.

No policy, no state, no device branch: every input is a tensor or the engine's arithmetic
(:class:`~vllm_csv.dense_engine.DenseEngine`), and a backend may hand in its fused kernel of the
plain case (``plain_kernel``: :func:`vllm_csv.ops.step.certify_topk`, the same bits). The
single-rank head (:mod:`vllm_csv.head.selection`) calls it on its scored columns, the sharded
head (:mod:`vllm_csv.sharded`) on the columns every rank gathered.

Top-k certificate. With ``T`` the ``k`` scored tokens of largest value, ``L`` the smallest dense
lower bound in ``T``, ``U`` the largest dense upper bound of the other scored tokens and ``M``
an upper bound of every unscored token: ``L > fl(max(U, M))``, also after the engine's soft-cap
and scale (:meth:`DenseEngine.separated`), proves that ``T`` is the dense top-k, whatever order
the dense GEMM accumulates in, ties included. Where a later stage reads the values, every value
of ``T`` must also be known bit for bit (:meth:`DenseEngine.single_valued`).

Pipeline of :func:`certify`:

1. the plain certificate (greedy rows, or ``temp`` None), fused where the backend has it;
2. replayed ties (greedy ``k = 1`` rows, no soft-cap) for rows left;
3. the kept-set certificate of sampled rows (:func:`certify_kept`) for rows left.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..dense_engine import DenseEngine
from ..fp import quotient_bounds
from ..ops import step as cpu_ops


def is_plain(engine: DenseEngine) -> bool:
    """No soft-cap, no scale: the engine's comparisons are plain ones (``ops.step.certify_topk``)."""
    return engine.softcap is None and engine.scale == 1.0


def certify(engine: DenseEngine, z: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor, k: torch.Tensor,
            outside_high: torch.Tensor, need_values: torch.Tensor, ids: torch.Tensor,
            temp: torch.Tensor | None = None, plain_kernel: Callable | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k certificate on the scored columns.

    Parameters
    ----------
    engine : DenseEngine
        The dense engine's arithmetic (dtype, soft-cap, scale).
    z, lower, upper : torch.Tensor
        ``[B, S]``: scored values (model dtype) and the dense-value interval (fp32).
    k : torch.Tensor
        ``[B]`` int64, ``1 <= k <= S``.
    outside_high : torch.Tensor
        ``[B]`` fp32, an upper bound of every unscored token's rounded dense value.
    need_values : torch.Tensor
        ``[B]`` bool: the row's values are read later (they must be the dense bits).
    ids : torch.Tensor
        ``[S]`` or ``[B, S]``: the token id of each column (per row where rows differ).
    temp : torch.Tensor, optional
        ``[B]`` fp32: the temperature a sampled row's logits are divided by before vLLM's
        top-k mask (``0``: a greedy row, read by argmax; ``None``: every row greedy).
    plain_kernel : callable, optional
        A fused implementation of step 1 for a plain engine and ``temp`` None,
        ``(z, lower, upper, k, outside_high, need_values) -> (ok, in_top)`` with the same bits.

    Returns
    -------
    (certified [B] bool, in_top [B, S] bool): ``T`` = the ``k`` columns of largest ``z``.
    With ``L`` the smallest lower bound in ``T`` and ``U`` the largest upper bound of the
    rest, ``L`` beats ``max(U, outside_high)`` strictly through the engine's arithmetic,
    and on sampled rows also after the fp32 division by the temperature (vLLM's top-k
    keeps every token equal to the k-th value, and ``fl(x / t)`` can make equal what was
    not: overflow to ``inf``, underflow).

    Replayed ties (greedy rows with ``k = 1``, no soft-cap). Where the best value ``v`` is
    known bit for bit for every column that holds it, and every other token is strictly
    below ``v`` through the engine's arithmetic, the dense argmax is the lowest id holding
    ``v``: equal inputs give equal outputs under ``scale`` (one correctly rounded
    product), and the dense argmax takes the first maximum. (Soft-cap's ``tanh`` may
    differ by an ulp between its vectorised and scalar code paths, so a tie there is not
    replayed. A sampled ``top_k = 1`` row keeps every tied token and draws among them:
    never replayed.)
    """
    kmax = int(k.max())
    if plain_kernel is not None and is_plain(engine) and temp is None:  # the common case: one fused kernel
        ok, in_top = plain_kernel(z, lower, upper, k, outside_high, need_values)
    else:
        top = z.float().topk(kmax, dim=1).indices
        in_top = torch.zeros(z.shape, dtype=torch.bool, device=z.device).scatter_(
            1, top, torch.arange(kmax, device=z.device)[None] < k[:, None])
        low = lower.masked_fill(~in_top, math.inf).amin(1)
        high = upper.masked_fill(in_top, -math.inf).amax(1)
        ok = engine.separated(low, torch.maximum(high, outside_high), temp)
        ok &= (DenseEngine.single_valued(lower, upper) | ~in_top).all(1) | ~need_values
    # The host reads whether any row is left (CPU: no device; CUDA: this step syncs anyway,
    # issue 9): the fallbacks below are skipped when every row already holds.
    left = not bool(ok.all())
    known = DenseEngine.single_valued(lower, upper) if left else None
    if left and engine.softcap is None and kmax == 1:
        zf = z.float()
        v = zf.masked_fill(~known, -math.inf).amax(1)
        tie = known & (zf == v[:, None])
        rest = upper.masked_fill(tie, -math.inf).amax(1)
        by_tie = ~ok & engine.separated(v, torch.maximum(rest, outside_high))
        if temp is not None:
            by_tie &= temp == 0
        if bool(by_tie.any()):
            rid = ids if ids.dim() == 2 else ids[None]
            first = torch.where(tie, rid, rid.max() + 1).argmin(1)
            one = torch.zeros_like(in_top).scatter_(1, first[:, None], True)
            in_top = torch.where(by_tie[:, None], one, in_top)
            ok |= by_tie
    if left and temp is not None and engine.softcap is None:
        kept_ok, kept = certify_kept(engine, z, lower, upper, k, kmax, outside_high, known, temp)
        use = kept_ok & ~ok
        in_top = torch.where(use[:, None], kept, in_top)
        ok |= use
    return ok, in_top


def certify_kept(engine: DenseEngine, z, lower, upper, k, kmax: int, outside_high, known, temp
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept-set certificate of sampled rows (``temp > 0``; no soft-cap).

    vLLM's samplers divide the row by ``t`` in fp32 and keep every token whose quotient is at
    least the k-th largest quotient, ties included, then draw among them. V1 divides with
    torch (correctly rounded), V2 with Triton's ``/`` (within 2 ulps, subnormal results
    possibly flushed: :data:`~vllm_csv.fp.DIV_REL`, :data:`~vllm_csv.fp.DIV_ABS`), which
    may tie what the correct division keeps apart; so the kept set is taken before the
    division, where it is exact, and separated through it. Without soft-cap ``zt`` (one
    correctly rounded product by ``scale``) is replayed exactly on tokens whose value is known
    bit for bit. With ``z_k`` the k-th largest of those, the kept set is the known tokens with
    ``zt >= z_k`` (ties at the k-th value included: equal inputs give equal quotients) when
    every other token (a known one below ``z_k``, a scored one with an unknown value, any
    unscored one, bounded through :meth:`DenseEngine.bound`) has a quotient surely below that
    of ``z_k`` under any division of the model (:func:`~vllm_csv.fp.quotient_bounds`): then each
    of them falls below every kept token's quotient, and the k-th largest quotient is a kept
    token's, whatever the order the division leaves among the kept ones. Returns
    ``(certified [B], kept [B, S])``; a tie at the k-th value (common deep in a bf16 row) is no
    obstacle. A tie made by the division itself (two values overflowing to ``inf``, or
    flushed to zero) is not certified: V1's and V2's divisions may make different ones.
    """
    sampled = temp > 0
    t = torch.where(sampled, temp, 1.0).to(torch.float32)
    zt = engine.transform(z).float()
    zk = zt.masked_fill(~known, -math.inf).topk(kmax, dim=1).values.gather(1, (k - 1)[:, None])[:, 0]
    kept = known & (zt >= zk[:, None])
    high = engine.round(torch.maximum(upper.masked_fill(known, -math.inf).amax(1), outside_high))
    below = torch.maximum(zt.masked_fill(~known | kept, -math.inf).amax(1), engine.bound(high, up=True))
    separated = quotient_bounds(zk, zk, t)[0] > quotient_bounds(below, below, t)[1]
    return sampled & separated & (zk > -math.inf), kept


def reasons(certified: torch.Tensor, ok: torch.Tensor, live: torch.Tensor) -> list[str | None]:
    """Per row: None if certified, else ``nonfinite`` (inputs or bounds unusable), ``budget``
    (too many candidates) or ``uncertified``. One host transfer for the batch."""
    return reason_names(cpu_ops.outcome_codes(certified, ok, live))


def reason_names(code: torch.Tensor) -> list[str | None]:
    """Per row, the fallback reason of an outcome code (:data:`vllm_csv.ops.step.REASONS`; None:
    certified). One host transfer for the batch."""
    return [cpu_ops.REASONS[c] for c in code.tolist()]


def output(engine: DenseEngine, exact: torch.Tensor) -> torch.Tensor:
    """The transform of ``exact`` (``[B, V]``, same layout as the dense logits, so that every
    element takes the engine's code path), ``-inf`` kept where nothing was returned."""
    if engine.softcap is None:
        return engine.transform(exact)  # -inf * scale = -inf
    return engine.transform(exact).masked_fill_(exact == -math.inf, -math.inf)


def stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``x [B, V]``, ties broken by the lowest index (as ``argmax``)."""
    vals, ids = torch.sort(x, dim=1, descending=True, stable=True)
    return vals[:, :k], ids[:, :k]
