"""A sampled row's interval statistics and its live columns (``csrc/cpu/live_cpu.cpp``), each in one
pass over the row's bounds ``lo, hi``, beside its torch reference and its fake implementation.

Why fused: the draw certificate (:func:`vllm_csv.sampling.certificate.certify_draw`) and min-p
(:func:`vllm_csv.sampling.nucleus.min_p.min_p_bounds`) first read a few numbers of every row
(its largest bounds, its largest magnitude, its live count, its top few lower bounds): seven
``[R, V]`` passes in torch, ``topk`` the dearest, about 1 ms for 8 rows of 65536 tokens on 2
cores; the packed certificate then lists each row's live columns, compares and a ``nonzero`` over
``[R, V]`` bool masks that torch runs as scalar loops on the CPU (about 0.5 ms). Each kernel is one
vectorised pass. Where the kernels are not built (:mod:`vllm_csv.ops.build`), or on another
device, every call takes the reference.

Ops (``torch.ops.vllm_csv_cpu.*``):

* :func:`row_stats`: :class:`RowStats`, what the certificate and min-p read first of a row;
* :func:`pack_live`: each row's live columns (``hi != -inf``, or ``lo`` NaN), packed.

Each op ``X`` asks per call whether the kernels run on its tensors and takes ``X_cpu`` (the kernel
path alone) or ``X_ref``; :class:`vllm_csv.ops.noise.DrawOps` and
:class:`vllm_csv.ops.masks.MaskOps` bind them once for one device.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .build import fake, uses_kernels


class RowStats(NamedTuple):
    lmax: torch.Tensor  # [R] float32, max lo (NaN if the row has a NaN)
    hmax: torch.Tensor  # [R] float32, max hi (same)
    absmax: torch.Tensor  # [R] float32, max(|hmax|, -min lo, -min hi), -inf counted as 0
    live: torch.Tensor  # [R] int64, #{j: hi_j != -inf or lo_j is NaN}
    top_values: torch.Tensor  # [R, k] float32, the k largest lo, descending
    top_indices: torch.Tensor  # [R, k] int64


def _live(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``[R, n]`` bool: the live columns, ``hi != -inf`` or ``lo`` NaN (a NaN row stays live: it
    is never certified)."""
    return (hi != -math.inf) | torch.isnan(lo)


def row_stats_ref(lo: torch.Tensor, hi: torch.Tensor, k: int) -> RowStats:
    """What :func:`vllm_csv.sampling.certificate.certify_draw` reads first of bounds ``lo, hi``
    (``[R, n]`` float32, ``1 <= k <= min(16, n)``): :class:`RowStats`. ``absmax`` is meant for
    rows without NaN or ``+inf``; ties in the top ``k`` may be broken either way (the kernel
    takes the lowest index)."""
    top = lo.topk(k, dim=1)
    hmax = hi.amax(1)
    absmax = torch.maximum(hmax.abs(), torch.maximum(lo.nan_to_num(neginf=0.0).amin(1).neg_(),
                                                     hi.nan_to_num(neginf=0.0).amin(1).neg_()))
    return RowStats(lo.amax(1), hmax, absmax, _live(lo, hi).sum(1), top.values, top.indices)


def row_stats(lo: torch.Tensor, hi: torch.Tensor, k: int) -> RowStats:
    """Same as :func:`row_stats_ref`, in one pass over the rows on the CPU where the kernel is
    built (the reference's seven passes, ``topk`` the dearest, cost about 1 ms for 8 rows of
    65536 tokens on 2 cores)."""
    return row_stats_cpu(lo, hi, k) if uses_kernels(lo) else row_stats_ref(lo, hi, k)


def row_stats_cpu(lo: torch.Tensor, hi: torch.Tensor, k: int) -> RowStats:
    """:func:`row_stats` on the kernels (the build not asked again: :class:`~vllm_csv.ops.noise.DrawOps`)."""
    return RowStats(*torch.ops.vllm_csv_cpu.row_stats(lo, hi, k))


def pack_live_ref(lo: torch.Tensor, hi: torch.Tensor, n: int) -> torch.Tensor:
    """Each row's live columns, packed.

    Parameters
    ----------
    lo, hi : torch.Tensor
        ``[R, V]`` float32 bounds; a column is live where ``hi != -inf`` or ``lo`` is NaN (what
        :class:`RowStats`'s ``live`` counts).
    n : int
        At least every row's live count.

    Returns
    -------
    torch.Tensor
        ``[R, n]`` int64: row ``r``'s live columns ascending, then ``V`` (padding).
    """
    R, V = hi.shape
    live = _live(lo, hi)
    ri, ci = live.nonzero().unbind(1)  # row-major: each row's live columns ascending
    count = live.sum(1)
    if R and n < int(count.max()):
        raise RuntimeError("pack_live: a row has more than n live columns")
    cols = torch.full((R, n), V, dtype=torch.long, device=hi.device)
    start = count.cumsum(0) - count
    cols[ri, torch.arange(ri.numel(), device=hi.device) - start[ri]] = ci
    return cols


def pack_live(lo: torch.Tensor, hi: torch.Tensor, n: int) -> torch.Tensor:
    """Same as :func:`pack_live_ref`; one pass of vector compares on the CPU where the kernel is
    built (the reference's compares and ``nonzero`` over ``[R, V]`` cost about 0.5 ms for 8 rows
    of 65536 tokens on 2 cores: torch's bool passes are scalar loops here)."""
    return pack_live_cpu(lo, hi, n) if uses_kernels(hi) else pack_live_ref(lo, hi, n)


def pack_live_cpu(lo: torch.Tensor, hi: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`pack_live` on the kernels (the build not asked again: :class:`~vllm_csv.ops.noise.DrawOps`)."""
    return torch.ops.vllm_csv_cpu.pack_live(lo, hi, n)


# ---- fake implementations (shapes only: tracing, torch.compile) -------------------------------
@fake("row_stats")
def _(lo, hi, k):
    R = lo.shape[0]
    return (lo.new_empty(R), lo.new_empty(R), lo.new_empty(R), lo.new_empty(R, dtype=torch.long),
            lo.new_empty(R, k), lo.new_empty(R, k, dtype=torch.long))


@fake("pack_live")
def _(lo, hi, n):
    return lo.new_empty(lo.shape[0], n, dtype=torch.long)
