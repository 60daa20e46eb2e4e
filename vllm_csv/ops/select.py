"""The certified step's candidate search on the CPU, fused (``csrc/cpu/select_cpu.cpp``), beside
its torch reference and its fake implementation: from the screen's values ``y``, the tokens whose
dense logit may reach the row's k-th largest, read from ``y`` once, as block maxima.

Why fused: the screen's GEMM streams the whole int8 head (50-150 MB) through the caches and
evicts the code of the torch ops that follow, which then run cold (30-200 us instead of 2-10);
the reference's search is many of them (block maxima, top-k, the threshold's fp32 operations, the
candidate masks). Where the kernels are not built (:mod:`vllm_csv.ops.build`), or on another
device, every call takes the reference. The passes before the search are :mod:`vllm_csv.ops.rows`;
the exact scores and the certificate after it, :mod:`vllm_csv.ops.step`.

Ops (``torch.ops.vllm_csv_cpu.*``):

* :func:`select_candidates`: the two-sided threshold search of
  :meth:`vllm_csv.head.CertifiedHead._select_two_sided`.

Beside it, its parts that others share: :func:`block_max` and :func:`block_cols` (the sharded
head's search, :mod:`vllm_csv.sharded`; the VNNI GEMM takes the same maxima in its own pass,
:meth:`vllm_csv.ops.int8_vnni.VnniInt8Linear.linear_block_max`); and its own threshold,
:func:`threshold_from`. (The GPU step no longer repeats it: it bounds each token by its own
terms in its screen's epilogue, :mod:`vllm_csv.gpu.screen`, and selects on those bounds,
:mod:`vllm_csv.gpu.select`.)

The op asks per call whether the kernels run on its tensors (built, and on the CPU) and takes
``select_candidates_cpu`` or ``select_candidates_ref``; ``select_candidates_cpu`` is the kernel
path alone, for what binds its backend once, when a head is built
(:class:`vllm_csv.head.backend.CpuKernels`): no check of the build a call.

The kernel follows its reference operation by operation (fp32, scalars rounded to fp32 as torch
rounds a Python number), so the outputs agree bit for bit (``tests/test_select.py``).
"""

from __future__ import annotations

import math

import torch

from ..fp import FP32_UNIT_ROUNDOFF
from .build import BLOCK, fake, uses_kernels


