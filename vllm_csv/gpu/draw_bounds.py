"""The first two stages of the certified V2 Gumbel draw on the device (:mod:`.gumbel_draw` has the
overview and the rule): an upper bound of every block's noisy scores, then the candidate blocks,
the ones of largest bound. Two custom ops (``torch.ops.vllm_csv_gpu.<op>``, each a Triton kernel
beside its torch reference ``<op>_ref``, fixed shapes, no host sync):

1. :func:`block_bounds` ``[B, ceil(nb / BPP)]`` programs: for every block ``b`` of ``SUB``
   tokens, an upper bound of every token's noisy score ``fl32(x_i / T) + g_i`` there:
   ``qhi(ub_b) + g_hi(min hash)``. ``ub_b`` bounds the block's logits (given, or the screen's
   block upper bound rounded to the model dtype, :func:`block_upper`, in the kernel); ``qhi`` is V2's
   temperature bounded as :func:`~vllm_csv.sampling.gumbel_v2.temperature_bounds` does; the
   noise is the block's largest: ``u`` is non-decreasing in the uint32 hash, ``g(u)`` decreasing
   in ``u`` and ``g + eps(g)`` increasing in ``g``, so the token with the smallest hash
   (:func:`~vllm_csv.gumbel_noise.murmur3`, integers only, every token hashed) has the largest
   noise bound. Written rounded up to fp32, with ``qhi`` (the comparison margin needs its
   magnitude, min-p the row's largest).
2. :func:`draw_select` ``[B]`` programs: the row's candidates, the ``cap`` blocks of largest
   bound (ties at the last: the first by index), compacted in ascending order as
   :func:`~vllm_csv.gpu.select.select_blocks` lays them out (what :mod:`.score` scores); the
   largest bound, finite ``|qhi|`` and ``qhi`` of the other blocks; with min-p, the blocks it
   surely drops left out of both and the block of largest ``qhi`` (the row's maximum's) a
   candidate first (:func:`min_p_dropped_ref`); the step's ``ok`` (every row of the batch
   ``ok``, the overflow check of :func:`~vllm_csv.gpu.select.select_blocks_ref`). The blocks that can
   beat the winner are the ones of largest noisy bound, so they are the ones worth scoring
   (a threshold on the logits alone, as for an argmax, misses a lower block with a large noise).

The hash, noise and temperature replayed here are :mod:`.gumbel_jit`'s.
"""

from __future__ import annotations

import math

import torch

from ..fp import round_up32
from ..gumbel_noise import LOG_ABS, LOG_REL, min_p_thresholds, murmur3
from .common import CAP, LIB, SUB, _launch, _tl_dtype, _use_triton, tl, triton
from .gumbel_draw import BPP
from .gumbel_jit import _noise_bounds_ref, _q_bounds, _temp_ref


def block_upper(umax: torch.Tensor, dtype: torch.dtype):
    """``[B, nb]`` fp32: an upper bound of the dense model-dtype logit of every token of each block
    from the screen's block upper bounds ``umax`` (:func:`~vllm_csv.gpu.screen.screen_block_max`,
    fp32 bounds of the dense accumulator), rounded to the model dtype: rounding is monotone, so
    the dense value, the engine's rounding of a smaller real, is at most this."""
    return umax.to(dtype).float()


# ---- torch references -----------------------------------------------------------------------
def block_bounds_ref(block_hi, seeds, pos, temp, V: int, from_screen: bool = False,
                     dtype: torch.dtype = torch.float32):
    """``(bound [B, nb] fp32, qhi [B, nb] fp32)``: each block's noisy bound (module docstring, 1.),
    ``+inf`` where ``qhi`` is NaN or ``+inf``, and its ``qhi``, the bound of its tokens' tempered
    logits (NaN and infinities kept).

    Parameters
    ----------
    block_hi : torch.Tensor
        ``[B, nb]`` fp32 (``nb = ceil(V / SUB)``): an upper bound of the logit of every token of
        each block; with ``from_screen``, the screen's block upper bounds instead, turned into
        that bound by :func:`block_upper` (with ``dtype``).
    seeds, pos : torch.Tensor
        ``[B]`` int64, each row's request seed and sampling position.
    temp : torch.Tensor
        ``[B]`` fp32, the row's temperature (0: greedy).
    """
    if from_screen:
        block_hi = block_upper(block_hi, dtype)
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
    return round_up32(bound), q.float()


