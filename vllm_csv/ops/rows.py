"""The certified step's per-row passes on the CPU, fused (``csrc/cpu/rows_cpu.cpp``), each beside its
torch reference and its fake implementation: each reads the rows of one tensor (the hidden states
``h [B, d]`` or the screen's values ``y [B, V]``) once, where its reference takes several torch ops.

Why fused: the screen's GEMM streams the whole int8 head (50-150 MB) through the caches and
evicts the code of the torch ops that follow, which then run cold (30-200 us instead of 2-10).
Where the kernels are not built (:mod:`vllm_csv.ops.build`), or on another device, every call
takes the reference. The search that follows is :mod:`vllm_csv.ops.select`; the scores and
certificate after it, :mod:`vllm_csv.ops.step`.

Ops (``torch.ops.vllm_csv_cpu.*``):

* :func:`prepare_rows`: ``||h_b||`` rounded up and which rows may be certified;
* :func:`abs_max_rows`, :func:`outlier_rows`: a row's largest ``|y|``; the int8 screen's outliers;
* :func:`interval_rows`: the screen's intervals around its centres, in one pass (the sampling
  path's bounds on every token, :meth:`vllm_csv.head.CertifiedHead._intervals`);
* :func:`quantize_act7`: the FBGEMM screen's activation quantisation (its docstring's ``t_b``,
  ``p_b``, ``e_b`` and the folded scale ``c``).

Each op ``X`` asks per call whether the kernels run on its tensors (built, and on the CPU) and
takes ``X_cpu`` or ``X_ref``; ``X_cpu`` is the kernel path alone (with the layout checks that
may still send a call to the reference), for what binds its backend once, when a head or screen
is built (:class:`vllm_csv.head.backend.CpuKernels`, the screens): no check of the build a call.

Each kernel follows its reference operation by operation (fp32 where the reference is fp32), so
the outputs agree bit for bit, except the float64 sums (norms), which the kernels take in index
order and torch in its own: the bounds hold for any order (see each reference), and the two may
differ in the last bit of ``hnorm`` and ``e`` (``tests/test_rows.py``).
"""

from __future__ import annotations

import math

import torch

from ..fp import FP32_UNIT_ROUNDOFF, round_up32
from .build import K_MIN, fake, uses_kernels
from .fbgemm import ACT_MAX, ACT_MIN, C_MAX_LOG2, C_MIN_LOG2

S_MIN = 2.0**-126  # smallest normal fp32

# ---- prepare_rows ---------------------------------------------------------------------------
def prepare_rows_ref(h: torch.Tensor, certifiable: bool):
    """``(hm, hnorm, ok)`` for ``h [B, d]``: ``hnorm [B]`` fp32 = ``||h_b||`` computed in float64
    and rounded up (0 where not ``ok``); ``ok [B]`` bool = the norm is finite (no NaN/inf in
    ``h_b``, no overflow), no entry is below fp32's smallest normal but zero (an engine that reads
    subnormal inputs as zero, as AVX512-BF16 and AMX dot products do, would drop it:
    :func:`vllm_csv.dense_engine.flush_slack`) and ``certifiable``; ``hm`` = ``h`` with the rows
    that are not ``ok`` zeroed, so that they add no candidates."""
    n64 = h.double().norm(dim=1)
    n32 = round_up32(n64)
    ok = torch.isfinite(n32) & ~has_subnormal(h, dim=1)
    if not certifiable:
        ok = torch.zeros_like(ok)
    return h.masked_fill(~ok[:, None], 0), n32.masked_fill(~ok, 0), ok


def has_subnormal(x: torch.Tensor, dim: int | None = None, chunk: int = 8192) -> torch.Tensor:
    """Whether ``x`` holds a non-zero value below fp32's smallest normal (along ``dim``, or at all:
    then in chunks of rows, so that a head's check makes no temporaries of its size)."""
    def sub(t):
        return (t != 0) & (t.abs() < torch.finfo(torch.float32).tiny)
    if dim is not None:
        return sub(x).any(dim)
    return torch.tensor(any(bool(sub(x[a : a + chunk]).any()) for a in range(0, max(1, x.shape[0]), chunk)))


