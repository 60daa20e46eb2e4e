"""The certified V2 Gumbel draw on the device: the token vLLM's Model Runner V2 sampler
(``gumbel_sample``, fp32 noise) draws from a row, decided from exact intervals of a few candidate
blocks and an upper bound on every other block, or the row refused. Three custom ops
(``torch.ops.vllm_csv_gpu.<op>``, each a Triton kernel beside its torch reference ``<op>_ref``,
fixed shapes, no host sync), which :meth:`vllm_csv.gpu.step.FusedStep.draw_v2` runs after the
step's quantize and screen kernels and around its scoring kernel:

1. :func:`block_bounds` ``[B, ceil(nb / BPP)]`` programs: for every block ``b`` of ``SUB``
   tokens, an upper bound of every token's noisy score ``fl32(x_i / T) + g_i`` there:
   ``qhi(ub_b) + g_hi(min hash)``. ``ub_b`` bounds the block's logits (given, or from the
   screen's block maximum, :func:`block_upper`'s arithmetic in the kernel); ``qhi`` is V2's
   temperature bounded as :func:`~vllm_csv.sampling.gumbel_v2.temperature_bounds` does; the
   noise is the block's largest: ``u`` is non-decreasing in the uint32 hash, ``g(u)`` decreasing
   in ``u`` and ``g + eps(g)`` increasing in ``g``, so the token with the smallest hash
   (:func:`~vllm_csv.gumbel_noise.murmur3`, integers only, every token hashed) has the largest
   noise bound. Written rounded up to fp32, with ``|qhi|`` (the comparison margin needs it).
2. :func:`draw_select` ``[B]`` programs: the row's candidates, the ``cap`` blocks of largest
   bound (ties at the last: the first by index), compacted in ascending order as
   :func:`~vllm_csv.gpu.select.select_blocks` lays them out (what :mod:`.score` scores); the
   largest bound and ``|qhi|`` of the other blocks; the step's ``ok`` (every row of the batch
   ``ok``, the overflow check of :func:`vllm_csv.ops.step.threshold_from`). The blocks that can
   beat the winner are the ones of largest noisy bound, so they are the ones worth scoring
   (a threshold on the logits alone, as for an argmax, misses a lower block with a large noise).
3. :func:`gumbel_draw` ``[B]`` programs: the candidates' own noise (hash and uniform replayed bit
   for bit as vLLM's ``murmur3_hash32`` / ``murmur3_uniform32``, then bounded in float64 as
   :func:`~vllm_csv.gumbel_noise.noise_bounds`) on their exact intervals ``lower <= x <=
   upper``, and the decision: ``token [B]`` int64 and ``code [B]`` int32 (0 certified, 1 not
   ``ok``/``live``, 2 an unusable temperature, 3 not certified).

The rule is :func:`vllm_csv.sampling.gumbel_v2.certify_draw_v2`'s (its module has the argument),
with the outside blocks as one column each: ``best = max qlo + g_lo`` over the candidates, ``m =
2^-23 (A + 24)`` (:func:`~vllm_csv.gumbel_noise.comparison_margin`); certified when the winner is
the only candidate with ``qhi + g_hi >= best - 2 m`` and the outside blocks' largest bound is
below ``best - 2 m``. ``A`` is the largest finite ``|qlo|, |qhi|`` of the candidates and
``|qhi(ub_b)|`` of the outside blocks: the margin covers the rounding of the winner's sum
(``|x_w| <= A``) and of a competitor's, which is at most ``fl(hi + g_hi)`` (rounding is
monotone), within ``2^-24 (|hi| + 24)`` of it, so no competitor's lower bound enters (the CPU rule
takes them into ``A`` as well, which only widens it). A row certified here is certified by the
CPU rule on the same bounds spread over every token (``tests/test_gpu_gumbel_draw.py``). Ties and
near-ties are never certified: the comparison is strict with the margin on both sides. A NaN or
``+inf`` bound of an outside block makes its bound ``+inf`` (the row is refused unless that block
is a candidate, scored exactly); NaN or ``+inf`` among the candidates refuses the row. ``T = 0``:
a greedy row, no noise and no margin (V2's argmax); ``T`` negative, NaN or outside ``[2^-126,
2^126]``: refused.
"""

from __future__ import annotations

import math

import torch

