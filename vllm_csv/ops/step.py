"""The certified step's candidate search, exact scores and certificate on the CPU, fused
(``csrc/cpu/csv_cpu.cpp``), each beside its torch reference and its fake implementation.

Why fused: the screen's GEMM streams the whole int8 head (50-150 MB) through the caches and
evicts the code of the torch ops that follow, which then run cold (30-200 us instead of 2-10);
the references here and in :mod:`vllm_csv.ops.rows` (the per-row passes before the search) run
about 60 of them around each GEMM, 1-2 ms a step. Where the kernels are not built
(:mod:`vllm_csv.ops.build`), or on another device, every call takes the reference.

Ops (``torch.ops.vllm_csv_cpu.*``):

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

from ..fp import FP32_UNIT_ROUNDOFF, round_down32, round_up32
from ..vocabulary import KERNEL_REASONS as REASONS  # noqa: F401  (finish_selection's codes, in order)
from .build import BLOCK, fake, uses_kernels


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
