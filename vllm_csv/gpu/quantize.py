"""Step 1 of the fused step, :func:`quantize_rows` (``[B]`` programs): ``h`` -> two int8 codes
``p`` (``h ~ t p``) and ``p2`` (the residual ``h - t p ~ t2 p2``), their scales ``t, t2``, the
residual norm ``e >= ||h - t p - t2 p2||``, ``||h||`` rounded up, and which rows may be
certified; beside its torch reference :func:`quantize_rows_ref` and its custom op
``torch.ops.vllm_csv_gpu.quantize_rows``. The second code costs the screen a second int8 product
per weight tile it already holds (:mod:`.screen`) and shrinks ``e`` about a hundredfold: on heads
trained on a GPU the activation term was half of each token's widening
(``benchmarks/gpu_learned.py``)."""

from __future__ import annotations

import torch

from ..dense_engine import ACC_LIMIT, DenseEngine
from ..ops.rows import has_subnormal
from .common import LIB, _launch, _pick, _raw, tl, triton


def _slack_up(x64):
    """An fp32 upper bound of a non-negative float64 ``x`` (and of the float64 sum and sqrt it
    came from, within ``2^-40`` relative): ``fl32(x (1 + 2^-20) + 2^-148)``."""
    return x64 * (1 + 2.0**-20) + 2.0**-148


def quantize_rows_ref(h: torch.Tensor, certifiable: bool, rows_pad: int, wmax: float = 0.0, babs_max: float = 0.0):
    """``(p [2, rows_pad, d] int8, t [2, B], e [B], hnorm [B], ok [B] int8)`` for ``h [B, d]`` (flags
    are int8 0/1 throughout the step: no conversion kernels between the steps).

    ``ok``: the row is finite with no subnormal entry, the head ``certifiable``, and the dense
    accumulator cannot overflow
    (:meth:`vllm_csv.dense_engine.DenseEngine.accumulator_safe` with the head's ``wmax`` and
    ``babs_max``, the kernel repeating its expression); rows that are not ``ok`` are
    quantised as zeros (``p = 0``, ``e = hnorm = 0``) and add no candidates. First code: ``t =
    fl(max|h| * (1/127))`` (clamped to the smallest normal), ``p[0] = round(h / t)`` clamped to
    ``+-127``; the residual ``r = fl64(h - t p[0])`` (exact operands, one rounding), then the
    second code the same way from ``fl32(r)``: ``t[1]``, ``p[1]``. Any codes are sound: ``e`` is
    measured on them, an fp32 upper bound of ``||fl64(r - t[1] p[1])|| + 2^-50 ||r||`` (the two
    float64 subtractions' rounding, ``2^-53`` of ``|r|`` and of the result each) and ``hnorm``
    of ``||h||`` (float64 sums, :func:`_slack_up`). Rows past ``B`` of ``p`` are zero (the
    GEMM's padding)."""
    B, d = h.shape
    h64 = h.double()
    ok = torch.isfinite(h64).all(1) & torch.isfinite(h64.norm(dim=1).float()) & certifiable
    ok &= ~has_subnormal(h, dim=1)
    ok &= DenseEngine.accumulator_safe(_slack_up(h64.norm(dim=1)).float(), wmax, babs_max)
    hf = h.float().masked_fill(~ok[:, None], 0)
    tiny = torch.finfo(torch.float32).tiny

    def code(x):
        t = (x.abs().amax(1) * (1.0 / 127)).clamp_min(tiny)
        return t, torch.round(x / t[:, None]).clamp_(-127, 127)

    t1, p1 = code(hf)
    r = hf.double() - t1.double()[:, None] * p1.double()
    t2, p2 = code(r.float())
    f = r - t2.double()[:, None] * p2.double()
    e = _slack_up(f.norm(dim=1) + r.norm(dim=1) * 2.0**-50).float()
    hnorm = _slack_up(hf.double().norm(dim=1)).float()
    pp = torch.zeros((2, rows_pad, d), dtype=torch.int8, device=h.device)
    pp[0, :B] = p1.to(torch.int8)
    pp[1, :B] = p2.to(torch.int8)
    return pp, torch.stack([t1, t2]), e, hnorm, ok.to(torch.int8)