from ..fp import round_down32, round_up32
from ..gumbel_noise import (DIV_ABS, DIV_REL, DIV_T_MAX, DIV_T_MIN, EPS_ABS, EPS_REL, comparison_margin, murmur3,
                            noise, uniform)
from .common import CAP, INTERPRET, LIB, SUB, _launch, _tl_dtype, _use_triton, slot_ids, tl, triton

BPP = 16  # blocks (of SUB tokens) a program of block_bounds hashes: 1024 tokens, vLLM's tile
CODE_CERTIFIED, CODE_NOT_LIVE, CODE_TEMPERATURE, CODE_UNCERTIFIED = 0, 1, 2, 3


def block_upper(bmax: torch.Tensor, hnorm: torch.Tensor, e: torch.Tensor, consts: dict, dtype: torch.dtype):
    """``[B, nb]`` fp32: an upper bound of the dense model-dtype logit of every token of each block
    from the screen's block maxima ``bmax`` (:func:`~vllm_csv.gpu.screen.screen_block_max`), the
    bound :func:`vllm_csv.head.selection.select_two_sided` stands on (a token of screen value
    ``y`` has ``hi <= y + delta |y| + spread``, ``spread = rad_max ||h|| + act_coef e + tiny +
    bslack_max``; ``y + delta |y|`` is increasing, so the block maximum bounds the block). In
    float64, widened by ``2^-20`` relative and ``tiny``, rounded up to fp32, then to the model
    dtype (rounding is monotone: the dense value, the engine's rounding of a smaller real, is
    at most this). A NaN ``hnorm`` (a row that is not ``ok``) gives NaN: refused."""
    c = consts
    spread = (c["rad_max"] * hnorm.double() + c["act_coef"] * e.double() + c["tiny"] + c["bslack_max"])[:, None]
    y = bmax.double()
    ub = y + c["delta"] * y.abs() + spread
    ub = ub + ub.abs() * 2.0**-20 + c["tiny"]
    return round_up32(ub).to(dtype).float()


# ---- torch references -----------------------------------------------------------------------
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


def block_bounds_ref(block_hi, seeds, pos, temp, V: int, hnorm=None, e=None, rad_max: float = 0.0,
                     act_coef: float = 0.0, tiny: float = 0.0, bslack_max: float = 0.0, delta: float = 0.0,
                     dtype: torch.dtype = torch.float32):
    """``(bound [B, nb] fp32, absq [B, nb] fp32)``: each block's noisy bound (module docstring, 1.),
    ``+inf`` where ``qhi`` is NaN or ``+inf``, and its ``|qhi|`` (0 where not finite).

    Parameters
    ----------
    block_hi : torch.Tensor
        ``[B, nb]`` fp32 (``nb = ceil(V / SUB)``): an upper bound of the logit of every token of
        each block; with ``hnorm`` given, the screen's block maxima instead, turned into that
        bound by :func:`block_upper` (``hnorm, e, rad_max, act_coef, tiny, bslack_max, delta,
        dtype`` are its arguments).
    seeds, pos : torch.Tensor
        ``[B]`` int64, each row's request seed and sampling position.
    temp : torch.Tensor
        ``[B]`` fp32, the row's temperature (0: greedy).
    """
    if hnorm is not None:
        block_hi = block_upper(block_hi, hnorm, e, dict(rad_max=rad_max, act_coef=act_coef, tiny=tiny,
                                                        bslack_max=bslack_max, delta=delta), dtype)
    B, nb = block_hi.shape
    t_div, greedy, _ = _temp_ref(temp)
    tok = torch.arange(nb * SUB, device=block_hi.device)
    r = murmur3(seeds, pos, tok.clamp(max=V - 1))
    r = torch.where(tok[None] < V, r, 0xFFFFFFFF).view(B, nb, SUB).amin(2)
    u = (r >> 16).float() * 2.0**-16 + ((r & 0xFFFF).float() + 0.5) * 2.0**-32
    g_hi = _noise_bounds_ref(u)[1].masked_fill(greedy, 0.0)
    bh = block_hi.double()
    q = _q_bounds(bh, bh, t_div, greedy)[1]
    bound = torch.where(q > -math.inf, q + g_hi, -math.inf)
    bound = torch.where(torch.isnan(q) | (q == math.inf), math.inf, bound)
    return round_up32(bound), torch.where(torch.isfinite(q), q.abs(), 0.0).float()


