"""Step 3 of the fused step, :func:`select_blocks` (``[B]`` programs): the threshold of
:func:`vllm_csv.ops.select.select_candidates_ref` from the block maxima (``y_1``, the k-th largest
``y_k``, ``tau``, ``thr``) and the candidate blocks (maximum ``>= thr``), compacted in ascending
order into a fixed ``[B, CAP]`` list; more than ``CAP`` blocks: the row is not ``live`` (reason
``budget``). Beside it: its torch reference :func:`select_blocks_ref` and its custom op
``torch.ops.vllm_csv_gpu.select_blocks``."""

from __future__ import annotations

import torch

from ..ops.select import threshold_from
from .common import CAP, LIB, _launch, _use_triton, tl, triton


def select_blocks_ref(bmax, k, hnorm, e, ok, consts, cap: int):
    """``(cand [B, CAP] int32, count [B] int32, tau [B] fp32, ok [B] int8, live [B] int8)``.

    The threshold of :func:`vllm_csv.ops.select.threshold_from` from ``y_1`` (largest block
    maximum) and ``y_k`` (``k``-th largest, with multiplicity: ``k`` distinct tokens reach it);
    ``ok`` also asks every row of the batch to be ``ok`` (:func:`vllm_csv.head.bounds.prepare`);
    candidate blocks are those with maximum ``>= thr``, ascending, the first ``CAP`` kept
    (``-1`` past ``count``); ``live``: ``count <= cap``. ``consts`` =
    ``(rad_max, act_coef, tiny, bslack_max, delta, limit, babs_max)``."""
    B, nb = bmax.shape
    kmax = int(k.max()) if B else 1
    top = bmax.topk(min(kmax, nb), dim=1).values
    y1, yk = top[:, 0], top.gather(1, (k.long() - 1).clamp(max=nb - 1)[:, None])[:, 0]
    ok = ok.bool()
    ok = ok & ok.all()
    tau, thr, ok = threshold_from(y1, yk, hnorm, e, ok, *consts)
    blocks = bmax >= thr[:, None]
    count = blocks.sum(1).to(torch.int32)
    live = count <= cap
    pos = blocks.cumsum(1) - 1
    cand = torch.full((B, CAP), -1, dtype=torch.int32, device=bmax.device)
    r, c = (blocks & (pos < CAP)).nonzero(as_tuple=True)
    cand[r, pos[r, c]] = c.to(torch.int32)
    return cand, count, tau, ok.to(torch.int8), live.to(torch.int8)


