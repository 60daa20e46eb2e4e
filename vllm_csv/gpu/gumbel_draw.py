"""The certified V2 Gumbel draw on the device: :func:`gumbel_draw` (two kernels), the token vLLM's
Model Runner V2 sampler (``gumbel_sample``, fp32 noise) draws from a row, decided from the fused
step's candidate blocks (exact intervals) and an upper bound on every other block, or the row
refused. No host sync, fixed shapes; beside it its torch reference :func:`gumbel_draw_ref` and
the custom op ``torch.ops.vllm_csv_gpu.gumbel_draw``.

The rule is :func:`vllm_csv.sampling.gumbel_v2.certify_draw_v2`'s (its docstring and the module's
have the argument), on fewer columns:

* **candidate tokens** (the row's ``count`` candidate blocks ``cand``, ``SUB`` tokens each, the
  layout of :mod:`.score`): their logits ``lower <= x <= upper`` (fp32 holding model-dtype
  values, exact where the ends agree) and their own noise, hashed from (seed, position, token)
  bit for bit as vLLM's ``murmur3_hash32`` / ``murmur3_uniform32`` do, then bounded
  (:func:`~vllm_csv.sampling.gumbel_v2.noise_bounds`: ``g(u) +- (1e-5 + 1e-5 |g|)``, ``g`` in
  float64);
* **every other block** ``b`` as one column: every token of it has ``x <= block_hi[b]``, and its
  noise is at most the noise of the token with the block's smallest hash (``u`` is
  non-decreasing in the hash, ``g(u)`` decreasing in ``u``, and ``g + eps(g)`` increasing in
  ``g``), so ``qhi(block_hi) + g_hi(min hash)`` bounds every token's noisy score there.

Temperature (:func:`~vllm_csv.sampling.gumbel_v2.temperature_bounds`: float64 quotient widened by
``2^-22 |q| + 2^-125``, rounded outwards to fp32; ``T`` outside ``[2^-126, 2^126]``, negative or
NaN: refused) on both; ``T = 0``: a greedy row, no noise and no margin (V2's plain argmax).
With ``best = max lo + g_lo`` over the candidates and ``m = 2^-23 (A + 24)``
(:func:`~vllm_csv.sampling.gumbel_v2.comparison_margin`), the row is certified when the winner is
the only candidate with ``qhi + g_hi >= best - 2 m`` and every non-candidate block's bound is
below ``best - 2 m``. ``A`` is the largest finite ``|qlo|, |qhi|`` of the candidates and
``|qhi(block_hi)|`` of the other blocks: the margin covers the rounding of the winner's sum
(``|x_w| <= A``) and of a competitor's, which is at most ``fl(hi + g_hi)`` (rounding is
monotone), within ``2^-24 (|hi| + 24)`` of it, so a competitor's lower bound never enters
(the fused step has none for the tokens it did not score; the CPU rule, which has them, takes
them into ``A`` as well, which only widens it). A certified row here is certified by the CPU
rule on the same bounds spread over every token (``tests/test_gpu_gumbel_draw.py`` checks it).
Ties and near-ties are never certified: the comparison is strict with the margin on both sides.

Kernels:

1. ``_outside_bound_kernel`` ``[B, ceil(nb / BPP)]`` programs: the hash of every token of
   ``BPP`` blocks (integer arithmetic only), each block's smallest, and for the blocks that are
   not the row's candidates ``qhi(block_hi) + g_hi`` (float64), reduced to the program's largest
   bound and largest finite ``|qhi|`` (NaN or ``+inf`` bounds: a count of bad blocks).
2. ``_gumbel_draw_kernel`` ``[B]`` programs: the candidates' noise and bounds, the winner, the
   margin with the first kernel's maxima folded in, and the decision: ``token [B]`` int64 (the
   winner's id; on a refused row the best candidate's, or 0) and ``code [B]`` int32 (0 certified,
   1 the row was not live (``live``: the step's ``ok & live``), 2 an unusable temperature,
   3 not certified: NaN/``+inf`` bounds, nothing finite, or a contender besides the winner).

Everything stays on the device; the caller reads ``code`` when it wants to (the sampler hook reads
it once, with the rows it writes).
"""

