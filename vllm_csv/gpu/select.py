"""Step 3 of the fused step, :func:`select_blocks` (``[B]`` programs): from the screen's per-block
bounds (:func:`~vllm_csv.gpu.screen.screen_block_max`), a lower bound ``tau`` of the row's k-th
largest dense logit (the k-th largest block's lower bound: k distinct tokens reach it) and the
candidate blocks, those whose upper bound reaches ``tau``, compacted in ascending order into a
fixed ``[B, CAP]`` list; more than ``CAP`` blocks: the row is not ``live`` (reason ``budget``).
Every other block's tokens are below ``tau``: the largest of their upper bounds is what the
certificate must beat (``outside``). Beside it: its torch reference :func:`select_blocks_ref` and
its custom op ``torch.ops.vllm_csv_gpu.select_blocks``."""

from __future__ import annotations

import math

import torch

from .common import CAP, LIB, _launch, _use_triton, tl, triton


def select_blocks_ref(umax, lmax, k, ok, limit: float, babs_max: float, cap: int):
    """``(cand [B, CAP] int32, count [B] int32, outside [B] fp32, ok [B] int8, live [B] int8)``.

    ``tau`` = the ``k``-th largest of the row's block lower bounds ``lmax`` (with multiplicity);
    ``ok`` also asks every row of the batch to be ``ok`` (:func:`vllm_csv.head.bounds.prepare`)
    and the dense accumulator not to overflow (the row's largest upper bound plus ``babs_max``
    at most ``limit``, fp32, as :func:`vllm_csv.ops.select.threshold_from` checks); candidate
    blocks are those with ``umax >= tau``, ascending, the first ``CAP`` kept (``-1`` past
    ``count``); ``live``: ``count <= cap``; ``outside``: the largest ``umax`` of the other blocks
    (``-inf`` where none), an upper bound of every token not scored. A row that is not ``ok``
    has no candidates."""
    B, nb = umax.shape
    kmax = int(k.max()) if B else 1
    top = lmax.topk(min(kmax, nb), dim=1).values
    tau = top.gather(1, (k.long() - 1).clamp(max=nb - 1)[:, None])[:, 0]
    ok = ok.bool()
    ok = ok & ok.all()
    ok = ok & ((umax.amax(1) + babs_max) <= limit)  # False on NaN
    thr = tau.masked_fill(~ok, math.nan)
    blocks = umax >= thr[:, None]
    count = blocks.sum(1).to(torch.int32)
    live = count <= cap
    pos = blocks.cumsum(1) - 1
    cand = torch.full((B, CAP), -1, dtype=torch.int32, device=umax.device)
    r, c = (blocks & (pos < CAP)).nonzero(as_tuple=True)
    cand[r, pos[r, c]] = c.to(torch.int32)
    outside = umax.masked_fill(blocks, -math.inf).amax(1)
    return cand, count, outside, ok.to(torch.int8), live.to(torch.int8)


