"""The certified step's exact scores and certificate on the CPU, fused (``csrc/cpu/csv_cpu.cpp``),
each beside its torch reference and its fake implementation.

Why fused: the screen's GEMM streams the whole int8 head (50-150 MB) through the caches and
evicts the code of the torch ops that follow, which then run cold (30-200 us instead of 2-10);
the references here, in :mod:`vllm_csv.ops.rows` (the per-row passes before the search) and in
:mod:`vllm_csv.ops.select` (the candidate search) run about 60 of them around each GEMM, 1-2 ms
a step. Where the kernels are not built (:mod:`vllm_csv.ops.build`), or on another device, every
call takes the reference.

Ops (``torch.ops.vllm_csv_cpu.*``):

* :func:`score_intervals`: the float64 dot products and their fp32 interval of
  :meth:`vllm_csv.head.CertifiedHead._score` (and, without a bias, the engine's rounding);
* :func:`certify_topk`: the top-k certificate of :meth:`vllm_csv.head.CertifiedHead._certify`
  for a plain engine (no soft-cap or scale) and greedy rows;
* :func:`finish_selection`: the ``[B, V]`` output of the certified rows and each row's outcome.

Each op ``X`` asks per call whether the kernels run on its tensors (built, and on the CPU) and
takes ``X_cpu`` or ``X_ref``; ``X_cpu`` is the kernel path alone (with the layout checks that
may still send a call to the reference), for what binds its backend once, when a head or screen
is built (:class:`vllm_csv.head.backend.CpuKernels`): no check of the build a call.

Each kernel follows its reference operation by operation (fp32 where the reference is fp32,
scalars rounded to fp32 as torch rounds a Python number), so the outputs agree bit for bit,
except the float64 dot products, which the kernels take in index order and torch in its own:
the bounds hold for any order (see each reference), and the two may differ in the last bit of
``a``, ``lo``, ``hi`` (``tests/test_step.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..fp import round_down32, round_up32
from ..vocabulary import KERNEL_REASONS as REASONS  # noqa: F401  (finish_selection's codes, in order)
from .build import fake, uses_kernels


# ---- score_intervals ------------------------------------------------------------------------
def score_intervals_ref(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, coef: float, tiny32: float):
    """``(a, E, lo, hi, lower, upper, z)`` for the rows ``w[ids]`` of the head, each ``[B, S]``.

    ``a = <w_j, h_b>`` in float64 (products of model-dtype numbers are exact; the sum is within
    ``gamma64_d A`` of the real one, ``A = sum_i |w_ji h_bi|``, in any order), and with
    ``E = coef A + tiny32 + 2^-52 |a|`` (float64; ``coef`` = the fp32 accumulation's
    ``gamma_(d+2)`` plus ``4 gamma64_d``: :meth:`vllm_csv.head.CertifiedHead._score`),
    ``[lo, hi]`` (fp32) = ``[a - E, a + E]`` rounded outwards holds every fp32 accumulator of
    the product. Without a bias the engine rounds the accumulator to the model dtype
    (``w.dtype``), monotone: ``lower, upper`` (fp32) = the rounded ends, and ``z`` (model dtype) =
    that value where the two agree bit for bit, else ``a`` rounded to fp32 and then to the dtype."""
    a, E, lo, hi = score_bounds_ref(h, w, ids, coef, tiny32)
    lower, upper = lo.to(w.dtype).float(), hi.to(w.dtype).float()
    z = torch.where(single_valued(lower, upper), lower, a.float()).to(w.dtype)
    return a, E, lo, hi, lower, upper, z


def score_bounds_ref(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, coef: float, tiny32: float):
    """The first four outputs of :func:`score_intervals_ref`: ``(a, E, lo, hi)``."""
    hd, wd = h.double(), w[ids].double()
    a = F.linear(hd, wd)
    E = F.linear(hd.abs(), wd.abs()).mul_(coef).add_(tiny32)
    E.add_(a.abs(), alpha=2.0**-52)  # the roundings of a - E and a + E in float64
    return a, E, round_down32(a - E), round_up32(a + E)


def score_intervals(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, coef: float, tiny32: float):
    """Same as :func:`score_intervals_ref` (sums in index order) where ``h`` has ``w``'s dtype, on the CPU."""
    fn = score_intervals_cpu if uses_kernels(h) else score_intervals_ref
    return fn(h, w, ids, coef, tiny32)


def score_intervals_cpu(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, coef: float, tiny32: float):
    """:func:`score_intervals` on the kernels (module docstring: ``*_cpu``), where ``h`` has ``w``'s dtype."""
    if h.dtype == w.dtype:
        return torch.ops.vllm_csv_cpu.score_intervals(h, w, ids, coef, tiny32)
    return score_intervals_ref(h, w, ids, coef, tiny32)


