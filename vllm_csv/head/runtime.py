"""A step's runtime policy around a selector: which rows try the certificate, the dense merge,
and the step's account (:class:`~vllm_csv.head.types.StepStats`). No bound, no certificate.

Pipeline of :func:`sampler_logits` (one step, any :class:`~vllm_csv.head.selector.Selector`):

1. :func:`row_split`: per row ``k`` decided on the host (Python lists, no device sync);
2. the engine's arithmetic checked (:meth:`Selector.arithmetic_ok`): if not, every row dense;
3. :meth:`Selector.select` on the rows that try (gathered when not every row does);
4. the certified rows' output (:meth:`Selector.output`) and the dense rows from the caller's
   dense function run on the *whole* batch (bit for bit what the engine computes without CSV);
5. the account: certified rows, fallback reasons, tokens scored, seconds from ``t0``.

The off-switch is not here: the plugin's step asks and feeds it (issue 43).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .. import clock
from .types import RowSplit, StepStats


def row_split(ks: list[int], max_certified_k: int) -> RowSplit:
    """:class:`RowSplit` of ``ks``; rows with ``k > max_certified_k`` are dense (``unsupported``)."""
    rows = [i for i, k in enumerate(ks) if 0 < k <= max_certified_k]
    return RowSplit(ks, rows, sum(k > 0 for k in ks), "top1" if all(ks[i] == 1 for i in rows) else "topk")


def hidden_rows(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``hidden[rows]`` (a new tensor) for certifying some rows of a batch apart from the others,
    all NaN where some row of the *whole* batch is not finite: :func:`vllm_csv.head.bounds.prepare`
    then certifies none of them, as it does for a batch of its own (the dense GEMM of the batch,
    which gives the other rows' and the full path's values, may write NaN over finite rows; its
    docstring). A tensor op, no host sync; a pass over ``[B, d]``."""
    return torch.where(torch.isfinite(hidden).all(), hidden[rows], math.nan)


def time_call(fn: Callable[[], object], like: torch.Tensor) -> float:
    """Seconds ``fn()`` takes, with the device of ``like`` synchronised on both sides (CUDA: a
    host clock needs the device's work done; a host sync, off the hot path: a batch size's first
    dense estimate)."""
    if like.is_cuda:
        torch.cuda.synchronize(like.device)
    t0 = clock.now()
    fn()
    if like.is_cuda:
        torch.cuda.synchronize(like.device)
    return clock.now() - t0


def sampler_logits(selector, hidden: torch.Tensor, topk: torch.Tensor,
                   dense_fn: Callable[[torch.Tensor], torch.Tensor], t0: float | None = None,
                   temperature: torch.Tensor | None = None, exclude: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, StepStats]:
    """One step of ``selector`` (:meth:`CertifiedHead.sampler_logits` has the parameters);
    sets ``selector.last_certified`` (``[B]`` bool, host) for the plugin's per-mode counts, and
    ``selector.last_top1``: where every row tried ``k = 1`` on the whole batch, each certified
    row's token (``[B]`` int64, :attr:`Selection.top1`; the argmax of its output row), else None
    (the plugin hands it to readers that need only argmaxes: :class:`~vllm_csv.vllm_plugin.step.Top1`).
    ``exclude``: tokens left out of every row's certificate (:meth:`Selector.select`)."""
    t0 = clock.now() if t0 is None else t0
    B, dev = hidden.shape[0], hidden.device
    # decided on the host, as Python lists (B numbers; no device sync)
    ks, rows, csv_rows, _ = row_split(topk.tolist(), selector.max_certified_k)
    stats = StepStats(rows=B, csv_rows=csv_rows, screen=selector.screen_name)
    stats.fallbacks["unsupported"] = csv_rows - len(rows)
    tried = bool(rows)
    selector.last_top1 = None
    if tried and not selector.arithmetic_ok():  # (the selection would refuse every row: skip it)
        stats.fallbacks["arithmetic"] = len(rows)
        tried = False
    if tried:
        every = len(rows) == B  # (then no gather of the rows)
        ridx = None if every else torch.tensor(rows, device=dev)
        k = torch.tensor([ks[i] for i in rows], device=dev)
        temp = None if temperature is None else temperature.cpu().float()
        if temp is not None and not every:
            temp = temp[torch.tensor(rows)]
        sel = selector.select(hidden if every else hidden[ridx], k, k >= 2, None if temp is None else temp.to(dev),
                              exclude)
        certified = sel.certified.cpu()  # (host sync: the step's account and the dense merge are host decisions)
        if every:
            out = selector.output(sel.exact)
            selector.last_certified = certified
            selector.last_top1 = sel.top1
        else:
            out = torch.empty((B, selector.vocab_size), dtype=selector.dtype, device=dev)
            out[ridx] = selector.output(sel.exact)
            selector.last_certified = torch.zeros(B, dtype=torch.bool)
            selector.last_certified[rows] = certified
        cert = certified.tolist()
        stats.certified = sum(cert)
        for r in sel.reason:
            if r is not None:
                stats.fallbacks[r] += 1
        stats.scored = [n for n, c in zip(sel.scored.tolist(), cert) if c]
        done = {i for i, c in zip(rows, cert) if c}
        dense_rows = [i for i in range(B) if i not in done]
        if dense_rows:
            idx = torch.tensor(dense_rows, device=dev)
            # Dense rows come from the dense head run on the *whole* batch: bit for bit what the
            # engine computes without CSV (GEMM rounding depends on the batch shape), and no
            # dearer than on a few rows, since reading W dominates a skinny GEMM.
            out[idx] = dense_fn(hidden)[idx].to(selector.dtype)
    else:  # every row dense: the engine's own output, not a copy of it
        selector.last_certified = torch.zeros(B, dtype=torch.bool)
        out = dense_fn(hidden).to(selector.dtype)
    selector.backend.synchronize(dev)  # (CUDA: the step's time is read on the host clock)
    stats.seconds = clock.now() - t0
    return out, stats
