"""Step 4 of the fused step, :func:`score_blocks` (``[B, CAP, SUB / SCORE_TOKENS]`` programs):
every token of a candidate block scored in float64 with the dense engine's interval
(:func:`vllm_csv.head.bounds.score`): the rounded ends ``lower <= zt <= upper`` and ``z``
(the dense bits where the ends agree). Beside it: its torch reference :func:`score_blocks_ref`
and its custom op ``torch.ops.vllm_csv_gpu.score_blocks``."""

from __future__ import annotations

import math

import torch

from ..fp import round_down32, round_up32
from ..ops.step import single_valued
from .common import CAP, INTERPRET, LIB, SUB, _launch, _pick, _raw, _tl_dtype, slot_ids, tl, triton


def score_blocks_ref(h, w, bias, cand, count, coef: float, gam: float, tiny32: float):
    """``(z, lower, upper)``, each ``[B, CAP * SUB]`` fp32: for slot ``c < min(count, CAP)`` and
    token ``j = cand[b, c] * SUB + i < V`` the interval of
    :func:`vllm_csv.head.bounds.score` (``coef = gamma_(d+2) + 4 gamma64_d``, ``gam =
    gamma_(d+2)`` for the bias, ``w`` and ``bias`` in the model dtype); tokens past ``V`` of a
    used slot ``-inf``. Slots past the count: ``-inf`` here, left unwritten by the kernel (never
    read: :func:`certify_rows_ref` masks them)."""
    V = w.shape[0]
    ids = slot_ids(cand, count, V)
    valid = ids >= 0
    hd, wd = h.double(), w.double()
    wj = wd[ids.clamp_min(0).long()]  # [B, S, d]
    a = torch.einsum("bsd,bd->bs", wj, hd)
    E = torch.einsum("bsd,bd->bs", wj.abs(), hd.abs()) * coef + tiny32
    E = E + a.abs() * 2.0**-52
    lo32, hi32 = round_down32(a - E), round_up32(a + E)
    rnd = lambda x: x.to(w.dtype).float()  # noqa: E731
    if bias is None:
        c = a
        lower, upper = rnd(lo32), rnd(hi32)
    else:
        bj = bias[ids.clamp_min(0).long()]
        c = a + bj.double()
        R = E + gam * bj.double().abs()
        R = R + c.abs() * 2.0**-52
        lower = torch.minimum(rnd(round_down32(c - R)), rnd(lo32.to(w.dtype) + bj))
        upper = torch.maximum(rnd(round_up32(c + R)), rnd(hi32.to(w.dtype) + bj))
    z = torch.where(single_valued(lower, upper), lower, rnd(c.float()))
    neg = torch.tensor(-math.inf, device=h.device)
    return (torch.where(valid, z, neg), torch.where(valid, lower, neg), torch.where(valid, upper, neg))