def block_max(y: torch.Tensor) -> torch.Tensor:
    """``[B, ceil(V / BLOCK)]`` maxima of consecutive blocks of ``y [B, V]`` (NaN propagates)."""
    B, V = y.shape
    full = V // BLOCK * BLOCK
    parts = [y[:, :full].reshape(B, -1, BLOCK).amax(2)] if full else []
    if full < V:
        parts.append(y[:, full:].amax(1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def block_cols(blocks: torch.Tensor, V: int) -> torch.Tensor:
    """The token ids of ``blocks`` (ascending)."""
    cols = (blocks[:, None] * BLOCK + torch.arange(BLOCK, device=blocks.device)[None]).reshape(-1)
    return cols[cols < V]


def exclude_columns(y: torch.Tensor, bmax: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor | None:
    """Leave the tokens ``ids [n]`` out of a search: ``y [B, V]``'s columns ``ids`` set to ``-inf``
    in place (never a candidate, never a row's largest or k-th value), and ``bmax`` (its block
    maxima, :func:`block_max`, or None) returned as those of the new ``y``: the maxima of the
    blocks holding ``ids`` taken again (``[B, n]`` reads, not a pass over ``y``)."""
    y.index_fill_(1, ids, -math.inf)
    if bmax is None or not ids.numel():
        return bmax
    B, V = y.shape
    blocks = (ids // BLOCK).unique()
    cols = block_cols(blocks, V)  # ascending, block by block
    seg = torch.div(cols, BLOCK, rounding_mode="floor")
    seg = torch.searchsorted(blocks, seg)  # each column's block among ``blocks``
    new = torch.full((B, blocks.numel()), -math.inf, dtype=y.dtype, device=y.device)
    new.scatter_reduce_(1, seg[None].expand(B, -1), y[:, cols], "amax")
    out = bmax.clone()
    out[:, blocks] = new.to(bmax.dtype)
    return out


def threshold_from(y1, yk, hnorm, e, ok, rad_max: float, act_coef: float, tiny: float, bslack_max: float,
                   delta: float, limit: float, babs_max: float):
    """``(tau, thr, ok)``, each ``[B]``, from a row's largest screen value ``y1`` and a lower bound
    ``yk`` of its k-th largest (the search of :func:`select_candidates_ref`, whose arguments these
    are): ``tau`` a lower bound of the row's k-th largest dense logit, ``thr`` the screen value
    below which a token's dense upper bound is below ``tau`` (NaN on rows that cannot be
    certified, which then add no candidates), ``ok`` with the overflow check added. fp32, in
    this order of operations."""
    act = act_coef * e if e is not None else 0.0
    spread = rad_max * hnorm + act + tiny + bslack_max
    ok = ok & ((y1 + delta * y1.abs() + spread + babs_max) <= limit)  # False on NaN
    tau = yk - delta * yk.abs() - spread
    s = tau - spread
    thr = torch.where(s >= 0, s / (1 + delta), s / (1 - delta))
    thr = thr - thr.abs() * (8 * FP32_UNIT_ROUNDOFF) - tiny  # rounding of this very line
    return tau, thr.masked_fill(~ok, math.nan), ok


def select_candidates_ref(y, row_scale, k, hnorm, e, ok, rad_max: float, act_coef: float, tiny: float,
                          bslack_max: float, delta: float, limit: float, babs_max: float, budget: int,
                          bmax: torch.Tensor | None = None):
    """The threshold search of :meth:`vllm_csv.head.CertifiedHead._select_two_sided` (its
    docstring has the argument): ``(ids [S] int64 ascending, tau [B] fp32, ok [B], live [B])``.

    Parameters
    ----------
    y : torch.Tensor
        ``[B, V]`` fp32 screen values; the center is ``fl(y * row_scale[:, None])`` if
        ``row_scale [B]`` is given, else ``y``.
    k : torch.Tensor
        ``[B]`` int64, ``k >= 1``.
    hnorm, e : torch.Tensor
        ``[B]`` fp32: ``||h_b||`` rounded up; the screen's activation term (or None).
    ok : torch.Tensor
        ``[B]`` bool: rows that may be certified (returned with the overflow check added).
    rad_max, act_coef, tiny, bslack_max, delta, limit, babs_max : float
        ``spread_b = rad_max ||h_b|| + act_coef e_b + tiny + bslack_max``, the relative
        term ``delta`` and the engine's ``limit`` (:meth:`_select_two_sided`).
    budget : int
        Most candidates a row may have (more: not ``live``).
    bmax : torch.Tensor, optional
        ``[B, ceil(V / BLOCK)]`` fp32, :func:`block_max` of ``y`` when the screen's GEMM already
        took it (:meth:`vllm_csv.ops.int8_vnni.VnniInt8Linear.linear_block_max`); else computed here.

    Every token outside ``ids`` has a dense upper bound ``< tau_b`` on every row that is
    ``ok & live``; rows that are not ``ok`` add no candidates."""
    B, V = y.shape
    rs = row_scale
    kmax = int(k.max())
    bmax = block_max(y) if bmax is None else bmax  # [B, nb]: the one full read of y
    if rs is not None:
        bmax = bmax * rs[:, None]  # = the block maxima of fl(y * rs): exact and monotone
    if kmax == 1:
        y1 = yk = bmax.amax(1)
    elif kmax <= bmax.shape[1]:
        top = bmax.topk(kmax, dim=1).values
        y1, yk = top[:, 0], top.gather(1, (k - 1)[:, None])[:, 0]
    else:  # fewer blocks than k (a small vocabulary): the exact k-th value
        top = y.topk(kmax, dim=1).values
        if rs is not None:
            top = top * rs[:, None]
        y1, yk = top[:, 0], top.gather(1, (k - 1)[:, None])[:, 0]
    tau, thr, ok = threshold_from(y1, yk, hnorm, e, ok, rad_max, act_coef, tiny, bslack_max, delta, limit,
                                  babs_max)
    thr = thr[:, None]
    blocks = bmax >= thr  # [B, nb]: blocks that hold a candidate
    live = blocks.sum(1) <= budget  # each such block holds at least one candidate
    cols = block_cols((blocks[live] if B > 1 else blocks).any(0).nonzero().squeeze(1), V)
    cand = (y[:, cols] if rs is None else y[:, cols] * rs[:, None]) >= thr
    live &= cand.sum(1) <= budget
    ids = cols[(cand[live] if B > 1 else cand).any(0)]
    return ids, tau, ok, live


def select_candidates(y, row_scale, k, hnorm, e, ok, rad_max, act_coef, tiny, bslack_max, delta, limit,
                      babs_max, budget, bmax=None):
    """Same as :func:`select_candidates_ref` (the same ``ids``, bit for bit); one call on the CPU."""
    fn = select_candidates_cpu if uses_kernels(y) else select_candidates_ref
    return fn(y, row_scale, k, hnorm, e, ok, rad_max, act_coef, tiny, bslack_max, delta, limit, babs_max, budget, bmax)


def select_candidates_cpu(y, row_scale, k, hnorm, e, ok, rad_max, act_coef, tiny, bslack_max, delta, limit,
                          babs_max, budget, bmax=None):
    """:func:`select_candidates` on the kernels (module docstring: ``*_cpu``)."""
    return torch.ops.vllm_csv_cpu.select_candidates(y, row_scale, bmax, k, hnorm, e, ok, rad_max, act_coef, tiny,
                                                    bslack_max, delta, limit, babs_max, budget)


# ---- fake implementation (shapes only: tracing, torch.compile) -------------------------------
@fake("select_candidates")
def _(y, row_scale, bmax, k, hnorm, e, ok, *scalars):
    B = y.shape[0]
    S = torch.library.get_ctx().new_dynamic_size()
    return (y.new_empty(S, dtype=torch.long), y.new_empty(B), y.new_empty(B, dtype=torch.bool),
            y.new_empty(B, dtype=torch.bool))
