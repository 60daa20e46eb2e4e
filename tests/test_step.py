"""The fused CPU kernels of the certified step's exact scores and certificate
(``csrc/cpu/csv_cpu.cpp``) against their torch references (:mod:`vllm_csv.ops.step`) and, where
the two may differ in a last bit (float64 sums in another order), against exact rational
arithmetic: the bound must hold either way. The per-row passes before them:
``tests/test_rows.py``; the candidate search: ``tests/test_select.py``."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from vllm_csv.ops import step as C
from vllm_csv.ops.build import kernels_available
from vllm_csv.testing.exact import ulps_apart

pytestmark = pytest.mark.skipif(not kernels_available(), reason="CPU kernels not built here (no compiler)")
K = torch.ops.vllm_csv_cpu if kernels_available() else None
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 64, 100, 1024])  # (100: the vector loops' tails)
def test_score_intervals_hold_every_fp32_accumulation(dtype, d):
    g = torch.Generator().manual_seed(d)
    w = (torch.randn(50, d, generator=g) * 0.05).to(dtype)
    h = torch.cat([torch.randn(3, d, generator=g) * 3, w[7:8].float() * 1e3]).to(dtype)
    ids = torch.tensor([7, 0, 49, 7, 13])
    u = 2.0**-24
    gam = (d + 2) * u / (1 - (d + 2) * u) + 4 * (d + 2) * 2.0**-53 / (1 - (d + 2) * 2.0**-53)
    a, E, lo, hi, lower, upper, z = K.score_intervals(h, w, ids, gam, 2 * 1.17549435e-38)
    ra, rE, rlo, rhi, rlower, rupper, rz = C.score_intervals_ref(h, w, ids, gam, 2 * 1.17549435e-38)
    assert torch.allclose(E, rE, rtol=1e-12, atol=0)
    # the engine's rounding of the ends, and z, from the same lo/hi: bit for bit
    assert torch.equal(lower, lo.to(dtype).float()) and torch.equal(upper, hi.to(dtype).float())
    known = C.single_valued(lower, upper)
    assert z.dtype == dtype and torch.equal(z[known], lower[known].to(dtype))
    assert torch.equal(z[~known], a[~known].float().to(dtype))
    if ulps_apart(lo, rlo) == 0 and ulps_apart(hi, rhi) == 0 and torch.equal(a, ra):
        assert torch.equal(z, rz) and torch.equal(lower, rlower) and torch.equal(upper, rupper)
    assert ulps_apart(lo, rlo) <= 1 and ulps_apart(hi, rhi) <= 1
    assert torch.allclose(a, ra, rtol=1e-12, atol=1e-300)
    hf, wf = h.float(), w[ids].float()
    orders = [hf @ wf.T]  # torch's fp32 GEMM
    seq = torch.zeros(h.shape[0], len(ids))
    rev = torch.zeros_like(seq)
    for j in range(d):
        seq = seq + hf[:, j : j + 1] * wf[:, j][None]
        rev = rev + hf[:, d - 1 - j : d - j] * wf[:, d - 1 - j][None]
    orders += [seq, rev]
    for acc in orders:
        assert bool(((lo <= acc) & (acc <= hi)).all())
    for b in range(h.shape[0]):
        for s, i in enumerate(ids.tolist()):
            exact = sum((Fraction(float(x)) * Fraction(float(v)) for x, v in
                         zip(h[b].double().tolist(), w[i].double().tolist())), Fraction(0))
            assert Fraction(float(lo[b, s])) <= exact <= Fraction(float(hi[b, s]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S", [1, 2, 7, 40])
def test_certify_topk_matches_reference(dtype, S):
    """Random and adversarial scored rows (ties, unknown values, zeros of both signs, -inf,
    NaN bounds, an outside bound at the edge): the same decision, and the same top set on
    every certified row."""
    g = torch.Generator().manual_seed(S)
    for trial in range(40):
        B = 5
        z = (torch.randn(B, S, generator=g) * 4).to(dtype)
        if trial % 4 == 1:
            z = z.float().round().to(dtype)  # ties
        zf = z.float()
        width = torch.rand(B, S, generator=g) * (0.05 if trial % 3 else 0.0)
        lower, upper = (zf - width).to(dtype).float(), (zf + width).to(dtype).float()
        if trial % 5 == 2 and S > 1:
            lower[0, 0], upper[0, 0], z[0, 0] = -0.0, 0.0, 0.0
            lower[1, 1], upper[1, 1] = math.nan, math.nan
        if trial % 7 == 3:
            lower[2], upper[2], z[2] = -math.inf, -math.inf, -math.inf
        k = torch.randint(1, S + 1, (B,), generator=g)
        oh = zf.max(1).values - torch.rand(B, generator=g) * 3
        oh[3] = zf[3].max()  # the edge: equal to the best value
        oh[4] = math.nan if trial % 6 == 0 else oh[4]
        need = torch.rand(B, generator=g) < 0.5
        ok, top = K.certify_topk(z, lower, upper, k, oh, need)
        rok, rtop = C.certify_topk_ref(z, lower, upper, k, oh, need)
        assert torch.equal(ok, rok), (trial, ok, rok)
        assert torch.equal(top[ok], rtop[ok])
        assert torch.equal(top.sum(1), k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_finish_selection_matches_reference(dtype):
    g = torch.Generator().manual_seed(9)
    for B, V, S in ((1, 10, 3), (4, 300, 17), (3, 5, 0)):
        ids = torch.randperm(V, generator=g)[:S].sort().values
        z = torch.randn(B, S, generator=g).to(dtype)
        if S:
            z[0, 0] = -0.0
        in_top = torch.rand(B, S, generator=g) < 0.5
        ok, live, cert = (torch.rand(B, generator=g) < 0.7 for _ in range(3))
        got = K.finish_selection(V, ids, z, in_top, ok, live, cert)
        want = C.finish_selection_ref(V, ids, z, in_top, ok, live, cert)
        assert got[0].dtype == dtype and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(got[0].signbit(), want[0].signbit())