def min_p_dropped_ref(qhi, lmax, temp, min_p, dtype: torch.dtype):
    """``(on [B], dropped [B, nb], top [B])``: the rows with a min-p in ``(0, 1]`` (not greedy), the
    blocks min-p surely drops in them, and each row's block of largest ``qhi`` (NaN first; the
    first by index). Before any token is scored, the row's maximum is bounded below by the largest of
    the screen's block lower bounds ``lmax`` (fp32 bounds of a token's dense accumulator) rounded
    to the model dtype (rounding is monotone), through V2's temperature
    (:func:`~.gumbel_jit._q_bounds`); :func:`~vllm_csv.gumbel_noise.min_p_thresholds` of it is
    below the kernel's threshold, so a block whose ``qhi`` is under it holds no token min-p keeps.
    The block of largest ``qhi`` is never dropped (it bounds the row's maximum). Nor is a block
    that holds the maximum, as long as the threshold is at most the maximum: ``min_p <= 1``, which
    vLLM's ``SamplingParams`` requires; above it, no early drop (the blocks left out of
    ``out_q`` could then hold the maximum that :func:`~.gumbel_draw.gumbel_draw` bounds by it)."""
    t_div, greedy, _ = _temp_ref(temp)
    on = (min_p > 0) & (min_p <= 1) & ~greedy[:, 0]
    lbq = lmax.amax(1).to(dtype).double()[:, None]
    m_lo = _q_bounds(lbq, lbq, t_div, greedy)[0]
    thr = min_p_thresholds(m_lo, m_lo, torch.where(on, min_p, 1.0)[:, None])[0].double()
    dropped = on[:, None] & (qhi.double() < thr)
    top = torch.where(torch.isnan(qhi), math.inf, qhi).argmax(1)
    return on, dropped, top


def draw_select_ref(bound, qhi, umax, lmax, ok, limit: float, babs_max: float, cap: int,
                    temp=None, min_p=None, dtype: torch.dtype = torch.float32):
    """``(cand [B, CAP] int32, count [B] int32, out_hi [B] fp32, out_abs [B] fp32, out_q [B] fp32,
    ok [B] int8)``.

    The ``min(cap, nb)`` blocks of largest ``bound`` (every block above the ``n``-th value, then the
    ties at it, the first by index), ascending, ``-1`` past ``count``; of the others: the largest
    ``bound`` (``-inf`` where none), the largest finite ``|qhi|`` (0 where none) and the largest
    ``qhi`` (NaN as ``+inf``; ``-inf``
    where none: an upper bound of their tokens' tempered logits, for min-p); ``ok`` with every
    row of the batch ``ok`` and the overflow check of
    :func:`~vllm_csv.gpu.select.select_blocks_ref` on the row's screen bounds ``umax`` (``lmax``,
    the lower ones, for min-p). With ``min_p`` (``[B]``
    fp32, 0: none; ``temp`` and ``dtype`` then given), in a row that has one, the blocks min-p
    surely drops (:func:`min_p_dropped_ref`) are neither candidates nor among the others, and
    the block of largest ``qhi`` is a candidate first: it holds the row's maximum, whose bounds
    set the threshold (``bound`` itself is unchanged)."""
    B, nb = bound.shape
    n = min(cap, nb, CAP)
    key, dropped = bound, torch.zeros_like(bound, dtype=torch.bool)
    if min_p is not None:
        on, dropped, top = min_p_dropped_ref(qhi, lmax, temp, min_p, dtype)
        key = bound.masked_fill(dropped, -math.inf)
        first = on[:, None] & (torch.arange(nb, device=bound.device)[None] == top[:, None])
        key = key.masked_fill(first, math.inf)
    vcap = key.topk(n, dim=1).values[:, -1:]
    gt = key > vcap  # every block above the n-th value, then the ties at it by index
    tie = (key == vcap) & ~dropped
    keep = gt | (tie & (tie.cumsum(1) <= n - gt.sum(1, keepdim=True)))
    pos = keep.cumsum(1) - 1
    count = keep.sum(1).to(torch.int32)
    cand = torch.full((B, CAP), -1, dtype=torch.int32, device=bound.device)
    r, c = keep.nonzero(as_tuple=True)
    cand[r, pos[r, c]] = c.to(torch.int32)
    gone = keep | dropped
    out_hi = bound.masked_fill(gone, -math.inf).amax(1)
    out_abs = torch.where(torch.isfinite(qhi), qhi.abs(), 0.0).masked_fill(gone, 0.0).amax(1)
    out_q = torch.where(torch.isnan(qhi), math.inf, qhi).masked_fill(gone, -math.inf).amax(1)
    ok = ok.bool()
    ok = ok & ok.all()
    ok = ok & ((umax.amax(1) + babs_max) <= limit)
    return cand, count, out_hi, out_abs, out_q, ok.to(torch.int8)


