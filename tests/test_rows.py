"""The fused CPU kernels of the certified step's per-row passes (``csrc/cpu/rows_cpu.cpp``) against
their torch references (:mod:`vllm_csv.ops.rows`) and, where the two may differ in a last bit
(float64 sums in another order), against exact rational arithmetic: the bound must hold either way."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from vllm_csv.ops import rows as C
from vllm_csv.ops.build import kernels_available
from vllm_csv.testing.exact import ulps_apart

pytestmark = pytest.mark.skipif(not kernels_available(), reason="CPU kernels not built here (no compiler)")
K = torch.ops.vllm_csv_cpu if kernels_available() else None
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _adversarial_rows(d: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    fmax = torch.finfo(dtype).max
    rows = [torch.randn(d, generator=g), torch.zeros(d), torch.full((d,), fmax), torch.randn(d, generator=g) * 1e-30,
            torch.full((d,), 0.5), torch.arange(d).float() * 0.25 - d / 8]  # ties at .5 after scaling
    nan = torch.randn(d, generator=g)
    nan[d // 2] = math.nan
    inf = torch.randn(d, generator=g)
    inf[0] = math.inf
    rows += [nan, inf]
    return torch.stack(rows).to(dtype)


def _hidden(B: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(B, d, generator=g) * torch.logspace(-3, 3, B)[:, None]).to(dtype)
    return torch.cat([h, _adversarial_rows(d, dtype, g)])


def _exact_sq(row: torch.Tensor) -> Fraction:
    return sum((Fraction(float(v)) ** 2 for v in row.double().tolist()), Fraction(0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 7, 256, 1024])
@pytest.mark.parametrize("certifiable", [True, False])
def test_prepare_rows_matches_reference_and_bounds_the_norm(dtype, d, certifiable):
    h = _hidden(4, d, dtype, seed=d)
    hm, hn, ok = K.prepare_rows(h, certifiable)
    rhm, rhn, rok = C.prepare_rows_ref(h, certifiable)
    assert torch.equal(ok, rok) and torch.equal(hm, rhm) and hm.dtype == h.dtype
    assert ulps_apart(hn, rhn) <= 1
    for b in range(h.shape[0]):
        if ok[b]:
            assert Fraction(float(hn[b])) ** 2 >= _exact_sq(h[b]), b  # an upper bound, exactly
        else:
            assert hn[b] == 0 and not hm[b].any()
    if d == 256 and certifiable:  # the overflowing and non-finite rows are refused
        assert not ok[-6] and not ok[-2] and not ok[-1] or dtype == torch.float16 and not ok[-2]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 5, 512, 1024])
@pytest.mark.parametrize("s_min", [2.0**-10, 2.0**-126])
def test_quantize_act7_matches_reference_and_bounds_the_residual(dtype, d, s_min):
    h = _hidden(5, d, dtype, seed=100 + d)
    for rows in (h, h[:1], h[2:3].expand(3, -1).contiguous(), h[:0]):
        x, rs, e, c = K.quantize_act7(rows, s_min, 1.0)
        rx, rrs, re, rc = C.quantize_act7_ref(rows, s_min, 1.0)
        assert torch.equal(x, rx) and torch.equal(rs, rrs) and c == rc
        assert ulps_apart(e, re) <= 1
        scale = [1.0] * rows.shape[0] if c else rs.double().tolist()
        for b in range(rows.shape[0]):
            if not torch.isfinite(rows[b].float()).all():
                continue
            cc = c or 1.0
            p = [Fraction(v) / Fraction(cc) for v in x[b, :d].double().tolist()]
            assert all(q.denominator == 1 and -64 <= q <= 63 for q in p)
            t = Fraction(cc) if c else Fraction(scale[b])
            res = sum(((Fraction(float(v)) - q * t) ** 2 for v, q in zip(rows[b].double().tolist(), p)), Fraction(0))
            assert Fraction(float(e[b])) ** 2 >= res, b


def test_abs_max_rows_is_the_reference():
    """max |y| per row: the kernel equals torch's aminmax form bit for bit, NaN, +-inf, signed
    zeros, subnormals, all-negative rows and odd lengths included."""
    g = torch.Generator().manual_seed(4)
    for V in (1, 7, 4096, 65537):
        y = torch.randn(10, V, generator=g) * torch.logspace(-40, 38, 10)[:, None]
        y[1] = -y[1].abs()  # all negative: the minimum decides
        y[2, V // 2] = math.nan
        y[3, 0] = -math.inf
        y[4, -1] = math.inf
        y[5] = -0.0
        y[6] = 1e-45  # subnormal
        got, want = C.abs_max_rows(y), C.abs_max_rows_ref(y)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        ok = ~torch.isnan(want)
        assert torch.equal(got[ok], want[ok]), V


@pytest.mark.parametrize("V", [1, 17, 4096, 65536 + 5])
@pytest.mark.parametrize("extras", ["none", "bias", "act", "both"])
@pytest.mark.parametrize("two_sided", [True, False])
def test_interval_rows_is_the_reference(V, extras, two_sided):
    """The screen's intervals in one pass: the same bits as the torch reference (lo written over
    y, hi returned), on wide and tiny centres, huge radii and norms (overflow to inf), NaN and
    +-inf centres, subnormal terms, and rows of V not a multiple of the column blocks."""
    g = torch.Generator().manual_seed(V)
    B = 9
    y = torch.randn(B, V, generator=g) * torch.logspace(-30, 30, B)[:, None]
    y[1, : min(V, 3)] = torch.tensor([math.nan, math.inf, -math.inf])[: min(V, 3)]
    y[2] = 3e38
    c = torch.rand(B, generator=g) * torch.logspace(-38, 2, B)
    rad = torch.rand(V, generator=g) * 1e-2
    rad[0] = 1e30
    hnorm = torch.rand(B, generator=g) * torch.logspace(-20, 20, B)
    hnorm[3] = 0.0
    bslack = torch.rand(V, generator=g) * 1e-3 if extras in ("bias", "both") else None
    nn = torch.rand(V, generator=g) * 0.1 if extras in ("act", "both") else None
    e = torch.rand(B, generator=g) * 1e-4 if nn is not None else None
    y_ref = y.clone()
    hi = K.interval_rows(y, c, rad, hnorm, bslack, nn, e, two_sided)
    hi_ref = C.interval_rows_ref(y_ref, c, rad, hnorm, bslack, nn, e, two_sided)
    assert torch.equal(hi.view(torch.int32), hi_ref.view(torch.int32))  # bit for bit, NaN payloads aside
    assert torch.equal(y.view(torch.int32), y_ref.view(torch.int32))
    assert C.interval_rows(y.clone(), c, rad, hnorm, bslack, nn, e, two_sided).shape == (B, V)


def test_interval_rows_refuses_bad_shapes():
    y = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="rad"):
        K.interval_rows(y, torch.zeros(2), torch.zeros(7), torch.zeros(2), None, None, None, True)
    with pytest.raises(RuntimeError, match="together"):
        K.interval_rows(y, torch.zeros(2), torch.zeros(8), torch.zeros(2), None, torch.zeros(8), None, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_outlier_rows_is_the_reference(dtype):
    """The int8 screen's outlier test (issue 45): the kernel's one pass against the reference's
    topk, on rows with one, two and eight equal outliers, just above and below the ratio, tiny,
    zero and non-finite rows, and rows too short to test."""
    g = torch.Generator().manual_seed(9)
    for d in (16, 17, 64, 768):
        h = torch.randn(12, d, generator=g)
        h[1, 3] = 40.0
        h[2, [3, 9]] = 30.0  # two equal outliers: the rest's rms is what they are measured against
        h[3, :8] = 25.0  # eight
        h[4] = torch.ones(d)
        h[4, 0] = 6.125  # just above 6 times the rest's rms (1), in every dtype
        h[5] = torch.ones(d)
        h[5, 0] = 5.875  # just below
        h[6] *= 1e-30
        h[6, 2] = 1e-28
        h[7] = 0.0
        h[8, 1] = math.nan
        h[9, 1] = math.inf
        h = h.to(dtype)
        got, want = C.outlier_rows(h, 6.0, 8), C.outlier_rows_ref(h, 6.0, 8)
        assert torch.equal(got, want), (d, got, want)
        if d > 16:
            assert got[1] and got[2] and got[3] and got[4] and not got[5] and not got[7]
            assert not got[8] and not got[9]
        else:
            assert not got.any()
