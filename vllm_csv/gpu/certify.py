"""Step 5 of the fused step, :func:`certify_rows` (``[B]`` programs): the top-k certificate of
:func:`vllm_csv.ops.step.certify_topk_ref` per row against ``outside_high = tau`` (the step's
``outside``: an upper bound of every token not scored, :func:`~.select.select_blocks`) and, for
``k = 1`` rows, the replayed tie (lowest id holding a value known bit for bit). Writes the top-k
ids (descending, ties by the lowest id), their values and the row's outcome code
(:data:`vllm_csv.ops.step.REASONS`). Beside it: its torch reference :func:`certify_rows_ref` and
its custom op ``torch.ops.vllm_csv_gpu.certify_rows``."""

from __future__ import annotations

import math

import torch

from ..ops.step import single_valued
from .common import CAP, LIB, SUB, _launch, _pick, _tl_dtype, slot_ids, tl, triton


def certify_rows_ref(z, lower, upper, cand, count, k, need, tau, ok, live, V: int, kmax: int, dtype: torch.dtype):
    """``(ids [B, kmax] int64, vals [B, kmax] fp32, code [B] int32)``.

    ``T`` = the ``k`` scored slots of largest ``z`` (ties: the lowest id first). Certified (code
    0) when ``ok``, ``live``, and the smallest ``lower`` in ``T`` beats strictly
    ``fl_dtype(max(U, tau))`` (``U`` the largest ``upper`` of the other scored tokens) and is
    finite, and where ``need`` (``[B]`` bool: the row's values are read) every value in ``T`` is
    known bit for bit; a ``k = 1`` row that
    fails is certified on a replayed tie (:func:`vllm_csv.head.certificate.certify`). Codes
    1/2/3: not ``ok`` / not ``live`` / not certified. ``ids`` past ``k`` repeat the first id (a
    scatter then writes the same value twice)."""
    B, S = z.shape
    need, ok, live = need.bool(), ok.bool(), live.bool()
    ids = slot_ids(cand, count, V)
    zz = torch.where(ids >= 0, z, -math.inf)
    # stable order: z descending, then id ascending (slots are in ascending id order)
    order = torch.sort(zz, dim=1, descending=True, stable=True).indices[:, :kmax]
    j = torch.arange(kmax, device=z.device)[None]
    in_k = j < k[:, None]
    in_top = torch.zeros((B, S), dtype=torch.bool, device=z.device)
    in_top.scatter_(1, order, in_k)
    L = lower.masked_fill(~in_top, math.inf).amin(1)
    U = upper.masked_fill(in_top | (ids < 0), -math.inf).amax(1)
    high = torch.maximum(U, tau).to(dtype).float()
    known = single_valued(lower, upper) & (ids >= 0)
    cert = (L > high) & torch.isfinite(L)
    cert &= (known | ~in_top).all(1) | ~need
    top_ids = ids.gather(1, order)
    top_vals = zz.gather(1, order)
    # a k = 1 row: the replayed tie
    v = zz.masked_fill(~known, -math.inf).amax(1)
    tie = known & (zz == v[:, None])
    rest = upper.masked_fill(tie | (ids < 0), -math.inf).amax(1)
    by_tie = (k == 1) & ~cert & (v > torch.maximum(rest, tau).to(dtype).float()) & torch.isfinite(v)
    first = torch.where(tie, ids, torch.iinfo(torch.int64).max).amin(1)
    top_ids[:, 0] = torch.where(by_tie, first, top_ids[:, 0])
    top_vals[:, 0] = torch.where(by_tie, v, top_vals[:, 0])
    cert = (cert | by_tie) & ok & live
    top_ids = torch.where(in_k, top_ids, top_ids[:, :1]).clamp_min(0)
    top_vals = torch.where(in_k, top_vals, top_vals[:, :1])
    code = torch.where(cert, 0, torch.where(~ok, 1, torch.where(~live, 2, 3))).to(torch.int32)
    return top_ids, top_vals, code