def single_valued(lower: torch.Tensor, upper: torch.Tensor) -> torch.Tensor:
    """Where the dense value is known bit for bit: ``lower`` and ``upper`` are the same value
    *and* the same sign of zero (a GEMM that cancels to ``+0.0`` and one that underflows from
    below to ``-0.0`` compare equal, but are not the same bits)."""
    return (lower == upper) & (torch.signbit(lower) == torch.signbit(upper))


@fake("score_intervals")
def _(h, w, ids, coef, tiny32):
    B, S = h.shape[0], ids.shape[0]
    f64, f32 = torch.float64, torch.float32
    return (h.new_empty(B, S, dtype=f64), h.new_empty(B, S, dtype=f64), h.new_empty(B, S, dtype=f32),
            h.new_empty(B, S, dtype=f32), h.new_empty(B, S, dtype=f32), h.new_empty(B, S, dtype=f32),
            h.new_empty(B, S))


# ---- certify_topk --------------------------------------------------------------------------
def certify_topk_ref(z, lower, upper, k, outside_high, need_values):
    """The top-k certificate of :meth:`vllm_csv.head.CertifiedHead._certify` for an engine
    without soft-cap or scale and greedy rows (no temperature): ``(ok [B], in_top [B, S])``.

    ``T`` = the ``k_b`` columns of largest ``z`` (``[B, S]``, model dtype); ``ok`` when the
    smallest ``lower`` in ``T`` beats strictly the engine's rounding (to ``z.dtype``) of the
    largest ``upper`` outside ``T`` and of ``outside_high`` (an upper bound of every unscored
    token), is finite, and, where ``need_values``, every value in ``T`` is known bit for bit."""
    kmax = int(k.max())
    top = z.float().topk(kmax, dim=1).indices
    in_top = torch.zeros(z.shape, dtype=torch.bool, device=z.device).scatter_(
        1, top, torch.arange(kmax, device=z.device)[None] < k[:, None])
    low = lower.masked_fill(~in_top, math.inf).amin(1)
    high = upper.masked_fill(in_top, -math.inf).amax(1)
    ok = (low > torch.maximum(high, outside_high).to(z.dtype).float()) & torch.isfinite(low)
    ok &= (single_valued(lower, upper) | ~in_top).all(1) | ~need_values
    return ok, in_top


def certify_topk(z, lower, upper, k, outside_high, need_values):
    """Same as :func:`certify_topk_ref`; one call on the CPU where the kernel is built."""
    fn = certify_topk_cpu if uses_kernels(z) else certify_topk_ref
    return fn(z, lower, upper, k, outside_high, need_values)


def certify_topk_cpu(z, lower, upper, k, outside_high, need_values):
    """:func:`certify_topk` on the kernels (module docstring: ``*_cpu``)."""
    return torch.ops.vllm_csv_cpu.certify_topk(z, lower, upper, k, outside_high, need_values)


@fake("certify_topk")
def _(z, lower, upper, k, outside_high, need_values):
    return z.new_empty(z.shape[0], dtype=torch.bool), z.new_empty(z.shape, dtype=torch.bool)


# ---- finish_selection ----------------------------------------------------------------------
def finish_selection_ref(V: int, ids, z, in_top, ok, live, cert):
    """``(exact [B, V] z.dtype, code [B] int64)``: ``exact`` holds ``z`` on the columns ``ids``
    where ``in_top``, ``-inf`` elsewhere; ``code`` indexes :data:`REASONS`: 0 certified
    (``ok & live & cert``), else 1 not ``ok`` (inputs or bounds unusable), 2 not ``live`` (too
    many candidates), 3 not certified."""
    B = ok.shape[0]
    exact = torch.full((B, V), -math.inf, dtype=z.dtype, device=z.device)
    exact[:, ids] = z.masked_fill(~in_top, -math.inf)
    return exact, outcome_codes(ok & live & cert, ok, live)


def outcome_codes(certified, ok, live) -> torch.Tensor:
    """``[B]`` int64, indexes of :data:`REASONS`: 0 ``certified``, else 1 not ``ok``, 2 not
    ``live``, 3 not certified."""
    return torch.where(certified, 0, torch.where(~ok, 1, torch.where(~live, 2, 3)))


def finish_selection(V: int, ids, z, in_top, ok, live, cert):
    """Same as :func:`finish_selection_ref`; one call on the CPU where the kernel is built."""
    fn = finish_selection_cpu if uses_kernels(z) else finish_selection_ref
    return fn(V, ids, z, in_top, ok, live, cert)


def finish_selection_cpu(V: int, ids, z, in_top, ok, live, cert):
    """:func:`finish_selection` on the kernels (module docstring: ``*_cpu``)."""
    return torch.ops.vllm_csv_cpu.finish_selection(V, ids, z, in_top, ok, live, cert)


@fake("finish_selection")
def _(V, ids, z, in_top, ok, live, cert):
    return z.new_empty(ok.shape[0], V), ids.new_empty(ok.shape[0])