from __future__ import annotations

import math

import torch

from ..fp import round_down32, round_up32
from ..gumbel_noise import (DIV_ABS, DIV_REL, DIV_T_MAX, DIV_T_MIN, EPS_ABS, EPS_REL, comparison_margin, murmur3,
                            noise, uniform)
from .common import CAP, INTERPRET, LIB, SUB, _launch, _tl_dtype, _use_triton, slot_ids, tl, triton

BPP = 16  # blocks (of SUB tokens) a program of the outside-bound kernel hashes: 1024 tokens, vLLM's tile
CODE_CERTIFIED, CODE_NOT_LIVE, CODE_TEMPERATURE, CODE_UNCERTIFIED = 0, 1, 2, 3


# ---- torch reference ------------------------------------------------------------------------
def _q_bounds(lo64: torch.Tensor, hi64: torch.Tensor, t64: torch.Tensor, greedy: torch.Tensor):
    """fp32 bounds (as float64) of V2's ``x / T`` for ``lo <= x <= hi``: temperature_bounds'
    arithmetic per row (``t64`` ``[B, 1]``); greedy rows: the bounds themselves."""
    qlo, qhi = lo64 / t64, hi64 / t64
    qlo = torch.where(torch.isinf(qlo), qlo, qlo - qlo.abs() * DIV_REL - DIV_ABS)
    qhi = torch.where(torch.isinf(qhi), qhi, qhi + qhi.abs() * DIV_REL + DIV_ABS)
    qlo, qhi = round_down32(qlo).double(), round_up32(qhi).double()
    return torch.where(greedy, lo64, qlo), torch.where(greedy, hi64, qhi)


