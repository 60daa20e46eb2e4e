"""vLLM Model Runner V2's noise and temperature replayed on the device, for the certified Gumbel
draw (:mod:`.gumbel_draw`, :mod:`.draw_bounds`): Triton device helpers (``@triton.jit``, called
from those modules' kernels) beside their torch counterparts.

- ``_prefix``, ``_hash``: vLLM's ``murmur3_hash32`` of (seed, position, token), the same uint32
  operations (``_prefix`` the state after the row's seed and position, ``_hash`` the token mixed
  in and finalized), so the same hash; :func:`~vllm_csv.gumbel_noise.murmur3` in torch;
- ``_uniform``: ``murmur3_uniform32`` of a hash (two exact products, one rounding), bit for bit;
  :func:`~vllm_csv.gumbel_noise.uniform` in torch. ``u`` is non-decreasing in the uint32 hash;
- ``_noise_bounds`` / :func:`_noise_bounds_ref`: float64 bounds ``g_lo <= g(u) <= g_hi`` of V2's
  fp32 noise of ``u`` (:func:`~vllm_csv.gumbel_noise.noise_bounds`);
- ``_temp`` / :func:`_temp_ref`: a row's divisor, whether it is greedy (``T = 0``) and whether
  ``T`` is usable (``[2^-126, 2^126]``, or 0);
- ``_q_lo``, ``_q_hi`` / :func:`_q_bounds`: fp32 bounds of V2's ``fl32(x / T)`` for ``lo <= x <=
  hi``, :func:`~vllm_csv.sampling.gumbel_v2.temperature_bounds`' arithmetic; greedy rows: the
  bounds themselves.
"""

from __future__ import annotations

import torch

from ..fp import round_down32, round_up32
from ..gumbel_noise import DIV_ABS, DIV_REL, DIV_T_MAX, DIV_T_MIN, EPS_ABS, EPS_REL, noise
from .common import tl, triton


# ---- torch counterparts ---------------------------------------------------------------------
def _temp_ref(temp: torch.Tensor):
    """``(t_div [B, 1] float64, greedy [B, 1], t_ok [B])``."""
    t = temp.double()[:, None]
    greedy = t == 0
    t_ok = ((t >= DIV_T_MIN) & (t <= DIV_T_MAX)) | greedy
    return torch.where(greedy | ~t_ok, 1.0, t), greedy, t_ok[:, 0]


def _q_bounds(lo64: torch.Tensor, hi64: torch.Tensor, t64: torch.Tensor, greedy: torch.Tensor):
    """fp32 bounds (as float64) of V2's ``x / T`` for ``lo <= x <= hi``: temperature_bounds'
    arithmetic per row (``t64`` ``[B, 1]``); greedy rows: the bounds themselves."""
    qlo, qhi = lo64 / t64, hi64 / t64
    qlo = torch.where(torch.isinf(qlo), qlo, qlo - qlo.abs() * DIV_REL - DIV_ABS)
    qhi = torch.where(torch.isinf(qhi), qhi, qhi + qhi.abs() * DIV_REL + DIV_ABS)
    qlo, qhi = round_down32(qlo).double(), round_up32(qhi).double()
    return torch.where(greedy, lo64, qlo), torch.where(greedy, hi64, qhi)


