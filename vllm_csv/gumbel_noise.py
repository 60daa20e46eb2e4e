"""vLLM's Model Runner V2 Gumbel noise (CUDA), recomputable for any token: the hash and uniform bit
for bit, the noise bounded, and the constants of V2's temperature and of the comparison in its
draw; and V2's other random stream, the verification's Philox uniform (:func:`philox_uniform`). Plain facts about vLLM's kernel, below every layer that certifies with them (the CPU
certificate :mod:`vllm_csv.sampling.gumbel_v2`, which re-exports all of this and has the argument
in its docstring, and the device draw :mod:`vllm_csv.gpu.gumbel_draw`, its replica on the device
:mod:`vllm_csv.gpu.gumbel_jit`).

    r_i = murmur3_32(seed, pos, i)            (uint32; the request's seed, the token's position)
    u_i = fl32(hi16(r_i) 2^-16 + (lo16(r_i) + 0.5) 2^-32)      (exact operands, one rounding)
    g_i = -log(-L(u_i)),  L(u) = -u (1 + u/2 + ... + u^7/8)   for u < 0.25 (a series, fp32 Horner)
                                 log(max(1 - u, 2^-24))         otherwise

``r`` and ``u`` are replayed bit for bit (:func:`murmur3`, :func:`uniform`); ``g`` is bounded
(:func:`noise_bounds`: ``g(u) +- (EPS_ABS + EPS_REL |g|)`` around the real ``g(u)``).

The speculative verification's uniform (``spec_decode/rejection_sampler_utils.py``) is
``max(tl.rand(seed, pos), RAND_MIN)``: Triton's Philox 4x32-10, replayed bit for bit in torch
integer ops on any device, with no host read (:func:`philox_uniform`; the device's kernel is
:mod:`vllm_csv.gpu.philox`).
"""

from __future__ import annotations

import math

import torch

from .fp import DIV_ABS, DIV_REL, DIV_T_MAX, DIV_T_MIN, round_down32, round_up32  # noqa: F401

GUMBEL_MIN = -2.9
GUMBEL_MAX = 23.5
EPS_ABS, EPS_REL = 1e-5, 1e-5  # noise bounds: g +- (EPS_ABS + EPS_REL |g|)
_M32 = 0xFFFFFFFF
RAND_MIN = 4.6566125955216364e-10  # ``tl_rand32``'s floor ``_TL_RAND_MIN`` (4.6566127342e-10) as fp32
PHILOX_A, PHILOX_B = 0xD2511F53, 0xCD9E8D57  # Philox 4x32's round multipliers
PHILOX_KA, PHILOX_KB = 0x9E3779B9, 0xBB67AE85  # its key steps
PHILOX_SCALE = 4.6566125955216364e-10  # ``uint_to_uniform_float``'s 4.6566127342e-10, as fp32
# Temperature: V2 divides the fp32 logits by T with Triton's fp32 ``/``, not the correctly
# rounded division: DIV_REL, DIV_ABS and the range of T are fp.py's (one place: the head's
# sampled top-k certificate holds for the same model of the division).
# Min-p: the kernel's fp32 ``tl.log(min_p)`` lies within LOG_ABS + LOG_REL |log(min_p)| of the
# real logarithm. libdevice's ``logf`` is within 1 ulp (2^-23 relative), an approximate
# ``lg2.approx.f32`` times ln 2 within about 2^-22 absolute near 1; these allow 2^-20 of each
# (tests/test_sampling_gumbel_v2_cuda.py measures the GPU's log against it).
LOG_ABS, LOG_REL = 2.0**-20, 2.0**-20


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    return (a * c) & _M32


def _rotl32(a: torch.Tensor, s: int) -> torch.Tensor:
    return ((a << s) | (a >> (32 - s))) & _M32