if triton is not None:
    from .common import _pdl_wait, _widen

    @triton.jit
    def _code_scale(amax):
        """``t = max(fl(amax * (1/127)), smallest normal)``."""
        return tl.maximum(tl.max(amax, 0) * (1.0 / 127), 1.1754943508222875e-38)

    @triton.jit
    def _code(x, t):
        """``round(x / t)`` to even, clamped to ``+-127`` (fp32 integers; ``|x / t| <= 127.5``:
        adding ``1.5 * 2^23`` leaves the integer part)."""
        r = tl.div_rn(x, t) + 12582912.0
        r = r - 12582912.0
        return tl.minimum(tl.maximum(r, -127.0), 127.0)

    @triton.jit
    def _stats(x):
        """One tile's share of the row's checks: (non-finite or subnormal entries, largest
        ``|x|``, float64 sum of squares) as per-lane partials."""
        bad = (x != x).to(tl.int32) + (tl.abs(x) == float("inf")).to(tl.int32)
        bad += ((x != 0) & (tl.abs(x) < 1.1754943508222875e-38)).to(tl.int32)  # (ops.rows.has_subnormal)
        x64 = x.to(tl.float64)
        return bad, tl.abs(x), x64 * x64

    @triton.jit
    def _residual(x, t):
        """The first code ``p1`` of a tile and its residual ``r = fl64(x - t p1)``."""
        p1 = _code(x, t)
        return p1, x.to(tl.float64) - t.to(tl.float64) * p1.to(tl.float64)

    @triton.jit
    def _second(r, t2):
        """The second code ``p2`` of a tile's residual and what is left, ``fl64(r - t2 p2)``."""
        p2 = _code(r.to(tl.float32), t2)
        return p2, r - t2.to(tl.float64) * p2.to(tl.float64)

    @triton.jit
    def _quantize_rows_kernel(h_ptr, p_ptr, t_ptr, e_ptr, hn_ptr, ok_ptr, B, d, plane, certifiable, wmax, babs_max,
                              acc_limit, BF16: tl.constexpr, BD: tl.constexpr, ONE: tl.constexpr, PDL: tl.constexpr):
        _pdl_wait(PDL)  # (common._launch: PDL launches wait for the kernel before)
        # ONE (d <= BD): the row is one tile, loaded once and kept in registers with its first
        # code; else three passes over it (checks and norm; the first code's residual; the codes)
        b = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BD)
        real = b < B  # programs past B write the zero rows of the GEMM's batch tile (loads masked off)
        dl = tl.where(real, d, 0)  # (a vector compare makes the load mask: bool, also interpreted)
        if ONE:
            x1 = _widen(tl.load(h_ptr + b * d + cols, mask=cols < dl, other=0), BF16)
            bad, amax, ss = _stats(x1)
        else:
            amax = tl.zeros([BD], dtype=tl.float32)
            ss = tl.zeros([BD], dtype=tl.float64)
            bad = tl.zeros([BD], dtype=tl.int32)
            for k0 in range(0, d, BD):
                x = _widen(tl.load(h_ptr + b * d + k0 + cols, mask=k0 + cols < dl, other=0), BF16)
                bd, am, sq = _stats(x)
                bad += bd
                amax = tl.maximum(amax, am)
                ss += sq
        n64 = tl.sqrt(tl.sum(ss, 0))
        hn = (n64 * (1 + 2.0**-20) + 2.0**-148).to(tl.float32)
        acc = hn * wmax  # DenseEngine.accumulator_safe, operation for operation
        acc = acc + babs_max
        ok = (tl.sum(bad, 0) == 0) & (n64.to(tl.float32) < float("inf")) & (certifiable != 0) & (acc <= acc_limit)
        t = tl.where(ok, _code_scale(amax), 1.1754943508222875e-38)
        if ONE:
            x1 = tl.where(ok, x1, 0.0)
            p1, r1 = _residual(x1, t)
            t2 = _code_scale(tl.abs(r1.to(tl.float32)))
            p2, f = _second(r1, t2)
            fs = f * f
            rs = r1 * r1
            m = cols < d
            tl.store(p_ptr + b * d + cols, p1.to(tl.int8), mask=m)
            tl.store(p_ptr + plane + b * d + cols, p2.to(tl.int8), mask=m)
        else:
            amax2 = tl.zeros([BD], dtype=tl.float32)
            for k0 in range(0, d, BD):  # the first code's residual: its largest entry
                x = _widen(tl.load(h_ptr + b * d + k0 + cols, mask=k0 + cols < dl, other=0), BF16)
                p1, r = _residual(tl.where(ok, x, 0.0), t)
                amax2 = tl.maximum(amax2, tl.abs(r.to(tl.float32)))
            t2 = _code_scale(amax2)
            fs = tl.zeros([BD], dtype=tl.float64)
            rs = tl.zeros([BD], dtype=tl.float64)
            for k0 in range(0, d, BD):
                m = k0 + cols < d
                x = _widen(tl.load(h_ptr + b * d + k0 + cols, mask=k0 + cols < dl, other=0), BF16)
                p1, r = _residual(tl.where(ok, x, 0.0), t)
                p2, f = _second(r, t2)
                fs += f * f
                rs += r * r
                tl.store(p_ptr + b * d + k0 + cols, p1.to(tl.int8), mask=m)
                tl.store(p_ptr + plane + b * d + k0 + cols, p2.to(tl.int8), mask=m)
        en = tl.sqrt(tl.sum(fs, 0)) + tl.sqrt(tl.sum(rs, 0)) * 8.881784197001252e-16
        e = (en * (1 + 2.0**-20) + 2.0**-148).to(tl.float32)
        tl.store(t_ptr + b, t, mask=real)
        tl.store(t_ptr + B + b, t2, mask=real)
        tl.store(e_ptr + b, tl.where(ok, e, 0.0), mask=real)
        tl.store(hn_ptr + b, tl.where(ok, hn, 0.0), mask=real)
        tl.store(ok_ptr + b, ok.to(tl.int8), mask=real)