if triton is not None:
    from .common import _pdl_wait

    @triton.jit
    def _top_ok(ok_ptr, b, B, u1, limit, babs_max, BBATCH: tl.constexpr):
        """:func:`select_blocks_ref`'s ``ok`` for row ``b`` (fp32, operation for operation): the
        row's and every row of the batch's ``ok`` (``B`` rows), and the overflow check of the
        row's largest upper bound ``u1``."""
        rows = tl.arange(0, BBATCH)
        all_ok = tl.min(tl.load(ok_ptr + rows, mask=rows < B, other=1).to(tl.int32), 0)
        ok = (tl.load(ok_ptr + b).to(tl.int32) != 0) & (all_ok != 0)
        top = u1 + babs_max
        return ok & (top <= limit)

    @triton.jit
    def _kth_largest(x, idx, k, KMAX: tl.constexpr, LOOP_MAX: tl.constexpr):
        """The ``k``-th largest of ``x`` (with multiplicity; ``k <= KMAX``): ``KMAX`` rounds of a
        reduction where ``KMAX <= LOOP_MAX``, else one sort."""
        xk = tl.max(x, 0)
        if KMAX <= LOOP_MAX:
            work = x
            for j in tl.static_range(KMAX):  # drop one maximum a round
                m, first = tl.max(work, 0, return_indices=True, return_indices_tie_break_left=True)
                xk = tl.where(j == k - 1, m, xk)
                work = tl.where(idx == first, float("-inf"), work)
        else:  # one sort (descending; duplicates kept)
            srt = tl.sort(x, 0, descending=True)
            xk = tl.sum(tl.where(idx == k - 1, srt, 0.0), 0)
        return xk

    @triton.jit
    def _select_blocks_kernel(umax_ptr, lmax_ptr, k_ptr, ok_ptr, cand_ptr, count_ptr, out_ptr, okout_ptr, live_ptr,
                              B, nb, cap, limit, babs_max, KMAX: tl.constexpr, NB: tl.constexpr,
                              BBATCH: tl.constexpr, CAPC: tl.constexpr, PDL: tl.constexpr):
        _pdl_wait(PDL)  # (common._launch: PDL launches wait for the kernel before)
        b = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, NB)
        inb = idx < nb
        u = tl.load(umax_ptr + b * nb + idx, mask=inb, other=float("-inf"))
        lo = tl.load(lmax_ptr + b * nb + idx, mask=inb, other=float("-inf"))
        k = tl.load(k_ptr + b)
        tau = _kth_largest(lo, idx, k, KMAX, 8)
        ok = _top_ok(ok_ptr, b, B, tl.max(u, 0), limit, babs_max, BBATCH)
        thr = tl.where(ok, tau, float("nan"))  # rows that cannot be certified add no candidates
        blocks = (u >= thr) & inb
        bi = tl.where(blocks, 1, 0)
        count = tl.sum(bi, 0)
        pos = tl.cumsum(bi, 0) - 1
        slots = tl.arange(0, CAPC)
        tl.store(cand_ptr + b * CAPC + slots, tl.full([CAPC], -1, tl.int32))
        tl.debug_barrier()
        tl.store(cand_ptr + b * CAPC + pos, idx.to(tl.int32), mask=blocks & (pos < CAPC))
        tl.store(count_ptr + b, count)
        tl.store(out_ptr + b, tl.max(tl.where(blocks, float("-inf"), u), 0))
        tl.store(okout_ptr + b, ok.to(tl.int8))
        tl.store(live_ptr + b, (count <= cap).to(tl.int8))


def select_blocks_triton(umax, lmax, k, ok, limit: float, babs_max: float, cap: int, kmax: int):
    B, nb = umax.shape
    dev = umax.device
    cand = torch.empty((B, CAP), dtype=torch.int32, device=dev)
    count = torch.empty(B, dtype=torch.int32, device=dev)
    outside = torch.empty(B, dtype=torch.float32, device=dev)
    okout, live = (torch.empty(B, dtype=torch.int8, device=dev) for _ in range(2))
    if B:
        _select_blocks_kernel[(B,)](umax, lmax, k, ok, cand, count, outside, okout, live, B, nb, cap, limit, babs_max,
                                    KMAX=kmax, NB=triton.next_power_of_2(nb),
                                    BBATCH=max(64, triton.next_power_of_2(B)), CAPC=CAP, **_launch())
    return cand, count, outside, okout, live


@torch.library.custom_op(f"{LIB}::select_blocks", mutates_args=())
def select_blocks(umax: torch.Tensor, lmax: torch.Tensor, k: torch.Tensor, ok: torch.Tensor, limit: float,
                  babs_max: float, cap: int, kmax: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 3 (:func:`select_blocks_ref`); ``kmax >= max(k)`` (a power of two: one compiled
    kernel per bucket)."""
    if _use_triton(umax):
        return select_blocks_triton(umax, lmax, k, ok, limit, babs_max, cap, kmax)
    return select_blocks_ref(umax, lmax, k, ok, limit, babs_max, cap)


@select_blocks.register_fake
def _(umax, lmax, k, ok, *args):
    B = umax.shape[0]
    return (umax.new_empty((B, CAP), dtype=torch.int32), umax.new_empty(B, dtype=torch.int32),
            umax.new_empty(B), umax.new_empty(B, dtype=torch.int8), umax.new_empty(B, dtype=torch.int8))
