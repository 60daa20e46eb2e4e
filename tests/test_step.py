"""The fused CPU kernels of the certified step's search, exact scores and certificate
(``csrc/cpu/csv_cpu.cpp``) against their torch references (:mod:`vllm_csv.ops.step`) and, where
the two may differ in a last bit (float64 sums in another order), against exact rational
arithmetic: the bound must hold either way. The per-row passes before them: ``tests/test_rows.py``."""

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


def _select_args(y, k, seed, rs=None, e=None, budget=64):
    B = y.shape[0]
    g = torch.Generator().manual_seed(seed)
    hnorm = torch.rand(B, generator=g) * 10
    ok = torch.ones(B, dtype=torch.bool)
    ok[-1] = B == 1 or bool(seed % 2)
    return (y, rs, k, hnorm, e, ok, 1e-3, 2.0 if e is not None else 0.0, 2 * 1.17549435e-38, 1e-6,
            2.0**-6 + 8 * 2.0**-24, 8.5e37, 0.5, budget)


def _kernel_select(args, bmax=None):
    return K.select_candidates(args[0], args[1], bmax, *args[2:])


def _check_select(args):
    """Kernel == reference, and the kernel given the block maxima (as the VNNI GEMM hands them
    over) == the kernel computing them."""
    got = _kernel_select(args)
    given = _kernel_select(args, C.block_max(args[0]))
    for a, b in zip(got, given):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    want = C.select_candidates_ref(*args)
    ids, tau, ok, live = got
    assert torch.equal(ids, want[0]), (ids, want[0])
    assert torch.equal(ok, want[2]) and torch.equal(live, want[3])
    sel = ok
    assert torch.equal(tau[sel], want[1][sel])
    return got


@pytest.mark.parametrize("V", [1, 255, 256, 257, 1000, 4096])
@pytest.mark.parametrize("B", [1, 4])
def test_select_candidates_matches_reference(V, B):
    g = torch.Generator().manual_seed(V * 10 + B)
    for trial in range(6):
        y = torch.randn(B, V, generator=g) * 4
        if V > 3:
            y[:, 3] = y.max() + 1  # a clear winner
        if trial == 1:
            y = y.round()  # ties everywhere
        if trial == 2 and V > 10:
            y[0, 5] = math.nan
        if trial == 3:
            y[-1, 0] = math.inf
        if trial == 4:
            y[:, : V // 2] = -math.inf
        for k in ([1] * B, [min(3, V)] * B, list(range(1, B + 1)) if V >= B else [1] * B):
            kt = torch.tensor(k)
            for rs in (None, torch.tensor([2.0**-3] * B), torch.tensor([2.0**j for j in range(-B, 0)])):
                for e in (None, torch.rand(B, generator=g)):
                    for budget in (64, 2, max(k)):
                        _check_select(_select_args(y, kt, trial, rs, e, budget))


def test_select_candidates_k_above_the_block_count():
    """Fewer blocks than k: both take the exact k-th value of the row."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(3, 300, generator=g)
    _check_select(_select_args(y, torch.tensor([5, 2, 4]), 1, budget=300))


def test_select_candidates_soundness_every_token_outside_is_below_tau():
    """For ok & live rows, every token outside ``ids`` has ``y + spread(1 + delta) + delta |y|
    < tau`` (its dense upper bound is below ``tau``): checked in float64 on random rows."""
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        y = torch.randn(4, 5000, generator=g) * 8
        args = _select_args(y, torch.tensor([1, 2, 5, 1]), 1, e=torch.rand(4, generator=g))
        ids, tau, ok, live = _kernel_select(args)
        _, _, _, hnorm, e, _, rad, act, tiny, bsl, delta, *_ = args
        outside = torch.ones(y.shape[1], dtype=torch.bool)
        outside[ids] = False
        for b in range(4):
            if ok[b] and live[b]:
                spread = rad * float(hnorm[b]) + act * float(e[b]) + tiny + bsl
                hi = y[b, outside].double() * (1 + delta * torch.sign(y[b, outside].double())) + spread
                assert bool((hi < float(tau[b])).all())


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


@pytest.mark.parametrize("with_scale", [False, True])
def test_select_candidates_at_the_threshold_bit_for_bit(with_scale):
    """Screen values packed ulp by ulp around the row's threshold: the kernel keeps exactly the
    reference's candidates (a threshold off by one rounding would move the cut)."""
    g = torch.Generator().manual_seed(5)
    B, V = 2, 2048
    y = torch.randn(B, V, generator=g)
    y[:, 3] = 40.0
    rs = torch.tensor([2.0**-2, 2.0**-2]) if with_scale else None
    args = list(_select_args(y, torch.ones(B, dtype=torch.long), 1, rs=rs, budget=V))
    args[5] = torch.ones(B, dtype=torch.bool)
    hnorm, delta, tiny = args[3], args[10], args[8]  # e is None: no activation term
    _, tau, _, _ = C.select_candidates_ref(*args)
    spread = args[6] * hnorm + args[8] + args[9]  # act 0 (e None): as the reference rounds it
    s = tau - spread
    thr = torch.where(s >= 0, s / (1 + delta), s / (1 - delta))
    thr = thr - thr.abs() * (8 * 2.0**-24) - tiny
    for b in range(B):
        t = float(thr[b]) / (float(rs[b]) if rs is not None else 1.0)
        v = torch.tensor(t, dtype=torch.float32)
        vals = [v]
        lo = hi = v
        for _ in range(300):
            lo, hi = torch.nextafter(lo, torch.tensor(-math.inf)), torch.nextafter(hi, torch.tensor(math.inf))
            vals += [lo, hi]
        y[b, 10 : 10 + len(vals)] = torch.stack(vals)
    ids, *_ = _check_select(tuple(args))
    assert 10 < ids.numel() < 10 + 2 * 601


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