# the widest tile a quantize program holds (entries of h): rows up to this width are loaded once
QUANTIZE_TILE = 1024


def quantize_rows_triton(h: torch.Tensor, certifiable: bool, rows_pad: int, wmax: float = 0.0,
                         babs_max: float = 0.0):
    B, d = h.shape
    h = h.contiguous()
    p = torch.empty((2, rows_pad, d), dtype=torch.int8, device=h.device)
    t = torch.empty((2, B), dtype=torch.float32, device=h.device)
    e, hn = (torch.empty(B, dtype=torch.float32, device=h.device) for _ in range(2))
    ok = torch.empty(B, dtype=torch.int8, device=h.device)
    bd = min(QUANTIZE_TILE, triton.next_power_of_2(d))
    _quantize_rows_kernel[(rows_pad,)](_raw(h), p, t, e, hn, ok, B, d, rows_pad * d, int(certifiable), wmax, babs_max,
                                       ACC_LIMIT, BF16=h.dtype == torch.bfloat16, BD=bd, ONE=d <= bd, **_launch())
    return p, t, e, hn, ok


_quantize_rows = _pick(quantize_rows_triton, quantize_rows_ref)


@torch.library.custom_op(f"{LIB}::quantize_rows", mutates_args=())
def quantize_rows(h: torch.Tensor, certifiable: bool, rows_pad: int, wmax: float, babs_max: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1 (:func:`quantize_rows_ref`)."""
    return _quantize_rows(h, certifiable, rows_pad, wmax, babs_max)


@quantize_rows.register_fake
def _(h, certifiable, rows_pad, wmax, babs_max):
    B, d = h.shape
    f = [h.new_empty(B, dtype=torch.float32) for _ in range(2)]
    return (h.new_empty((2, rows_pad, d), dtype=torch.int8), h.new_empty((2, B), dtype=torch.float32), *f,
            h.new_empty(B, dtype=torch.int8))