def draw_select_ref(bound, absq, bmax, hnorm, e, ok, rad_max: float, act_coef: float, tiny: float,
                    bslack_max: float, delta: float, limit: float, babs_max: float, cap: int):
    """``(cand [B, CAP] int32, count [B] int32, out_hi [B] fp32, out_abs [B] fp32, ok [B] int8)``.

    The ``min(cap, nb)`` blocks of largest ``bound`` (ties at the last: the first by index),
    ascending, ``-1`` past ``count``; the largest ``bound`` and ``absq`` of the others (``-inf``,
    0 where none); ``ok`` with every row of the batch ``ok`` and the overflow check of
    :func:`vllm_csv.ops.step.threshold_from` (fp32, its order of operations) on the row's
    largest screen value."""
    B, nb = bound.shape
    n = min(cap, nb, CAP)
    vcap = bound.topk(n, dim=1).values[:, -1]
    sel = bound >= vcap[:, None]
    pos = sel.cumsum(1) - 1
    keep = sel & (pos < n)
    count = keep.sum(1).to(torch.int32)
    cand = torch.full((B, CAP), -1, dtype=torch.int32, device=bound.device)
    r, c = keep.nonzero(as_tuple=True)
    cand[r, pos[r, c]] = c.to(torch.int32)
    out_hi = bound.masked_fill(keep, -math.inf).amax(1)
    out_abs = absq.masked_fill(keep, 0.0).amax(1)
    ok = ok.bool()
    ok = ok & ok.all()
    spread = rad_max * hnorm + act_coef * e
    spread = spread + tiny
    spread = spread + bslack_max
    y1 = bmax.amax(1)
    top = y1 + delta * y1.abs()
    top = top + spread
    top = top + babs_max
    ok = ok & (top <= limit)
    return cand, count, out_hi, out_abs, ok.to(torch.int8)


def gumbel_draw_ref(cand, count, lower, upper, out_hi, out_abs, seeds, pos, temp, live, V: int):
    """``(token [B] int64, code [B] int32)``: the decision (module docstring, 3.) in torch.

    Parameters
    ----------
    cand, count : torch.Tensor
        ``[B, CAP]`` int32 candidate block ids (``-1`` past ``count``), ``[B]`` int32.
    lower, upper : torch.Tensor
        ``[B, CAP * SUB]`` fp32 bounds of the candidate tokens' logits (the slots of
        :func:`~vllm_csv.gpu.score.score_blocks`; slots past ``count`` are not read).
    out_hi, out_abs : torch.Tensor
        ``[B]`` fp32: the other blocks' largest noisy bound and ``|qhi|`` (:func:`draw_select`).
    seeds, pos, temp : torch.Tensor
        ``[B]``: as :func:`block_bounds_ref`.
    live : torch.Tensor
        ``[B]`` int8, rows that may be certified.
    """
    dev = lower.device
    ids = slot_ids(cand, count, V)  # [B, S], -1 where empty
    valid = ids >= 0
    t_div, greedy, t_ok = _temp_ref(temp)
    qlo, qhi = _q_bounds(torch.where(valid, lower.double(), -math.inf),
                         torch.where(valid, upper.double(), -math.inf), t_div, greedy)
    g_lo, g_hi = _noise_bounds_ref(uniform(seeds, pos, ids.clamp_min(0)))
    g_lo, g_hi = g_lo.masked_fill(greedy, 0.0), g_hi.masked_fill(greedy, 0.0)
    nlo = torch.where(qlo > -math.inf, qlo + g_lo, -math.inf)
    nhi = torch.where(qhi > -math.inf, qhi + g_hi, -math.inf)
    bad = (torch.isnan(qlo) | torch.isnan(qhi) | (qhi == math.inf)).any(1)
    best = nlo.amax(1)
    slot = torch.arange(nlo.shape[1], device=dev)
    w = torch.where(nlo == best[:, None], slot, nlo.shape[1]).amin(1).clamp(max=nlo.shape[1] - 1)
    fin = lambda x: torch.where(torch.isfinite(x), x.abs(), 0.0)  # noqa: E731
    A = torch.maximum(torch.maximum(fin(qlo).amax(1), fin(qhi).amax(1)), out_abs.double())
    m = torch.where(greedy[:, 0], 0.0, comparison_margin(A))
    bar = best - 2 * m
    others = ((nhi >= bar[:, None]) & (slot[None] != w[:, None])).sum(1)
    cert = (others == 0) & (out_hi.double() < bar) & (best > -math.inf) & ~bad
    token = torch.where(best > -math.inf, ids.gather(1, w[:, None])[:, 0], 0).clamp_min(0)
    code = torch.where(live.bool(), torch.where(t_ok, torch.where(cert, CODE_CERTIFIED, CODE_UNCERTIFIED),
                                                CODE_TEMPERATURE), CODE_NOT_LIVE)
    return token, code.to(torch.int32)