# ---- Triton ---------------------------------------------------------------------------------
if triton is not None:
    from .common import _pdl_wait, _rnd
    from .gumbel_jit import _hash, _min_p_thresholds, _noise_bounds, _prefix, _q_hi, _q_lo, _temp, _uniform
    from .score import _up32
    from .select import _kth_largest, _top_ok

    @triton.jit
    def _block_bounds_kernel(block_hi_ptr, seed_ptr, pos_ptr, temp_ptr, bound_ptr, qhi_ptr, V, nb,
                             FROM_SCREEN: tl.constexpr, DT: tl.constexpr, BPPC: tl.constexpr, SUBC: tl.constexpr,
                             PDL: tl.constexpr):
        _pdl_wait(PDL)  # (common._launch: PDL launches wait for the kernel before)
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
        if FROM_SCREEN:  # block_upper: the screen's fp32 bound to the model dtype
            bh = _rnd(bh, DT)
        q = _q_hi(bh, t, greedy)
        bound = tl.where(q > float("-inf"), q + g_hi, float("-inf"))
        bound = tl.where((q != q) | (q == float("inf")), float("inf"), bound)
        tl.store(bound_ptr + b * nb + blk, _up32(bound), mask=m)
        tl.store(qhi_ptr + b * nb + blk, q.to(tl.float32), mask=m)

    @triton.jit
    def _draw_select_kernel(bound_ptr, qhi_ptr, umax_ptr, lmax_ptr, ok_ptr, temp_ptr, minp_ptr, cand_ptr,
                            count_ptr, ohi_ptr, oabs_ptr, oq_ptr, okout_ptr, B, nb, n, limit, babs_max, log_abs,
                            log_rel, MINP: tl.constexpr, DT: tl.constexpr, NB: tl.constexpr, BBATCH: tl.constexpr,
                            CAPC: tl.constexpr, PDL: tl.constexpr):
        _pdl_wait(PDL)  # (common._launch: PDL launches wait for the kernel before)
        b = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, NB)
        inb = idx < nb
        x = tl.load(bound_ptr + b * nb + idx, mask=inb, other=float("-inf"))
        q = tl.load(qhi_ptr + b * nb + idx, mask=inb, other=float("-inf"))
        u1 = tl.max(tl.load(umax_ptr + b * nb + idx, mask=inb, other=float("-inf")), 0)
        key = x
        drop = idx < 0  # (none)
        if MINP:  # min_p_dropped_ref, operation for operation
            t, greedy, _ = _temp(temp_ptr, b)
            mp = tl.where(greedy, 0.0, tl.load(minp_ptr + b))
            on = (mp > 0.0) & (mp <= 1.0)
            lb = tl.max(tl.load(lmax_ptr + b * nb + idx, mask=inb, other=float("-inf")), 0)
            m_lo = _q_lo(_rnd(lb, DT), t, greedy)
            thr, _ = _min_p_thresholds(m_lo, m_lo, tl.where(on, mp, 1.0), log_abs, log_rel)
            drop = tl.where(on, q.to(tl.float64) < thr, drop)
            top = tl.argmax(tl.where(inb, tl.where(q != q, float("inf"), q), float("-inf")), 0)
            key = tl.where(drop, float("-inf"), x)
            key = tl.where(on, tl.where(idx == top, float("inf"), key), key)
        vcap = _kth_largest(key, idx, n, CAPC, CAPC)  # the n-th largest, with multiplicity (CAPC rounds)
        gt = (key > vcap) & inb  # every block above the n-th value, then the ties at it by index
        tie = (key == vcap) & inb & (drop == 0)
        ngt = tl.sum(tl.where(gt, 1, 0), 0)
        keep = gt | (tie & (tl.cumsum(tl.where(tie, 1, 0), 0) <= n - ngt))
        pos = tl.cumsum(tl.where(keep, 1, 0), 0) - 1
        slots = tl.arange(0, CAPC)
        tl.store(cand_ptr + b * CAPC + slots, tl.full([CAPC], -1, tl.int32))
        tl.debug_barrier()
        tl.store(cand_ptr + b * CAPC + pos, idx.to(tl.int32), mask=keep)
        tl.store(count_ptr + b, tl.sum(tl.where(keep, 1, 0), 0))
        gone = keep | drop
        tl.store(ohi_ptr + b, tl.max(tl.where(gone, float("-inf"), x), 0))
        aq = tl.where(tl.abs(q) < float("inf"), tl.abs(q), 0.0)
        tl.store(oabs_ptr + b, tl.max(tl.where(gone, 0.0, aq), 0))
        q = tl.where(q != q, float("inf"), q)
        tl.store(oq_ptr + b, tl.max(tl.where(gone, float("-inf"), q), 0))
        # ok: select_blocks' (every row of the batch, then the overflow check, fp32)
        ok = _top_ok(ok_ptr, b, B, u1, limit, babs_max, BBATCH)
        tl.store(okout_ptr + b, ok.to(tl.int8))