if triton is not None:
    from .common import _pdl_wait, _rnd, _slots

    @triton.jit
    def _certify_rows_kernel(z_ptr, lo_ptr, up_ptr, cand_ptr, count_ptr, k_ptr, need_ptr, tau_ptr, ok_ptr, live_ptr,
                             ids_ptr, vals_ptr, code_ptr, V, DT: tl.constexpr, KMAX: tl.constexpr,
                             CAPC: tl.constexpr, SUBC: tl.constexpr, PDL: tl.constexpr):
        _pdl_wait(PDL)  # (common._launch: PDL launches wait for the kernel before)
        b = tl.program_id(0).to(tl.int64)
        S: tl.constexpr = CAPC * SUBC
        sl, ids, valid = _slots(cand_ptr, count_ptr, b, V, SUBC, CAPC)
        z = tl.where(valid, tl.load(z_ptr + b * S + sl), float("-inf"))
        lower = tl.where(valid, tl.load(lo_ptr + b * S + sl), float("-inf"))  # (slots past the count
        upper = tl.where(valid, tl.load(up_ptr + b * S + sl), float("-inf"))  # were never written)
        k = tl.load(k_ptr + b)
        tau = tl.load(tau_ptr + b)
        big = 9223372036854775807
        kk = tl.arange(0, KMAX)
        if KMAX <= 8:
            in_top = tl.zeros([S], dtype=tl.int1)
            work = z
            out_ids = tl.zeros([KMAX], dtype=tl.int64)
            out_vals = tl.zeros([KMAX], dtype=tl.float32)
            kv = tl.zeros([S], dtype=tl.int32) + k
            for j in tl.static_range(KMAX):
                m = tl.max(work, 0)
                # the lowest id holding the maximum (slots ascend with ids; -inf slots only when
                # fewer than k tokens were scored, and such a row is not certified)
                at = tl.min(tl.where(work == m, sl, S), 0)
                at = tl.where(at < S, at, 0)
                pick = sl == at
                in_top = in_top | (pick & (kv > j))
                work = tl.where(pick, float("-inf"), work)
                idj = tl.sum(tl.where(pick, ids, 0), 0)
                out_ids = tl.where(kk == j, idj, out_ids)
                out_vals = tl.where(kk == j, m, out_vals)
        else:  # one sort: keys ordered by z, then by the lower slot (= lower id), all distinct
            zb = z.to(tl.int32, bitcast=True)
            zo = zb ^ ((zb >> 31) & 0x7FFFFFFF)  # int order = float order (-inf lowest; no NaN here)
            key = (zo.to(tl.int64) << 32) | (S - 1 - sl).to(tl.int64)
            srt = tl.sort(key, 0, descending=True)
            kth = tl.sum(tl.where(sl == k - 1, srt, 0), 0)
            in_top = key >= kth
            # the first KMAX sorted keys' slots, through the output row (scratch), then their ids
            # and values loaded back (no per-position reductions)
            slot_of = S - 1 - (srt & 0xFFFFFFFF)
            tl.store(ids_ptr + b * KMAX + sl, slot_of, mask=sl < KMAX)
            tl.debug_barrier()
            sj = tl.load(ids_ptr + b * KMAX + kk).to(tl.int32)
            out_ids = tl.load(cand_ptr + b * CAPC + sj // SUBC).to(tl.int64) * SUBC + (sj % SUBC)
            out_vals = tl.load(z_ptr + b * S + sj)
            tl.debug_barrier()
        L = tl.min(tl.where(in_top, lower, float("inf")), 0)
        U = tl.max(tl.where(in_top, float("-inf"), upper), 0)
        high = _rnd(tl.maximum(U, tau), DT)
        lb = lower.to(tl.int32, bitcast=True)
        ub = upper.to(tl.int32, bitcast=True)
        known = (lower == upper) & ((lb < 0) == (ub < 0)) & valid
        cert = (L > high) & (L < float("inf")) & (L > float("-inf"))
        unknown_in_top = tl.sum((in_top & ~known).to(tl.int32), 0)
        cert = cert & ((unknown_in_top == 0) | (tl.load(need_ptr + b) == 0))
        # (scalar conditions below go through tl.where: the interpreter makes int of bool & bool)
        # replayed tie (k = 1)
        v = tl.max(tl.where(known, z, float("-inf")), 0)
        tie = known & (z == v)
        rest = tl.max(tl.where(tie, float("-inf"), upper), 0)
        by_tie = (k == 1) & (cert == 0) & (v > _rnd(tl.maximum(rest, tau), DT)) & (v < float("inf")) \
            & (v > float("-inf"))
        first = tl.min(tl.where(tie, ids, big), 0)
        out_ids = tl.where(kk == 0, tl.where(by_tie, first, out_ids), out_ids)
        out_vals = tl.where(kk == 0, tl.where(by_tie, v, out_vals), out_vals)
        ok = tl.load(ok_ptr + b) != 0
        live = tl.load(live_ptr + b) != 0
        cert = (cert | by_tie) & ok & live
        id0 = tl.sum(tl.where(kk == 0, out_ids, 0), 0)
        v0 = tl.sum(tl.where(kk == 0, out_vals, 0.0), 0)
        out_ids = tl.maximum(tl.where(kk < k, out_ids, id0), 0)  # (an empty slot's id on a failed row: 0)
        out_vals = tl.where(kk < k, out_vals, v0)
        tl.store(ids_ptr + b * KMAX + kk, out_ids)
        tl.store(vals_ptr + b * KMAX + kk, out_vals)
        code = tl.where(cert, 0, tl.where(ok == 0, 1, tl.where(live == 0, 2, 3)))
        tl.store(code_ptr + b, code.to(tl.int32))


def certify_rows_triton(z, lower, upper, cand, count, k, need, tau, ok, live, V: int, kmax: int, dtype: torch.dtype):
    B = z.shape[0]
    dev = z.device
    ids = torch.empty((B, kmax), dtype=torch.int64, device=dev)
    vals = torch.empty((B, kmax), dtype=torch.float32, device=dev)
    code = torch.empty(B, dtype=torch.int32, device=dev)
    if B:
        _certify_rows_kernel[(B,)](z, lower, upper, cand, count, k, need, tau, ok, live,
                                   ids, vals, code, V, DT=_tl_dtype(dtype), KMAX=kmax, CAPC=CAP, SUBC=SUB,
                                   **_launch())
    return ids, vals, code


_certify_rows = _pick(certify_rows_triton, certify_rows_ref)


@torch.library.custom_op(f"{LIB}::certify_rows", mutates_args=())
def certify_rows(z: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor, cand: torch.Tensor,
                 count: torch.Tensor, k: torch.Tensor, need: torch.Tensor, tau: torch.Tensor, ok: torch.Tensor,
                 live: torch.Tensor, V: int, kmax: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 5 (:func:`certify_rows_ref`)."""
    return _certify_rows(z, lower, upper, cand, count, k, need, tau, ok, live, V, kmax, dtype)


@certify_rows.register_fake
def _(z, lower, upper, cand, count, k, need, tau, ok, live, V, kmax, dtype):
    B = z.shape[0]
    return (z.new_empty((B, kmax), dtype=torch.int64), z.new_empty((B, kmax)), z.new_empty(B, dtype=torch.int32))
