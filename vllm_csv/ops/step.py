"""The certified step's small passes on the CPU, fused (``csrc/cpu/csv_cpu.cpp``), each beside its
torch reference and its fake implementation.

Why fused: the screen's GEMM streams the whole int8 head (50-150 MB) through the caches and
evicts the code of the torch ops that follow, which then run cold (30-200 us instead of 2-10);
the references below run about 60 of them around each GEMM, 1-2 ms a step. Where the kernels
are not built (:mod:`vllm_csv.ops.build`), or on another device, every call takes the reference.

Ops (``torch.ops.vllm_csv_cpu.*``):

* :func:`prepare_rows`: ``||h_b||`` rounded up and which rows may be certified;
* :func:`abs_max_rows`, :func:`outlier_rows`: a row's largest ``|y|``; the int8 screen's outliers;
* :func:`interval_rows`: the screen's intervals around its centres, in one pass (the sampling
  path's bounds on every token, :meth:`vllm_csv.head.CertifiedHead._intervals`);
* :func:`quantize_act7`: the FBGEMM screen's activation quantisation (its docstring's ``t_b``,
  ``p_b``, ``e_b`` and the folded scale ``c``);
* :func:`select_candidates`: the two-sided threshold search of
  :meth:`vllm_csv.head.CertifiedHead._select_two_sided`;
* :func:`score_intervals`: the float64 dot products and their fp32 interval of
  :meth:`vllm_csv.head.CertifiedHead._score` (and, without a bias, the engine's rounding);
* :func:`certify_topk`: the top-k certificate of :meth:`vllm_csv.head.CertifiedHead._certify`
  for a plain engine (no soft-cap or scale) and greedy rows;
* :func:`finish_selection`: the ``[B, V]`` output of the certified rows and each row's outcome.

Each op ``X`` asks per call whether the kernels run on its tensors (built, and on the CPU) and
takes ``X_cpu`` or ``X_ref``; ``X_cpu`` is the kernel path alone (with the layout checks that
may still send a call to the reference), for what binds its backend once, when a head or screen
is built (:class:`vllm_csv.head.backend.CpuKernels`, the screens): no check of the build a call.

Each kernel follows its reference operation by operation (fp32 where the reference is fp32,
scalars rounded to fp32 as torch rounds a Python number), so the outputs agree bit for bit,
except the float64 sums (norms, dot products), which the kernels take in index order and
torch in its own: the bounds hold for any order (see each reference), and the two may differ
in the last bit of ``hnorm``, ``e``, ``a``, ``lo``, ``hi`` (``tests/test_step.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..fp import FP32_UNIT_ROUNDOFF, round_down32, round_up32
from ..vocabulary import KERNEL_REASONS as REASONS  # noqa: F401  (finish_selection's codes, in order)
from .build import BLOCK, K_MIN, fake, uses_kernels
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
    multiply-add: the kernel does the same, and ``tests/test_step.py`` checks the bits); ``y``
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


# ---- select_candidates ----------------------------------------------------------------------
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


def threshold_from(y1, yk, hnorm, e, ok, rad_max: float, act_coef: float, tiny: float, bslack_max: float,
                   delta: float, limit: float, babs_max: float):
    """``(tau, thr, ok)``, each ``[B]``, from a row's largest screen value ``y1`` and a lower bound
    ``yk`` of its k-th largest (the search of :func:`select_candidates_ref`, whose arguments these
    are): ``tau`` a lower bound of the row's k-th largest dense logit, ``thr`` the screen value
    below which a token's dense upper bound is below ``tau`` (NaN on rows that cannot be
    certified, which then add no candidates), ``ok`` with the overflow check added. fp32, in
    this order of operations (the GPU step's select kernel repeats them one for one)."""
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


@fake("select_candidates")
def _(y, row_scale, bmax, k, hnorm, e, ok, *scalars):
    B = y.shape[0]
    S = torch.library.get_ctx().new_dynamic_size()
    return (y.new_empty(S, dtype=torch.long), y.new_empty(B), y.new_empty(B, dtype=torch.bool),
            y.new_empty(B, dtype=torch.bool))


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