# ---- Triton ---------------------------------------------------------------------------------
if triton is not None:
    from .common import _rnd
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
    def _temp(temp_ptr, b):
        """``(t_div, greedy, t_ok)`` of row ``b``."""
        t = tl.load(temp_ptr + b).to(tl.float64)
        greedy = t == 0.0
        t_ok = ((t >= 1.1754943508222875e-38) & (t <= 8.507059173023462e+37)) | greedy
        return tl.where(greedy | (t_ok == 0), 1.0, t), greedy, t_ok

    @triton.jit
    def _block_bounds_kernel(block_hi_ptr, seed_ptr, pos_ptr, temp_ptr, bound_ptr, absq_ptr, V, nb,
                             hn_ptr, e_ptr, rad_max, act_coef, tiny, bslack_max, delta,
                             FROM_SCREEN: tl.constexpr, DT: tl.constexpr, BPPC: tl.constexpr, SUBC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1) * BPPC + tl.arange(0, BPPC)
        tok = blk[:, None].to(tl.int64) * SUBC + tl.arange(0, SUBC)[None, :]
        r = _hash(_prefix(tl.load(seed_ptr + b), tl.load(pos_ptr + b)), tok)
        r = tl.where(tok < V, r, 0xFFFFFFFF)
        rmin = tl.min(r, 1)  # [BPPC]: the block's largest noise is this token's
        t, greedy, t_ok = _temp(temp_ptr, b)
        _, g_hi = _noise_bounds(_uniform(rmin))
        g_hi = tl.where(greedy, 0.0, g_hi)
        m = blk < nb
        bh = tl.load(block_hi_ptr + b * nb + blk, mask=m, other=float("-inf"))
        if FROM_SCREEN:  # block_upper, operation for operation (float64, fp32 up, the dtype)
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
        bound = tl.where(q > float("-inf"), q + g_hi, float("-inf"))
        bound = tl.where((q != q) | (q == float("inf")), float("inf"), bound)
        absq = tl.where(tl.abs(q) < float("inf"), tl.abs(q), 0.0)
        tl.store(bound_ptr + b * nb + blk, _up32(bound), mask=m)
        tl.store(absq_ptr + b * nb + blk, absq.to(tl.float32), mask=m)

    @triton.jit
    def _draw_select_kernel(bound_ptr, absq_ptr, bmax_ptr, hn_ptr, e_ptr, ok_ptr, cand_ptr, count_ptr, ohi_ptr,
                            oabs_ptr, okout_ptr, B, nb, n, rad_max, act_coef, tiny, bslack_max, delta, limit,
                            babs_max, NB: tl.constexpr, BBATCH: tl.constexpr, CAPC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, NB)
        inb = idx < nb
        x = tl.load(bound_ptr + b * nb + idx, mask=inb, other=float("-inf"))
        work = x
        vcap = tl.max(x, 0)
        for j in tl.static_range(CAPC):  # the n-th largest, with multiplicity: drop one maximum a round
            mx = tl.max(work, 0)
            vcap = tl.where(j == n - 1, mx, vcap)
            first = tl.argmax(work, 0)
            work = tl.where(idx == first, float("-inf"), work)
        sel = (x >= vcap) & inb
        si = tl.where(sel, 1, 0)
        pos = tl.cumsum(si, 0) - 1
        keep = sel & (pos < n)
        slots = tl.arange(0, CAPC)
        tl.store(cand_ptr + b * CAPC + slots, tl.full([CAPC], -1, tl.int32))
        tl.debug_barrier()
        tl.store(cand_ptr + b * CAPC + pos, idx.to(tl.int32), mask=keep)
        tl.store(count_ptr + b, tl.sum(tl.where(keep, 1, 0), 0))
        tl.store(ohi_ptr + b, tl.max(tl.where(keep, float("-inf"), x), 0))
        aq = tl.load(absq_ptr + b * nb + idx, mask=inb, other=0.0)
        tl.store(oabs_ptr + b, tl.max(tl.where(keep, 0.0, aq), 0))
        # ok: select_blocks' (every row of the batch, then threshold_from's overflow check, fp32)
        rows = tl.arange(0, BBATCH)
        all_ok = tl.min(tl.load(ok_ptr + rows, mask=rows < B, other=1).to(tl.int32), 0)
        ok = (tl.load(ok_ptr + b).to(tl.int32) != 0) & (all_ok != 0)
        y1 = tl.max(tl.load(bmax_ptr + b * nb + idx, mask=inb, other=float("-inf")), 0)
        spread = rad_max * tl.load(hn_ptr + b) + act_coef * tl.load(e_ptr + b)
        spread = spread + tiny
        spread = spread + bslack_max
        top = y1 + delta * tl.abs(y1)
        top = top + spread
        top = top + babs_max
        ok = ok & (top <= limit)
        tl.store(okout_ptr + b, ok.to(tl.int8))

    @triton.jit
    def _gumbel_draw_kernel(cand_ptr, count_ptr, lo_ptr, up_ptr, ohi_ptr, oabs_ptr, seed_ptr, pos_ptr, temp_ptr,
                            live_ptr, token_ptr, code_ptr, V, SUBC: tl.constexpr, CAPC: tl.constexpr):
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
        g_lo, g_hi = _noise_bounds(_uniform(_hash(_prefix(tl.load(seed_ptr + b), tl.load(pos_ptr + b)),
                                                  tl.where(valid, ids, 0))))
        g_lo = tl.where(greedy, 0.0, g_lo)
        g_hi = tl.where(greedy, 0.0, g_hi)
        nlo = tl.where((qlo > float("-inf")) & (qlo == qlo), qlo + g_lo, float("-inf"))
        nhi = tl.where(qhi > float("-inf"), qhi + g_hi, float("-inf"))
        nbad = tl.sum(tl.where((qlo != qlo) | (qhi != qhi) | (qhi == float("inf")), 1, 0), 0)
        best = tl.max(nlo, 0)
        w = tl.min(tl.where(nlo == best, sl, S), 0)
        w = tl.where(w < S, w, 0)
        abs_lo = tl.where(tl.abs(qlo) < float("inf"), tl.abs(qlo), 0.0)
        abs_hi = tl.where(tl.abs(qhi) < float("inf"), tl.abs(qhi), 0.0)
        o_hi = tl.load(ohi_ptr + b).to(tl.float64)
        A = tl.maximum(tl.maximum(tl.max(abs_lo, 0), tl.max(abs_hi, 0)), tl.load(oabs_ptr + b).to(tl.float64))
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