def prepare_rows(h: torch.Tensor, certifiable: bool):
    """Same as :func:`prepare_rows_ref` (``hnorm`` summed in index order); one pass on the CPU."""
    return prepare_rows_cpu(h, certifiable) if uses_kernels(h) else prepare_rows_ref(h, certifiable)


def prepare_rows_cpu(h: torch.Tensor, certifiable: bool):
    """:func:`prepare_rows` on the kernels (module docstring: ``*_cpu``)."""
    return torch.ops.vllm_csv_cpu.prepare_rows(h, certifiable)


@fake("prepare_rows")
def _(h, certifiable):
    B = h.shape[0]
    return torch.empty_like(h), h.new_empty(B, dtype=torch.float32), h.new_empty(B, dtype=torch.bool)


# ---- abs_max_rows ---------------------------------------------------------------------------
def abs_max_rows_ref(y: torch.Tensor) -> torch.Tensor:
    """``[B]`` float32: ``max_i |y[b, i]|`` of ``y [B, V]`` float32 (NaN if the row has a NaN)."""
    ymin, ymax = torch.aminmax(y, dim=1)  # NaN and inf propagate
    return torch.maximum(ymax, ymin.neg_())


def abs_max_rows(y: torch.Tensor) -> torch.Tensor:
    """Same as :func:`abs_max_rows_ref`, one pass over each row on the CPU (``torch.aminmax`` took
    0.7 ms for 8 rows of 65536 here)."""
    return abs_max_rows_cpu(y) if uses_kernels(y) else abs_max_rows_ref(y)


def abs_max_rows_cpu(y: torch.Tensor) -> torch.Tensor:
    """:func:`abs_max_rows` on the kernels (module docstring: ``*_cpu``)."""
    return torch.ops.vllm_csv_cpu.abs_max_rows(y) if y.dim() == 2 else abs_max_rows_ref(y)


@fake("abs_max_rows")
def _(y):
    return y.new_empty(y.shape[0])


# ---- outlier_rows ---------------------------------------------------------------------------
def outlier_rows_ref(h: torch.Tensor, ratio: float, m: int) -> torch.Tensor:
    """``[B]`` bool: the row's largest ``|h_bj|`` exceeds ``ratio`` times the rms of the row without
    its ``m`` largest ``|h|`` (float64; rows of at most ``2 m`` channels, zero rows and rows with
    NaN/inf: False). The int8 screen's test for outlier channels
    (:func:`vllm_csv.screens.fbgemm.outlier_channels`)."""
    B, d = h.shape
    if d <= 2 * m:
        return torch.zeros(B, dtype=torch.bool)
    a = h.double().abs()
    finite = torch.isfinite(a).all(1)
    top = a.nan_to_num(0.0, 0.0, 0.0).topk(m, dim=1).values
    rest = ((a.pow(2).sum(1) - top.pow(2).sum(1)).clamp_min(0) / (d - m))
    return finite & (top[:, 0] > 0) & (top[:, 0].pow(2) > ratio * ratio * rest)


def outlier_rows(h: torch.Tensor, ratio: float, m: int) -> torch.Tensor:
    """Same as :func:`outlier_rows_ref` (the float64 sums in index order): one pass a row on the
    CPU, where the reference's sort-free torch ops still took 180 us for eight rows of 768."""
    return outlier_rows_cpu(h, ratio, m) if uses_kernels(h) else outlier_rows_ref(h, ratio, m)


def outlier_rows_cpu(h: torch.Tensor, ratio: float, m: int) -> torch.Tensor:
    """:func:`outlier_rows` on the kernels (module docstring: ``*_cpu``)."""
    return torch.ops.vllm_csv_cpu.outlier_rows(h, ratio, m) if h.dim() == 2 else outlier_rows_ref(h, ratio, m)