if triton is not None:
    @triton.jit
    def _overflow_ok(ok_ptr, b, B, y1, hn, ee, rad_max, act_coef, tiny, bslack_max, delta, limit, babs_max,
                     BBATCH: tl.constexpr):
        """:func:`~vllm_csv.ops.select.threshold_from`'s ``ok`` for row ``b`` (fp32, operation for
        operation), and its ``spread``: the row's and every row of the batch's ``ok`` (``B`` rows),
        and the overflow check of the row's largest block maximum ``y1``."""
        rows = tl.arange(0, BBATCH)
        all_ok = tl.min(tl.load(ok_ptr + rows, mask=rows < B, other=1).to(tl.int32), 0)
        ok = (tl.load(ok_ptr + b).to(tl.int32) != 0) & (all_ok != 0)
        spread = rad_max * hn + act_coef * ee
        spread = spread + tiny
        spread = spread + bslack_max
        top = y1 + delta * tl.abs(y1)
        top = top + spread
        top = top + babs_max
        return ok & (top <= limit), spread

    @triton.jit
    def _select_blocks_kernel(bmax_ptr, k_ptr, hn_ptr, e_ptr, ok_ptr, cand_ptr, count_ptr, tau_ptr,
                              okout_ptr, live_ptr, B, nb, cap, rad_max, act_coef, tiny, bslack_max,
                              delta, limit, babs_max, dplus, dminus, KMAX: tl.constexpr, NB: tl.constexpr,
                              BBATCH: tl.constexpr, CAPC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, NB)
        x = tl.load(bmax_ptr + b * nb + idx, mask=idx < nb, other=float("-inf"))
        k = tl.load(k_ptr + b)
        y1 = tl.max(x, 0)
        yk = y1
        if KMAX <= 8:
            work = x
            for j in tl.static_range(KMAX):  # k-th largest, with multiplicity: drop one maximum a round
                m = tl.max(work, 0)
                yk = tl.where(j == k - 1, m, yk)
                first = tl.argmax(work, 0)
                work = tl.where(idx == first, float("-inf"), work)
        else:  # one sort of the row's block maxima (descending; duplicates kept)
            srt = tl.sort(x, 0, descending=True)
            yk = tl.sum(tl.where(idx == k - 1, srt, 0.0), 0)
        # threshold_from, operation for operation (fp32)
        ok, spread = _overflow_ok(ok_ptr, b, B, y1, tl.load(hn_ptr + b), tl.load(e_ptr + b), rad_max, act_coef, tiny,
                                  bslack_max, delta, limit, babs_max, BBATCH)
        tau = yk - delta * tl.abs(yk)
        tau = tau - spread
        s = tau - spread
        thr = tl.where(s >= 0, tl.div_rn(s, dplus), tl.div_rn(s, dminus))  # 1 +- delta, as torch rounds them
        thr = thr - tl.abs(thr) * (8 * 2.0**-24)
        thr = thr - tiny
        thr = tl.where(ok, thr, float("nan"))  # rows that cannot be certified add no candidates
        blocks = (x >= thr) & (idx < nb)
        bi = tl.where(blocks, 1, 0)
        count = tl.sum(bi, 0)
        pos = tl.cumsum(bi, 0) - 1
        slots = tl.arange(0, CAPC)
        tl.store(cand_ptr + b * CAPC + slots, tl.full([CAPC], -1, tl.int32))
        tl.debug_barrier()
        tl.store(cand_ptr + b * CAPC + pos, idx.to(tl.int32), mask=blocks & (pos < CAPC))
        tl.store(count_ptr + b, count)
        tl.store(tau_ptr + b, tau)
        tl.store(okout_ptr + b, ok.to(tl.int8))
        tl.store(live_ptr + b, (count <= cap).to(tl.int8))


def select_blocks_triton(bmax, k, hnorm, e, ok, consts, cap: int, kmax: int):
    B, nb = bmax.shape
    dev = bmax.device
    cand = torch.empty((B, CAP), dtype=torch.int32, device=dev)
    count = torch.empty(B, dtype=torch.int32, device=dev)
    tau = torch.empty(B, dtype=torch.float32, device=dev)
    okout, live = (torch.empty(B, dtype=torch.int8, device=dev) for _ in range(2))
    if B:
        _select_blocks_kernel[(B,)](bmax, k, hnorm, e, ok, cand, count, tau, okout, live,
                                    B, nb, cap, *consts, 1 + consts[4], 1 - consts[4], KMAX=kmax, NB=triton.next_power_of_2(nb),
                                    BBATCH=max(64, triton.next_power_of_2(B)), CAPC=CAP, **_launch())
    return cand, count, tau, okout, live


@torch.library.custom_op(f"{LIB}::select_blocks", mutates_args=())
def select_blocks(bmax: torch.Tensor, k: torch.Tensor, hnorm: torch.Tensor, e: torch.Tensor, ok: torch.Tensor,
                  rad_max: float, act_coef: float, tiny: float, bslack_max: float, delta: float, limit: float,
                  babs_max: float, cap: int, kmax: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 3 (:func:`select_blocks_ref`); ``kmax >= max(k)`` (a power of two: one compiled
    kernel per bucket)."""
    consts = (rad_max, act_coef, tiny, bslack_max, delta, limit, babs_max)
    if _use_triton(bmax):
        return select_blocks_triton(bmax, k, hnorm, e, ok, consts, cap, kmax)
    return select_blocks_ref(bmax, k, hnorm, e, ok, consts, cap)


@select_blocks.register_fake
def _(bmax, k, hnorm, e, ok, *args):
    B = bmax.shape[0]
    return (bmax.new_empty((B, CAP), dtype=torch.int32), bmax.new_empty(B, dtype=torch.int32),
            bmax.new_empty(B), bmax.new_empty(B, dtype=torch.int8), bmax.new_empty(B, dtype=torch.int8))