def block_bounds_triton(block_hi, seeds, pos, temp, V: int, hnorm=None, e=None, rad_max: float = 0.0,
                        act_coef: float = 0.0, tiny: float = 0.0, bslack_max: float = 0.0, delta: float = 0.0,
                        dtype: torch.dtype = torch.float32):
    B, nb = block_hi.shape
    bound = torch.empty((B, nb), dtype=torch.float32, device=block_hi.device)
    absq = torch.empty((B, nb), dtype=torch.float32, device=block_hi.device)
    if B:
        screen = hnorm is not None
        temp = temp.float().contiguous()
        _block_bounds_kernel[(B, triton.cdiv(nb, BPP))](
            block_hi.float().contiguous(), seeds.long().contiguous(), pos.long().contiguous(), temp, bound, absq,
            V, nb, hnorm if screen else temp, e if screen else temp, rad_max, act_coef, tiny, bslack_max, delta,
            FROM_SCREEN=screen, DT=_tl_dtype(dtype), BPPC=BPP, SUBC=SUB, **_launch())
    return bound, absq


def draw_select_triton(bound, absq, bmax, hnorm, e, ok, rad_max: float, act_coef: float, tiny: float,
                       bslack_max: float, delta: float, limit: float, babs_max: float, cap: int):
    B, nb = bound.shape
    dev = bound.device
    cand = torch.empty((B, CAP), dtype=torch.int32, device=dev)
    count = torch.empty(B, dtype=torch.int32, device=dev)
    out_hi = torch.empty(B, dtype=torch.float32, device=dev)
    out_abs = torch.empty(B, dtype=torch.float32, device=dev)
    okout = torch.empty(B, dtype=torch.int8, device=dev)
    if B:
        _draw_select_kernel[(B,)](bound, absq, bmax, hnorm, e, ok, cand, count, out_hi, out_abs, okout, B, nb,
                                  min(cap, nb, CAP), rad_max, act_coef, tiny, bslack_max, delta, limit, babs_max,
                                  NB=triton.next_power_of_2(nb), BBATCH=max(64, triton.next_power_of_2(B)),
                                  CAPC=CAP, **_launch())
    return cand, count, out_hi, out_abs, okout