@fake("outlier_rows")
def _(h, ratio, m):
    return h.new_empty(h.shape[0], dtype=torch.bool)


# ---- interval_rows --------------------------------------------------------------------------
def interval_rows_ref(y: torch.Tensor, c: torch.Tensor, rad: torch.Tensor, hnorm: torch.Tensor,
                      bslack: torch.Tensor | None, nn: torch.Tensor | None, e: torch.Tensor | None,
                      two_sided: bool) -> torch.Tensor:
    """The screen's intervals around its centres (:meth:`vllm_csv.head.CertifiedHead._intervals`).

    Parameters
    ----------
    y : torch.Tensor
        ``[B, V]`` float32, the centres; overwritten with ``y - m`` where ``two_sided``.
    c, hnorm : torch.Tensor
        ``[B]`` float32: each row's constant part of the half-width and ``||h||``.
    rad : torch.Tensor
        ``[V]`` float32, each token's radius (per unit of ``||h||``).
    bslack, nn : torch.Tensor or None
        ``[V]`` float32: the bias slack; the activation-error coefficient (with ``e``).
    e : torch.Tensor or None
        ``[B]`` float32, the activation quantisation error (with ``nn``).
    two_sided : bool

    Returns
    -------
    ``hi = y + m`` (``[B, V]`` float32), ``m = (c + bslack) + rad hnorm + nn e`` in fp32, operation
    by operation (torch 2.13's CPU ``addcmul`` rounds each ``self + t1 t2`` once, a fused
    multiply-add: the kernel does the same, and ``tests/test_rows.py`` checks the bits); ``y``
    holds ``lo = y - m`` where ``two_sided``.
    """
    m = torch.addcmul(c[:, None] + bslack[None] if bslack is not None else c[:, None], rad[None], hnorm[:, None])
    if nn is not None:
        m.addcmul_(nn[None], e[:, None])
    hi = y + m
    if two_sided:
        y.sub_(m)
    return hi


def interval_rows(y: torch.Tensor, c: torch.Tensor, rad: torch.Tensor, hnorm: torch.Tensor,
                  bslack: torch.Tensor | None, nn: torch.Tensor | None, e: torch.Tensor | None,
                  two_sided: bool) -> torch.Tensor:
    """Same as :func:`interval_rows_ref` (the same bits), one pass over ``y`` on the CPU where
    the kernel is built and every vector has its length (the reference makes five, through a
    ``[B, V]`` half-width: 0.37 against 0.10 ms for 8 rows of 65536 and 3.2 against 0.8 ms for 32,
    two threads, :mod:`~vllm_csv.cpu_malloc` tuned, measured 2026-11-26)."""
    fn = interval_rows_cpu if uses_kernels(y) else interval_rows_ref
    return fn(y, c, rad, hnorm, bslack, nn, e, two_sided)


def interval_rows_cpu(y, c, rad, hnorm, bslack, nn, e, two_sided):
    """:func:`interval_rows` on the kernels (module docstring: ``*_cpu``), where every vector has
    its length and ``y`` its layout (else the reference)."""
    B, V = y.shape
    f32 = [(t, n) for t, n in ((c, B), (rad, V), (hnorm, B), (bslack, V), (nn, V), (e, B)) if t is not None]
    if y.is_contiguous() and y.dtype == torch.float32 and \
            all(t.dtype == torch.float32 and t.shape == (n,) for t, n in f32):
        return torch.ops.vllm_csv_cpu.interval_rows(y, c, rad, hnorm, bslack, nn, e, two_sided)
    return interval_rows_ref(y, c, rad, hnorm, bslack, nn, e, two_sided)


@fake("interval_rows")
def _(y, c, rad, hnorm, bslack, nn, e, two_sided):
    return torch.empty_like(y)