def _noise_hi(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g_lo, g_hi)`` float64 of fp32 ``u`` (:func:`~vllm_csv.sampling.gumbel_v2.noise_bounds`)."""
    g = noise(u)
    eps = EPS_ABS + EPS_REL * g.abs()
    return g - eps, g + eps


def gumbel_draw_ref(cand, count, lower, upper, block_hi, seeds, pos, temp, live, V: int, hnorm=None, e=None,
                    rad_max: float = 0.0, act_coef: float = 0.0, tiny: float = 0.0, bslack_max: float = 0.0,
                    delta: float = 0.0, dtype: torch.dtype = torch.float32):
    """``(token [B] int64, code [B] int32)``: :func:`gumbel_draw` in torch (float64).

    Parameters
    ----------
    cand, count : torch.Tensor
        ``[B, CAP]`` int32 candidate block ids (``-1`` past ``count``), ``[B]`` int32 (more than
        ``CAP``: only the first ``CAP`` are read; the caller's ``live`` refuses such a row).
    lower, upper : torch.Tensor
        ``[B, CAP * SUB]`` fp32, bounds of the candidate tokens' logits (the slots of
        :func:`~vllm_csv.gpu.score.score_blocks`; slots past ``count`` are not read).
    block_hi : torch.Tensor
        ``[B, nb]`` fp32 (``nb = ceil(V / SUB)``), an upper bound of the logit of every token of
        each block that is not a candidate (candidate blocks' entries are not read); with
        ``hnorm`` given, the screen's block maxima instead, turned into that bound by
        :func:`block_upper` (in the first kernel: no ``[B, nb]`` pass of its own).
    seeds, pos : torch.Tensor
        ``[B]`` int64, each row's request seed and sampling position.
    temp : torch.Tensor
        ``[B]`` fp32, the row's temperature (0: greedy).
    live : torch.Tensor
        ``[B]`` int8, rows that may be certified.
    hnorm, e, rad_max, act_coef, tiny, bslack_max, delta, dtype
        :func:`block_upper`'s (the fused step's ``||h||``, screen residual, error constants and
        model dtype), where ``block_hi`` holds the screen's block maxima.
    """
    if hnorm is not None:
        block_hi = block_upper(block_hi, hnorm, e, dict(rad_max=rad_max, act_coef=act_coef, tiny=tiny,
                                                        bslack_max=bslack_max, delta=delta), dtype)
    B, nb = block_hi.shape
    dev = lower.device
    ids = slot_ids(cand, count, V)  # [B, S], -1 where empty
    valid = ids >= 0
    t = temp.double()[:, None]
    greedy = t == 0
    t_ok = ((t >= DIV_T_MIN) & (t <= DIV_T_MAX)) | greedy
    t_div = torch.where(greedy | ~t_ok, 1.0, t)
    lo64 = torch.where(valid, lower.double(), -math.inf)
    hi64 = torch.where(valid, upper.double(), -math.inf)
    qlo, qhi = _q_bounds(lo64, hi64, t_div, greedy)
    g_lo, g_hi = _noise_hi(uniform(seeds, pos, ids.clamp_min(0)))
    g_lo, g_hi = g_lo.masked_fill(greedy, 0.0), g_hi.masked_fill(greedy, 0.0)
    nlo = torch.where(qlo > -math.inf, qlo + g_lo, -math.inf)
    nhi = torch.where(qhi > -math.inf, qhi + g_hi, -math.inf)
    bad = (torch.isnan(qlo) | torch.isnan(qhi) | (qhi == math.inf)).any(1)
    best = nlo.amax(1)
    slot = torch.arange(nlo.shape[1], device=dev)
    w = torch.where(nlo == best[:, None], slot, nlo.shape[1]).amin(1).clamp(max=nlo.shape[1] - 1)
    # the other blocks: their hashes' minimum, its noise, temperature on their bound
    tok = torch.arange(nb * SUB, device=dev)
    r = murmur3(seeds, pos, tok.clamp(max=V - 1))
    r = torch.where(tok[None] < V, r, 2**32).view(B, nb, SUB).amin(2)  # [B, nb]
    u = (r >> 16).float() * 2.0**-16 + ((r & 0xFFFF).float() + 0.5) * 2.0**-32
    _, bg_hi = _noise_hi(u)
    bg_hi = bg_hi.masked_fill(greedy, 0.0)
    bh = block_hi.double()
    _, bq = _q_bounds(bh, bh, t_div, greedy)
    is_cand = torch.zeros((B, nb + 1), dtype=torch.bool, device=dev)
    used = torch.arange(CAP, device=dev)[None] < count[:, None].clamp(max=CAP)
    is_cand.scatter_(1, torch.where(used & (cand >= 0), cand.long(), nb), True)
    outside = ~is_cand[:, :nb]
    bad |= (outside & (torch.isnan(bq) | (bq == math.inf))).any(1)
    bn = torch.where(outside & (bq > -math.inf), bq + bg_hi, -math.inf).nan_to_num(nan=-math.inf)
    fin = lambda x: torch.where(torch.isfinite(x), x.abs(), 0.0)  # noqa: E731
    A = torch.maximum(torch.maximum(fin(qlo).amax(1), fin(qhi).amax(1)),
                      torch.where(outside, fin(bq), 0.0).amax(1))
    m = torch.where(greedy[:, 0], 0.0, comparison_margin(A))
    bar = best - 2 * m
    others = ((nhi >= bar[:, None]) & (slot[None] != w[:, None])).sum(1)
    cert = (others == 0) & (bn.amax(1) < bar) & (best > -math.inf) & ~bad
    token = torch.where(best > -math.inf, ids.gather(1, w[:, None])[:, 0], 0).clamp_min(0)
    code = torch.where(live.bool(), torch.where(t_ok[:, 0], torch.where(cert, CODE_CERTIFIED, CODE_UNCERTIFIED),
                                                CODE_TEMPERATURE), CODE_NOT_LIVE)
    return token, code.to(torch.int32)


# ---- Triton ---------------------------------------------------------------------------------
if triton is not None:
    from .common import _rnd
    from .score import _down32, _up32

    # vLLM V2's murmur3 (vllm/v1/worker/gpu/sample/gumbel.py, Apache-2.0, copyright the vLLM
    # project): the same operations, so the same uint32 (the tests compare it with vLLM's own)
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
    def _temp(temp_ptr, b):
        """``(t_div, greedy, t_ok)`` of row ``b``."""
        t = tl.load(temp_ptr + b).to(tl.float64)
        greedy = t == 0.0
        t_ok = ((t >= 1.1754943508222875e-38) & (t <= 8.507059173023462e+37)) | greedy
        return tl.where(greedy | (t_ok == 0), 1.0, t), greedy, t_ok

    @triton.jit
    def _outside_bound_kernel(block_hi_ptr, cand_ptr, count_ptr, seed_ptr, pos_ptr, temp_ptr,
                              out_hi_ptr, out_abs_ptr, out_bad_ptr, V, nb, nprog,
                              hn_ptr, e_ptr, rad_max, act_coef, tiny, bslack_max, delta,
                              FROM_SCREEN: tl.constexpr, DT: tl.constexpr,
                              BPPC: tl.constexpr, SUBC: tl.constexpr, CAPC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1)
        blk = p * BPPC + tl.arange(0, BPPC)
        tok = blk[:, None].to(tl.int64) * SUBC + tl.arange(0, SUBC)[None, :]
        prefix = _prefix(tl.load(seed_ptr + b), tl.load(pos_ptr + b))
        r = _hash(prefix, tok)
        r = tl.where(tok < V, r, 0xFFFFFFFF)  # (a block's last hash is never past its real tokens)
        rmin = tl.min(r, 1)  # [BPPC] uint32
        t, greedy, t_ok = _temp(temp_ptr, b)
        _, g_hi = _noise_bounds(_uniform(rmin))
        g_hi = tl.where(greedy, 0.0, g_hi)
        bh = tl.load(block_hi_ptr + b * nb + blk, mask=blk < nb, other=float("-inf"))
        if FROM_SCREEN:  # block_upper, operation for operation (float64, then fp32 up, then the dtype)
            spread = rad_max * tl.load(hn_ptr + b).to(tl.float64) + act_coef * tl.load(e_ptr + b).to(tl.float64)
            spread = spread + tiny
            spread = spread + bslack_max
            y = bh.to(tl.float64)
            ub = y + delta * tl.abs(y)
            ub = ub + spread
            ub = ub + tl.abs(ub) * 9.5367431640625e-07
            ub = ub + tiny
            bh = _rnd(_up32(ub), DT)
        q = _q_hi(bh, t, greedy)
        # the row's candidate blocks are not outside ([BPPC, CAPC] compare)
        n = tl.minimum(tl.load(count_ptr + b), CAPC)
        cs = tl.arange(0, CAPC)
        cb = tl.load(cand_ptr + b * CAPC + cs)
        cb = tl.where((cs < n) & (cb >= 0), cb, -1)
        is_cand = tl.max(tl.where(blk[:, None] == cb[None, :], 1, 0), 1)
        outside = (blk < nb) & (is_cand == 0)
        bad = outside & ((q != q) | (q == float("inf")))
        bound = tl.where(outside & (q > float("-inf")) & (q == q), q + g_hi, float("-inf"))
        absq = tl.where(outside & (q == q) & (tl.abs(q) < float("inf")), tl.abs(q), 0.0)
        tl.store(out_hi_ptr + b * nprog + p, tl.max(bound, 0))
        tl.store(out_abs_ptr + b * nprog + p, tl.max(absq, 0))
        tl.store(out_bad_ptr + b * nprog + p, tl.sum(tl.where(bad, 1, 0), 0))

    @triton.jit
    def _gumbel_draw_kernel(cand_ptr, count_ptr, lo_ptr, up_ptr, seed_ptr, pos_ptr, temp_ptr, live_ptr,
                            out_hi_ptr, out_abs_ptr, out_bad_ptr, token_ptr, code_ptr, V, nprog,
                            NPROG: tl.constexpr, SUBC: tl.constexpr, CAPC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        S: tl.constexpr = CAPC * SUBC
        sl = tl.arange(0, S)
        n = tl.minimum(tl.load(count_ptr + b), CAPC)
        blk = tl.load(cand_ptr + b * CAPC + sl // SUBC)
        ids = blk.to(tl.int64) * SUBC + (sl % SUBC)
        valid = (sl // SUBC < n) & (blk >= 0) & (ids < V)
        lo = tl.where(valid, tl.load(lo_ptr + b * S + sl), float("-inf"))  # (slots past the count
        hi = tl.where(valid, tl.load(up_ptr + b * S + sl), float("-inf"))  # were never written)
        t, greedy, t_ok = _temp(temp_ptr, b)
        qlo = _q_lo(lo, t, greedy)
        qhi = _q_hi(hi, t, greedy)
        prefix = _prefix(tl.load(seed_ptr + b), tl.load(pos_ptr + b))
        g_lo, g_hi = _noise_bounds(_uniform(_hash(prefix, tl.where(valid, ids, 0))))
        g_lo = tl.where(greedy, 0.0, g_lo)
        g_hi = tl.where(greedy, 0.0, g_hi)
        nlo = tl.where((qlo > float("-inf")) & (qlo == qlo), qlo + g_lo, float("-inf"))
        nhi = tl.where(qhi > float("-inf"), qhi + g_hi, float("-inf"))
        nbad = tl.sum(tl.where((qlo != qlo) | (qhi != qhi) | (qhi == float("inf")), 1, 0), 0)
        best = tl.max(nlo, 0)
        w = tl.min(tl.where(nlo == best, sl, S), 0)
        w = tl.where(w < S, w, 0)
        finite_abs_lo = tl.where(tl.abs(qlo) < float("inf"), tl.abs(qlo), 0.0)
        finite_abs_hi = tl.where(tl.abs(qhi) < float("inf"), tl.abs(qhi), 0.0)
        ps = tl.arange(0, NPROG)
        pm = ps < nprog
        o_hi = tl.max(tl.load(out_hi_ptr + b * nprog + ps, mask=pm, other=float("-inf")), 0)
        o_abs = tl.max(tl.load(out_abs_ptr + b * nprog + ps, mask=pm, other=0.0), 0)
        nbad += tl.sum(tl.load(out_bad_ptr + b * nprog + ps, mask=pm, other=0), 0)
        A = tl.maximum(tl.maximum(tl.max(finite_abs_lo, 0), tl.max(finite_abs_hi, 0)), o_abs)
        m = tl.where(greedy, 0.0, (A + 24.0) * 1.1920928955078125e-07)
        bar = best - 2 * m
        others = tl.sum(tl.where((nhi >= bar) & (sl != w), 1, 0), 0)
        cert = (others == 0) & (o_hi < bar) & (best > float("-inf")) & (nbad == 0)
        tok = tl.sum(tl.where(sl == w, ids, 0), 0)
        tok = tl.where(best > float("-inf"), tl.maximum(tok, 0), 0)
        live = tl.load(live_ptr + b) != 0
        code = tl.where(live, tl.where(t_ok, tl.where(cert, 0, 3), 2), 1)
        tl.store(token_ptr + b, tok)
        tl.store(code_ptr + b, code.to(tl.int32))


def gumbel_draw_triton(cand, count, lower, upper, block_hi, seeds, pos, temp, live, V: int, hnorm=None, e=None,
                       rad_max: float = 0.0, act_coef: float = 0.0, tiny: float = 0.0, bslack_max: float = 0.0,
                       delta: float = 0.0, dtype: torch.dtype = torch.float32):
    B, nb = block_hi.shape
    dev = lower.device
    token = torch.empty(B, dtype=torch.int64, device=dev)
    code = torch.empty(B, dtype=torch.int32, device=dev)
    if B:
        nprog = triton.cdiv(nb, BPP)
        out_hi = torch.empty((B, nprog), dtype=torch.float64, device=dev)
        out_abs = torch.empty((B, nprog), dtype=torch.float64, device=dev)
        out_bad = torch.empty((B, nprog), dtype=torch.int32, device=dev)
        seeds, pos, temp = seeds.long().contiguous(), pos.long().contiguous(), temp.float().contiguous()
        block_hi = block_hi.float().contiguous()
        screen = hnorm is not None
        _outside_bound_kernel[(B, nprog)](block_hi, cand, count, seeds, pos, temp, out_hi, out_abs, out_bad,
                                          V, nb, nprog, hnorm if screen else temp, e if screen else temp,
                                          rad_max, act_coef, tiny, bslack_max, delta, FROM_SCREEN=screen,
                                          DT=_tl_dtype(dtype), BPPC=BPP, SUBC=SUB, CAPC=CAP, **_launch())
        _gumbel_draw_kernel[(B,)](cand, count, lower, upper, seeds, pos, temp, live, out_hi, out_abs, out_bad,
                                  token, code, V, nprog, NPROG=triton.next_power_of_2(nprog), SUBC=SUB, CAPC=CAP,
                                  **_launch(), **({} if INTERPRET else {"num_warps": 8}))
    return token, code


@torch.library.custom_op(f"{LIB}::gumbel_draw", mutates_args=())
def gumbel_draw(cand: torch.Tensor, count: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor,
                block_hi: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor, temp: torch.Tensor,
                live: torch.Tensor, V: int, hnorm: torch.Tensor | None = None, e: torch.Tensor | None = None,
                rad_max: float = 0.0, act_coef: float = 0.0, tiny: float = 0.0, bslack_max: float = 0.0,
                delta: float = 0.0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """V2's Gumbel draw certified on the device (:func:`gumbel_draw_ref`)."""
    args = (cand, count, lower, upper, block_hi, seeds, pos, temp, live, V, hnorm, e, rad_max, act_coef, tiny,
            bslack_max, delta, dtype)
    return (gumbel_draw_triton if _use_triton(lower) else gumbel_draw_ref)(*args)