def block_bounds_triton(block_hi, seeds, pos, temp, V: int, from_screen: bool = False,
                        dtype: torch.dtype = torch.float32):
    B, nb = block_hi.shape
    bound = torch.empty((B, nb), dtype=torch.float32, device=block_hi.device)
    qhi = torch.empty((B, nb), dtype=torch.float32, device=block_hi.device)
    if B:
        temp = temp.float().contiguous()
        _block_bounds_kernel[(B, triton.cdiv(nb, BPP))](
            block_hi.float().contiguous(), seeds.long().contiguous(), pos.long().contiguous(), temp, bound, qhi,
            V, nb, FROM_SCREEN=from_screen, DT=_tl_dtype(dtype), BPPC=BPP, SUBC=SUB, **_launch())
    return bound, qhi


def draw_select_triton(bound, qhi, umax, lmax, ok, limit: float, babs_max: float, cap: int,
                       temp=None, min_p=None, dtype: torch.dtype = torch.float32):
    B, nb = bound.shape
    dev = bound.device
    cand = torch.empty((B, CAP), dtype=torch.int32, device=dev)
    count = torch.empty(B, dtype=torch.int32, device=dev)
    out_hi = torch.empty(B, dtype=torch.float32, device=dev)
    out_abs = torch.empty(B, dtype=torch.float32, device=dev)
    out_q = torch.empty(B, dtype=torch.float32, device=dev)
    okout = torch.empty(B, dtype=torch.int8, device=dev)
    if B:
        mp = min_p is not None
        _draw_select_kernel[(B,)](bound, qhi, umax, lmax, ok, temp.float().contiguous() if mp else bound,
                                  min_p.float().contiguous() if mp else bound, cand, count, out_hi, out_abs, out_q,
                                  okout, B, nb, min(cap, nb, CAP), limit, babs_max, LOG_ABS, LOG_REL, MINP=mp,
                                  DT=_tl_dtype(dtype), NB=triton.next_power_of_2(nb),
                                  BBATCH=max(64, triton.next_power_of_2(B)), CAPC=CAP, **_launch())
    return cand, count, out_hi, out_abs, out_q, okout


# ---- custom ops -----------------------------------------------------------------------------
@torch.library.custom_op(f"{LIB}::block_bounds", mutates_args=())
def block_bounds(block_hi: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor, temp: torch.Tensor, V: int,
                 from_screen: bool = False, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block's noisy bound (:func:`block_bounds_ref`)."""
    args = (block_hi, seeds, pos, temp, V, from_screen, dtype)
    return (block_bounds_triton if _use_triton(block_hi) else block_bounds_ref)(*args)


@block_bounds.register_fake
def _(block_hi, *args):
    return block_hi.new_empty(block_hi.shape, dtype=torch.float32), block_hi.new_empty(block_hi.shape,
                                                                                      dtype=torch.float32)


@torch.library.custom_op(f"{LIB}::draw_select", mutates_args=())
def draw_select(bound: torch.Tensor, qhi: torch.Tensor, umax: torch.Tensor, lmax: torch.Tensor, ok: torch.Tensor,
                limit: float, babs_max: float, cap: int, temp: torch.Tensor | None = None,
                min_p: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draw's candidate blocks (:func:`draw_select_ref`)."""
    args = (bound, qhi, umax, lmax, ok, limit, babs_max, cap, temp, min_p, dtype)
    return (draw_select_triton if _use_triton(bound) else draw_select_ref)(*args)


@draw_select.register_fake
def _(bound, *args):
    B = bound.shape[0]
    return (bound.new_empty((B, CAP), dtype=torch.int32), bound.new_empty(B, dtype=torch.int32),
            bound.new_empty(B), bound.new_empty(B), bound.new_empty(B), bound.new_empty(B, dtype=torch.int8))