# ---- quantize_act7 -------------------------------------------------------------------------
def fold_scale(k: int, s_min: float, s_max: float) -> float | None:
    """``c = 2^(k - 6)`` if FBGEMM can apply it exactly (:mod:`vllm_csv.screens.fbgemm`), else None."""
    j = k - 6
    if not C_MIN_LOG2 <= j <= C_MAX_LOG2:
        return None
    c = 2.0**j
    if s_min * c < S_MIN or s_max * c >= 2.0**127:
        return None
    return c


def quantize_act7_ref(h: torch.Tensor, s_min: float, s_max: float):
    """The FBGEMM screen's activations (:mod:`vllm_csv.screens.fbgemm`, whose docstring has the
    proof): ``(x [B, d + 2] fp32, row_scale [B] fp32, e [B] fp32, c)``.

    Per row ``t_b = 2^k_b >= max|h_b|`` and ``p_b = clamp(round(h_b / (t_b / 64)), -64, 63)``
    (rows that are zero, non-finite or below ``2^K_MIN``: ``k_b = 0``, ``p_b = 0``);
    ``e_b = ||h_b - (t_b / 64) p_b||`` in float64, rounded up, times ``1 + 4u`` (plus
    ``2^-149 / s_min`` where the per-row scaling may underflow). ``c`` is the folded scale
    ``t / 64`` when every row shares ``k`` and FBGEMM applies it exactly, else ``0.0``; then
    ``x = [c p_b, -64 c, 63 c]``, else ``x = [p_b, -64, 63]`` and the center is scaled per row by
    ``row_scale = t_b / 64``."""
    hd = h.double()
    ks = []
    for a in hd.abs().amax(1).tolist():
        m, k = math.frexp(a) if math.isfinite(a) and a > 0 else (0.0, None)
        ks.append(None if k is None or k - (m == 0.5) < K_MIN else k - (m == 0.5))
    live = [k is not None for k in ks]
    kk = [0 if k is None else k for k in ks]
    scale_l = [math.ldexp(1.0, k - 6) for k in kk]  # t_b / 64, exact
    scale = torch.tensor(scale_l, dtype=torch.float64)
    p = torch.round(hd / scale[:, None]).clamp_(ACT_MIN, ACT_MAX)
    if not all(live):
        p[torch.tensor(live).logical_not_()] = 0
    f = (hd - p * scale[:, None]).norm(dim=1)  # exact residual, norm in float64
    c = fold_scale(kk[0], s_min, s_max) if kk and min(kk) == max(kk) else None
    if c is None and any(s_min * x < S_MIN for x in scale_l):
        f = f + torch.tensor([2.0**-149 / s_min if s_min * x < S_MIN else 0.0 for x in scale_l],
                             dtype=torch.float64)
    e = round_up32(f) * (1 + 4 * FP32_UNIT_ROUNDOFF)
    B, d = p.shape
    cc = 1.0 if c is None else c
    x = torch.empty((B, d + 2), dtype=torch.float32)
    torch.mul(p.float(), cc, out=x[:, :d])  # exact: 7-bit integers times a power of two
    x[:, d] = ACT_MIN * cc
    x[:, d + 1] = ACT_MAX * cc
    return x, scale.float(), e, 0.0 if c is None else c


def quantize_act7(h: torch.Tensor, s_min: float, s_max: float):
    """Same as :func:`quantize_act7_ref` (``e`` summed in index order); one pass on the CPU."""
    return quantize_act7_cpu(h, s_min, s_max) if uses_kernels(h) else quantize_act7_ref(h, s_min, s_max)


def quantize_act7_cpu(h: torch.Tensor, s_min: float, s_max: float):
    """:func:`quantize_act7` on the kernels (module docstring: ``*_cpu``)."""
    return torch.ops.vllm_csv_cpu.quantize_act7(h, s_min, s_max)


@fake("quantize_act7")
def _(h, s_min, s_max):
    B, d = h.shape
    f32 = torch.float32
    return h.new_empty(B, d + 2, dtype=f32), h.new_empty(B, dtype=f32), h.new_empty(B, dtype=f32), 1.0