@gumbel_draw.register_fake
def _(cand, count, lower, upper, block_hi, seeds, pos, temp, live, V, *args):
    B = lower.shape[0]
    return lower.new_empty(B, dtype=torch.int64), lower.new_empty(B, dtype=torch.int32)


def block_upper(bmax: torch.Tensor, hnorm: torch.Tensor, e: torch.Tensor, consts: dict, dtype: torch.dtype):
    """``[B, nb]`` fp32: an upper bound of the dense model-dtype logit of every token of each block
    from the screen's block maxima ``bmax`` (:func:`~vllm_csv.gpu.screen.screen_block_max`), the
    bound :func:`vllm_csv.ops.step.threshold_from` inverts to pick candidates: a token of screen
    value ``y`` has a dense value at most ``y + delta |y| + spread``, ``spread = rad_max ||h|| +
    act_coef e + tiny + bslack_max``. In float64, widened by ``2^-20`` relative (the fp32
    roundings ``threshold_from`` allows itself are 8 ulps), rounded up to fp32, then to the model
    dtype (rounding is monotone: the dense value, the engine's rounding of a smaller real, is at
    most this). NaN rows (``hnorm`` NaN, a row that is not ``ok``) stay NaN: refused."""
    c = consts
    spread = (c["rad_max"] * hnorm.double() + c["act_coef"] * e.double() + c["tiny"] + c["bslack_max"])[:, None]
    y = bmax.double()
    ub = y + c["delta"] * y.abs() + spread
    ub = ub + ub.abs() * 2.0**-20 + c["tiny"]
    return round_up32(ub).to(dtype).float()