def gumbel_draw_triton(cand, count, lower, upper, out_hi, out_abs, seeds, pos, temp, live, V: int):
    B = lower.shape[0]
    dev = lower.device
    token = torch.empty(B, dtype=torch.int64, device=dev)
    code = torch.empty(B, dtype=torch.int32, device=dev)
    if B:
        _gumbel_draw_kernel[(B,)](cand, count, lower, upper, out_hi, out_abs, seeds.long().contiguous(),
                                  pos.long().contiguous(), temp.float().contiguous(), live, token, code, V,
                                  SUBC=SUB, CAPC=CAP, **_launch(), **({} if INTERPRET else {"num_warps": 8}))
    return token, code


# ---- custom ops -----------------------------------------------------------------------------
@torch.library.custom_op(f"{LIB}::block_bounds", mutates_args=())
def block_bounds(block_hi: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor, temp: torch.Tensor, V: int,
                 hnorm: torch.Tensor | None = None, e: torch.Tensor | None = None, rad_max: float = 0.0,
                 act_coef: float = 0.0, tiny: float = 0.0, bslack_max: float = 0.0, delta: float = 0.0,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block's noisy bound (:func:`block_bounds_ref`)."""
    args = (block_hi, seeds, pos, temp, V, hnorm, e, rad_max, act_coef, tiny, bslack_max, delta, dtype)
    return (block_bounds_triton if _use_triton(block_hi) else block_bounds_ref)(*args)


@block_bounds.register_fake
def _(block_hi, *args):
    return block_hi.new_empty(block_hi.shape, dtype=torch.float32), block_hi.new_empty(block_hi.shape,
                                                                                      dtype=torch.float32)


@torch.library.custom_op(f"{LIB}::draw_select", mutates_args=())
def draw_select(bound: torch.Tensor, absq: torch.Tensor, bmax: torch.Tensor, hnorm: torch.Tensor, e: torch.Tensor,
                ok: torch.Tensor, rad_max: float, act_coef: float, tiny: float, bslack_max: float, delta: float,
                limit: float, babs_max: float, cap: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draw's candidate blocks (:func:`draw_select_ref`)."""
    args = (bound, absq, bmax, hnorm, e, ok, rad_max, act_coef, tiny, bslack_max, delta, limit, babs_max, cap)
    return (draw_select_triton if _use_triton(bound) else draw_select_ref)(*args)


@draw_select.register_fake
def _(bound, *args):
    B = bound.shape[0]
    return (bound.new_empty((B, CAP), dtype=torch.int32), bound.new_empty(B, dtype=torch.int32),
            bound.new_empty(B), bound.new_empty(B), bound.new_empty(B, dtype=torch.int8))


@torch.library.custom_op(f"{LIB}::gumbel_draw", mutates_args=())
def gumbel_draw(cand: torch.Tensor, count: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor,
                out_hi: torch.Tensor, out_abs: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                temp: torch.Tensor, live: torch.Tensor, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """V2's Gumbel draw certified on the device (:func:`gumbel_draw_ref`)."""
    args = (cand, count, lower, upper, out_hi, out_abs, seeds, pos, temp, live, V)
    return (gumbel_draw_triton if _use_triton(lower) else gumbel_draw_ref)(*args)


@gumbel_draw.register_fake
def _(cand, count, lower, *args):
    B = lower.shape[0]
    return lower.new_empty(B, dtype=torch.int64), lower.new_empty(B, dtype=torch.int32)