if triton is not None:
    from .common import _pdl_wait, _rnd, _widen

    @triton.jit
    def _down32(x64):
        """fp32 lower bound of float64 ``x``: round to nearest, then a step down if above."""
        x = x64.to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        down = tl.where(x > 0, bits - 1, tl.where(x < 0, bits + 1, -2147483647))
        return tl.where(x.to(tl.float64) > x64, down.to(tl.float32, bitcast=True), x)

    @triton.jit
    def _up32(x64):
        """fp32 upper bound of float64 ``x``."""
        x = x64.to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        up = tl.where(x > 0, bits + 1, tl.where(x < 0, bits - 1, 1))
        return tl.where(x.to(tl.float64) < x64, up.to(tl.float32, bitcast=True), x)

    @triton.jit
    def _score_blocks_kernel(h_ptr, w_ptr, bias_ptr, cand_ptr, count_ptr, z_ptr, lo_ptr, up_ptr, V, d,
                             coef, gam, tiny32, HAS_BIAS: tl.constexpr, DT: tl.constexpr, BF16: tl.constexpr,
                             CAPC: tl.constexpr, SUBC: tl.constexpr, TOK: tl.constexpr, BK: tl.constexpr,
                             PDL: tl.constexpr):
        _pdl_wait(PDL)  # (common._launch: PDL launches wait for the kernel before)
        # program (b, c, part): tokens part * TOK ... of the row's c-th candidate block. Many small
        # programs, each with a wide tile in flight: a candidate block is 64 rows of W, and one
        # program streaming them alone waits on memory latency (measured: ~36 us of fixed cost).
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        part = tl.program_id(2)
        n = tl.minimum(tl.load(count_ptr + b), CAPC)
        if c < n:  # slots past the row's count are never read (certify_rows masks them)
            i = part * TOK + tl.arange(0, TOK)
            out = b * (CAPC * SUBC) + c * SUBC + i
            blk = tl.load(cand_ptr + b * CAPC + c)
            ids = blk.to(tl.int64) * SUBC + i
            valid = (ids >= 0) & (ids < tl.where(blk >= 0, V, 0))  # (vector compares: bool masks)
            ks = tl.arange(0, BK)
            a = tl.zeros([TOK], dtype=tl.float64)
            A = tl.zeros([TOK], dtype=tl.float64)
            for k0 in range(0, d, BK):
                km = k0 + ks < d
                w = _widen(tl.load(w_ptr + ids[:, None] * d + (k0 + ks)[None, :],
                                   mask=valid[:, None] & km[None, :], other=0), BF16).to(tl.float64)
                x = _widen(tl.load(h_ptr + b * d + k0 + ks, mask=km, other=0), BF16).to(tl.float64)
                prod = w * x[None, :]  # exact: products of model-dtype numbers
                a += tl.sum(prod, 1)
                A += tl.sum(tl.abs(prod), 1)
            E = A * coef + tiny32
            E = E + tl.abs(a) * 2.0**-52
            lo32 = _down32(a - E)
            hi32 = _up32(a + E)
            if HAS_BIAS:
                bj = _widen(tl.load(bias_ptr + ids, mask=valid, other=0), BF16)
                cc = a + bj.to(tl.float64)
                R = E + gam * tl.abs(bj.to(tl.float64))
                R = R + tl.abs(cc) * 2.0**-52
                lower = tl.minimum(_rnd(_down32(cc - R), DT), _rnd(_rnd(lo32, DT) + bj, DT))
                upper = tl.maximum(_rnd(_up32(cc + R), DT), _rnd(_rnd(hi32, DT) + bj, DT))
            else:
                cc = a
                lower = _rnd(lo32, DT)
                upper = _rnd(hi32, DT)
            lb = lower.to(tl.int32, bitcast=True)
            ub = upper.to(tl.int32, bitcast=True)
            known = (lower == upper) & ((lb < 0) == (ub < 0))
            z = tl.where(known, lower, _rnd(cc.to(tl.float32), DT))
            tl.store(z_ptr + out, tl.where(valid, z, float("-inf")))
            tl.store(lo_ptr + out, tl.where(valid, lower, float("-inf")))
            tl.store(up_ptr + out, tl.where(valid, upper, float("-inf")))


# tokens a scoring program: SUB / 8 programs a candidate block on a GPU (H100: the step's fixed cost
# 36 -> 16 us at one row, 151936 x 1024, benchmarks/README.md); the interpreter, whose cost is per
# program, takes a block a program (the same code with a wider tile)
SCORE_TOKENS = SUB if INTERPRET else 8


def score_blocks_triton(h, w, bias, cand, count, coef: float, gam: float, tiny32: float):
    B, d = h.shape
    V = w.shape[0]
    z, lo, up = (torch.empty((B, CAP * SUB), dtype=torch.float32, device=h.device) for _ in range(3))
    if B:
        _score_blocks_kernel[(B, CAP, SUB // SCORE_TOKENS)](_raw(h.contiguous()), _raw(w), _raw(bias if bias is not None else w), cand,
                                       count, z, lo, up, V, d, coef, gam, tiny32, HAS_BIAS=bias is not None,
                                       DT=_tl_dtype(w.dtype), BF16=w.dtype == torch.bfloat16, CAPC=CAP, SUBC=SUB,
                                       TOK=SCORE_TOKENS, BK=min(512, triton.next_power_of_2(d)), **_launch())
    return z, lo, up


_score_blocks = _pick(score_blocks_triton, score_blocks_ref)


@torch.library.custom_op(f"{LIB}::score_blocks", mutates_args=())
def score_blocks(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cand: torch.Tensor,
                 count: torch.Tensor, coef: float, gam: float, tiny32: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 4 (:func:`score_blocks_ref`)."""
    return _score_blocks(h, w, bias, cand, count, coef, gam, tiny32)


@score_blocks.register_fake
def _(h, w, bias, cand, count, coef, gam, tiny32):
    return tuple(h.new_empty((h.shape[0], CAP * SUB), dtype=torch.float32) for _ in range(3))