def _noise_bounds_ref(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g_lo, g_hi)`` float64 of fp32 ``u`` (:func:`~vllm_csv.gumbel_noise.noise_bounds`)."""
    g = noise(u)
    eps = EPS_ABS + EPS_REL * g.abs()
    return g - eps, g + eps


# ---- Triton device helpers ------------------------------------------------------------------
if triton is not None:
    from .score import _down32, _up32

    # vLLM V2's murmur3 (vllm/v1/worker/gpu/sample/gumbel.py, Apache-2.0, copyright the vLLM
    # project): the same operations, so the same uint32 (the tests compare draws with vLLM's own)
    @triton.jit
    def _rotl32(value, shift: tl.constexpr):
        return (value << shift) | (value >> (32 - shift))

    @triton.jit
    def _mix(h, key):
        key *= 0xCC9E2D51
        key = _rotl32(key, 15)
        key *= 0x1B873593
        h ^= key
        h = _rotl32(h, 13)
        return h * 5 + 0xE6546B64

    @triton.jit
    def _fmix(h):
        h ^= h >> 16
        h *= 0x85EBCA6B
        h ^= h >> 13
        h *= 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def _prefix(seed, pos):
        """The hash state after the row's seed and position (scalar; mixed with each token)."""
        seed = seed.to(tl.int64)
        pos = pos.to(tl.int64)
        h = (seed ^ seed).to(tl.uint32)
        h = _mix(h, (seed & 0xFFFFFFFF).to(tl.uint32))
        h = _mix(h, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        return _mix(h, (pos & 0xFFFFFFFF).to(tl.uint32))

    @triton.jit
    def _hash(prefix, tok):
        return _fmix(_mix(prefix, tok.to(tl.uint32)) ^ 16)

    @triton.jit
    def _uniform(r):
        """vLLM's ``murmur3_uniform32`` of the hash ``r`` (two exact products, one rounding)."""
        hi16 = (r >> 16).to(tl.int32)
        lo16 = (r & 0xFFFF).to(tl.int32)
        return hi16.to(tl.float32) * 1.52587890625e-05 + (lo16.to(tl.float32) + 0.5) * 2.3283064365386963e-10

    @triton.jit
    def _noise_bounds(u):
        """``(g_lo, g_hi)`` float64 of fp32 ``u``: the real ``g(u)`` (``log1p`` by Kahan's
        ``log(w) x / (w - 1)``, a few ulps of float64) widened by ``1e-5 + 1e-5 |g|``."""
        ud = u.to(tl.float64)
        w = 1.0 - ud
        small = tl.where(w == 1.0, -ud, tl.log(w) * (-ud) / (w - 1.0))
        one_minus = tl.maximum(1.0 - u, 5.960464477539063e-08).to(tl.float64)  # the kernel's fp32 clamp
        L = tl.where(ud < 0.25, small, tl.log(one_minus))
        g = -tl.log(-L)
        eps = 1e-5 + 1e-5 * tl.abs(g)
        return g - eps, g + eps

    @triton.jit
    def _q_lo(x, t, GREEDY):
        q = x.to(tl.float64) / t
        q = tl.where((q == float("inf")) | (q == float("-inf")), q, q - tl.abs(q) * 2.384185791015625e-07
                     - 2.350988701644575e-38)
        return tl.where(GREEDY, x.to(tl.float64), _down32(q).to(tl.float64))

    @triton.jit
    def _q_hi(x, t, GREEDY):
        q = x.to(tl.float64) / t
        q = tl.where((q == float("inf")) | (q == float("-inf")), q, q + tl.abs(q) * 2.384185791015625e-07
                     + 2.350988701644575e-38)
        return tl.where(GREEDY, x.to(tl.float64), _up32(q).to(tl.float64))

    @triton.jit
    def _min_p_thresholds(m_lo, m_hi, mp, log_abs, log_rel):
        """:func:`~vllm_csv.gumbel_noise.min_p_thresholds` of a row, operation for operation:
        ``(thr_lo, thr_hi)`` float64 (fp32 values) for the maximum in ``[m_lo, m_hi]`` and min-p
        ``mp > 0`` (a caller passes 1.0 where the row has none)."""
        c = tl.log(mp.to(tl.float64))
        eps = log_abs + log_rel * tl.abs(c)
        t_lo = m_lo + (c - eps)
        t_hi = m_hi + (c + eps)
        thr_lo = _down32(tl.where(tl.abs(t_lo) < float("inf"), t_lo - tl.abs(t_lo) * 8.881784197001252e-16, t_lo))
        thr_hi = _up32(tl.where(tl.abs(t_hi) < float("inf"), t_hi + tl.abs(t_hi) * 8.881784197001252e-16, t_hi))
        return thr_lo.to(tl.float64), thr_hi.to(tl.float64)

    @triton.jit
    def _temp(temp_ptr, b):
        """``(t_div, greedy, t_ok)`` of row ``b``."""
        t = tl.load(temp_ptr + b).to(tl.float64)
        greedy = t == 0.0
        t_ok = ((t >= 1.1754943508222875e-38) & (t <= 8.507059173023462e+37)) | greedy
        return tl.where(greedy | (t_ok == 0), 1.0, t), greedy, t_ok