def _mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _mul32(key, 0xCC9E2D51)
    key = _mul32(_rotl32(key, 15), 0x1B873593)
    h = _rotl32(h ^ key, 13)
    return (h * 5 + 0xE6546B64) & _M32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur3(seeds: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """vLLM V2's ``murmur3_hash32(seed, pos, offset)`` (domain 0): ``[R, n]`` int64 holding uint32
    values, for ``seeds``, ``pos`` ``[R]`` int64 and token ``ids`` ``[n]`` or ``[R, n]``."""
    seeds, pos = seeds.long()[:, None], pos.long()[:, None]
    ids = ids.long() if ids.dim() == 2 else ids.long()[None]
    h = torch.zeros_like(seeds)
    h = _mix(h, seeds & _M32)
    h = _mix(h, (seeds >> 32) & _M32)
    h = _mix(h, pos & _M32)
    h = _mix(h.expand(-1, ids.shape[1]), ids & _M32)
    return _fmix(h ^ 16)


def uniform(seeds: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``u`` of the module docstring, ``[R, n]`` float32, bit for bit (both products are exact
    and the sum is one fp32 rounding, as in the kernel with or without a fused multiply-add)."""
    r = murmur3(seeds, pos, ids)
    return (r >> 16).float() * 2.0**-16 + ((r & 0xFFFF).float() + 0.5) * 2.0**-32


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32 bits of ``a * b`` (``a``, ``b`` below ``2^32``; ``b`` int64) in int64
    without overflow: ``b`` split into 16-bit halves, every partial product below ``2^49``."""
    pl, ph = a * (b & 0xFFFF), a * (b >> 16)
    mid = pl + ((ph & 0xFFFF) << 16)
    return (ph >> 16) + (mid >> 32), mid & _M32


def philox_uniform(seeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """V2's verification uniform ``tl_rand32(seed, pos, includes_zero=False)``, bit for bit.

    Triton's ``tl.rand(seed, offset)`` (``triton/language/random.py``, the same Philox since
    2.x; tests hold it to Triton's own, interpreted and compiled): ``randint4x``'s first word of
    Philox 4x32 with 10 rounds, counter ``(offset_lo, offset_hi, 0, 0)``, key ``(seed_lo,
    seed_hi)``, read as int32 ``x`` and mapped to ``fl32(fl32(x') * fl32(4.6566127342e-10))``,
    ``x' = x`` or ``-x - 1`` where negative; vLLM then clamps it below at the same constant.
    Elementwise torch on ``seeds``' device: no host read, fixed shapes.

    Parameters
    ----------
    seeds, pos : torch.Tensor
        ``[N]`` int64 (the request's seed, the row's position), on one device.

    Returns
    -------
    torch.Tensor
        ``[N]`` float32.
    """
    s, o = seeds.long(), pos.long()
    c0, c1 = o & _M32, (o >> 32) & _M32
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = s & _M32, (s >> 32) & _M32
    for _ in range(10):
        hb, lb = _mul_hi_lo(PHILOX_B, c2)
        ha, la = _mul_hi_lo(PHILOX_A, c0)
        c0, c1, c2, c3 = hb ^ c1 ^ k0, lb, ha ^ c3 ^ k1, la
        k0, k1 = (k0 + PHILOX_KA) & _M32, (k1 + PHILOX_KB) & _M32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # (the word as int32)
    x = torch.where(x < 0, -x - 1, x).float()
    return (x * torch.tensor(PHILOX_SCALE, dtype=torch.float32)).clamp_min(RAND_MIN)


def noise(u: torch.Tensor) -> torch.Tensor:
    """The real ``g(u)`` (float64) of the fp32 ``u``, with the kernel's clamp of ``1 - u``."""
    ud = u.double()
    one_minus = (1.0 - u).double().clamp_min(2.0**-24)  # the kernel's fp32 1 - u, then its clamp
    L = torch.where(ud < 0.25, torch.log1p(-ud), torch.log(one_minus))
    return -torch.log(-L)


def noise_bounds(seeds: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g_lo, g_hi)`` float64 ``[R, n]``, around the noise the kernel adds to tokens ``ids``
    of rows with ``seeds`` at positions ``pos`` (module docstring)."""
    g = noise(uniform(seeds, pos, ids))
    eps = EPS_ABS + EPS_REL * g.abs()
    return g - eps, g + eps


def comparison_margin(x_abs_max: torch.Tensor) -> torch.Tensor:
    """How far the kernel's fp32 comparison of ``fl32(x_i + g_i)`` with ``fl32(x_j + g_j)`` can
    stray from the real ``x_i + g_i`` against ``x_j + g_j``, for ``|x| <= x_abs_max``: each sum
    rounds by at most ``2^-24 (|x| + |g|)``, so ``2^-23 (x_abs_max + 24)`` covers both
    (float64, the shape of ``x_abs_max``)."""
    return (x_abs_max.double() + 24.0) * 2.0**-23


def finite_abs_max(*xs: torch.Tensor) -> torch.Tensor:
    """``[R]``: the largest finite ``|x|`` of each row over the ``[R, n]`` tensors ``xs`` (0 where
    there is none): the ``A`` of :func:`comparison_margin` and :func:`top_mask_margin`."""
    return torch.stack([torch.where(torch.isfinite(x), x.abs(), 0.0).amax(1) for x in xs]).amax(0)


def min_p_thresholds(m_lo: torch.Tensor, m_hi: torch.Tensor, min_p: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds of V2's min-p threshold ``thr = fl32(m + c)`` (``vllm/v1/worker/gpu/sample/min_p.py``:
    ``m`` the row's largest tempered logit, ``c`` the kernel's fp32 ``log(min_p)``; tokens below
    ``thr`` become ``-inf``) for ``m_lo <= m <= m_hi``: ``c`` is within :data:`LOG_ABS` +
    :data:`LOG_REL` ``|log min_p|`` of the real logarithm, the float64 sums round too (nudged
    outwards by ``2^-50`` relative), and rounding to nearest is monotone, so the real sums'
    bounds rounded outwards to fp32 hold ``thr``.

    Parameters
    ----------
    m_lo, m_hi : torch.Tensor
        ``[R, 1]`` (or ``[R]``) float64 bounds of the row's maximum.
    min_p : torch.Tensor
        The rows' ``min_p``, ``> 0``, the shape of ``m_lo``.

    Returns
    -------
    (thr_lo, thr_hi) : tuple of torch.Tensor
        fp32: a token with ``qhi < thr_lo`` is certainly dropped, one with ``qlo >= thr_hi``
        certainly kept.
    """
    c = torch.log(min_p.double())
    eps = LOG_ABS + LOG_REL * c.abs()
    t_lo, t_hi = m_lo + (c - eps), m_hi + (c + eps)
    thr_lo = round_down32(torch.where(torch.isfinite(t_lo), t_lo - t_lo.abs() * 2.0**-50, t_lo))
    thr_hi = round_up32(torch.where(torch.isfinite(t_hi), t_hi + t_hi.abs() * 2.0**-50, t_hi))
    return thr_lo, thr_hi


# Top-k / top-p: V2 masks them after min-p with vLLM's Triton kernels (``topk_topp_triton.py``,
# Qrita; CUDA also splits top-p-only rows over programs). They keep a token where it lies above a
# pivot found by a bounded search, except that tokens within TOP_DUP_ABS of the boundary value
# (in logits, or in probabilities ``exp(x - M) / Z``) count as duplicates and some are dropped by
# position; the split pipeline keeps ``x == M`` always. Kept values are stored unchanged.
TOP_DUP_ABS = 1e-9
TOP_PROB_REL = 2e-5  # 2x the relative error allowed to the kernels' fp32 probabilities
TOP_LOGIT_REL = 2.0**-20  # 8 fp32 ulps: a boundary logit the kernel recomputes as log(p Z) + M


def top_mask_margin(V: int, x_abs_max: torch.Tensor) -> torch.Tensor:
    """How far a row's maximum must lie above every other token (tempered logits, ``|x| <=
    x_abs_max``, ``V`` tokens a row) for V2's top-k / top-p kernels to keep it whatever ``k`` and
    ``p`` are (float64, the shape of ``x_abs_max``).

    A maximum ``w`` is dropped only as a duplicate of the boundary value, which needs a token
    other than ``w`` within the tolerance of it. In probabilities, ``p_w = 1 / Z >= 1 / V`` and
    ``p_j <= p_w e^-gap``, so ``p_w - p_j >= (1 - e^-gap) / V``; with each computed probability
    within ``TOP_PROB_REL / 2`` of its own, a ``gap`` with ``1 - e^-gap >= 2 (TOP_DUP_ABS V +
    TOP_PROB_REL)`` keeps ``w``'s apart from every other (twice over). In logits, the boundary
    value the kernel recomputes strays by less than ``TOP_LOGIT_REL (|x| + 64)``
    (``|log p|`` below 64 for the kernels' ``1e-30`` floor), which the margin's second term
    covers, with ``TOP_DUP_ABS`` twice. With ``w`` alone within reach of the boundary, the count
    of duplicates is one and the kernels keep at least one. (``tests/test_v2_top_masks.py``
    runs vLLM's kernels under Triton's interpreter on rows at this margin; the compiled kernels
    are not checked yet.)"""
    return torch.clamp(TOP_LOGIT_REL * (x_abs_max.double() + 64.0) + 2 * TOP_DUP_ABS, min=top_prob_gap(V))


def top_prob_gap(V: int) -> float:
    """:func:`top_mask_margin`'s first term: ``gap`` with ``1 - e^-gap = 2 (TOP_DUP_ABS V +
    TOP_PROB_REL)`` (at most ``log 2``)."""
    return -math.log1p(-min(0.5, 2 * (TOP_DUP_ABS * V + TOP_PROB_REL)))


# Top-k alone (a row with a top-k ``k`` and no top-p): the kernel searches a pivot between an
# outlier threshold (or the row's smallest finite value) and its maximum by thirds, at most 18
# rounds, and keeps the tokens above it, less near-duplicates (within TOP_DUP_ABS) of the
# smallest value above it beyond ``k`` by position. The search's lower end always has more than
# ``k`` values above it, a pivot it stops at has at least ``k`` (so it lies below the ``k``-th
# largest value, and so does the smallest value above it), and a search that runs out stops at
# the midpoint of its last interval, within a small width of that value, dropping duplicates of
# a value at most that value or none (:func:`top_k_keep_margin`).
TOP_K_SEARCH_REL = 2.0**-16  # 4x the last interval's width bound, 2^-18 A (top_k_keep_margin)
TOP_K_ABS = 4e-9  # the search's 1e-9 stop, the 1e-9 duplicate tolerance, and fp32 rounding of both
TOP_K_A_MAX = 2.0**48  # beyond: the kernel's fp32 sum of squares for its outlier threshold may overflow


def top_k_keep_margin(x_abs_max: torch.Tensor) -> torch.Tensor:
    """How far a token must lie above the ``k``-th largest value of its row (tempered logits after
    min-p, every finite ``|x| <= x_abs_max``, at most :data:`TOP_K_A_MAX`) for V2's top-k kernel
    (Qrita, a top-k alone: no top-p on the row) to keep it with its value, whatever else the row
    holds (float64, the shape of ``x_abs_max``). So a token ranked at most ``k - 1`` with that
    gap below it is kept; the row's maximum at any ``k`` is :func:`top_mask_margin`'s.

    The argument (``vllm/v1/sample/ops/topk_topp_triton.py``, 0.32.0 and 0.33.0; ``x_(k)`` the
    ``k``-th largest value, multiplicity counted, ``A = x_abs_max``):

    - rows with at most ``k`` finite values, and pivots at or above the maximum, are not masked;
    - the search's interval ``[lo, hi]`` starts at an outlier threshold with more than ``k``
      values above it (``|avg + sigma std| <= 5.4 A`` from the first tile: ``|sigma| <= 4.39``,
      ``std <= A``) or at the smallest finite value, and at the maximum: width ``W0 <= 7 A``.
      ``lo`` only moves to a pivot with more than ``k`` values above it, so ``lo <= x_(k+1)``;
    - a round tests ``lo + W/3`` and ``lo + 2W/3`` (fp32); a count equal to ``k`` stops the
      search, any other keeps a third: ``W' <= W (1/3 + 2.4 u) + 2 u 7A`` (``u = 2^-24``), so
      after 18 rounds ``W <= 7A 3^-18 + 21 u A < 2^-18 A``, or it stopped below ``1e-9``;
    - the pivot is one with at least ``k`` values above it (below ``x_(k)``), or, where the
      search runs out (18 rounds, or an interval under ``1e-9``; this overrides a pivot found
      in the same round), the midpoint of ``[lo, hi]``: at most ``x_(k+1) + W``;
    - the only tokens above the pivot it drops are near-duplicates (``|x - m| < 1e-9``, by
      position) of ``m``, the smallest value above the round's pivot that found its count (or,
      run out, above its lower pivot ``lo + W/3``, which has at least as many values above it):
      with a pivot found that count is at least ``k``, so ``m <= x_(k)``; a round that finds none
      leaves the count at 0, and the kernel then keeps ``k`` more duplicates than the group
      holds (``uint32``): none dropped.

    A token ``x >= x_(k) + TOP_K_SEARCH_REL A + TOP_K_ABS`` is above the pivot and more than
    ``1e-9`` above ``m``: kept, its value stored unchanged. And a token ``x < x_(k) -
    TOP_K_SEARCH_REL A - TOP_K_ABS`` is dropped wherever the kernel masks (more than ``k``
    finite values, its pivot below the maximum: so where ``x_(k+1)`` lies that margin below the
    maximum): the upper end ``hi`` stays at or above ``x_(k)`` (it moves only to a pivot with
    fewer than ``k`` values above it), so a run-out midpoint is at least ``x_(k) - W``; a found
    pivot's ``m`` has fewer than ``k`` values ``2e-9`` above it (its near-duplicates counted,
    tiles merged within ``1e-9``), so ``m > x_(k) - 2e-9``, and nothing below ``m`` is above the
    pivot. (``tests/test_v2_top_masks.py`` runs the kernels under Triton's interpreter on rows at
    this margin, searches that run out included.)"""
    return TOP_K_SEARCH_REL * x_abs_max.double() + TOP_K_ABS

