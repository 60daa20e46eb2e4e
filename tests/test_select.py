"""The fused CPU kernel of the certified step's candidate search (``csrc/cpu/select_cpu.cpp``)
against its torch reference (:mod:`vllm_csv.ops.select`): the same candidates, thresholds and
row outcomes bit for bit (with the block maxima computed or handed over by the GEMM, rows with
NaN and infinities, ties, row scales, budgets, k above the block count, values packed ulp by ulp
around the threshold), and every token left out below the row's threshold."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_csv.ops import select as S
from vllm_csv.ops.build import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="CPU kernels not built here (no compiler)")
K = torch.ops.vllm_csv_cpu if kernels_available() else None


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
    given = _kernel_select(args, S.block_max(args[0]))
    for a, b in zip(got, given):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    want = S.select_candidates_ref(*args)
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


@pytest.mark.parametrize("V", [1, 255, 256, 257, 1000, 4096])
def test_left_out_columns_and_their_block_maxima(V):
    """``exclude_columns``: the columns to ``-inf`` in place, and the block maxima handed over
    (as the VNNI GEMM takes them before the columns are left out) equal to those of the new
    ``y`` bit for bit, so the kernel's search given them is its search on the new ``y``; no
    left-out column among the candidates."""
    g = torch.Generator().manual_seed(V)
    for trial in range(4):
        y = torch.randn(4, V, generator=g) * 4
        if trial == 1:
            y = y.round()  # ties, a left-out column among them
        if trial == 2 and V > 10:
            y[1, 7] = math.nan
        ids = torch.cat([y.argmax(1), torch.randint(0, V, (3,), generator=g)]).unique()
        if trial == 3:  # every column of the first block but one
            ids = torch.arange(min(V, 256))[1:] if V > 1 else ids[:0]
        bmax = S.block_max(y)
        y2 = y.clone()
        got = S.exclude_columns(y2, bmax.clone(), ids)
        want_y = y.index_fill(1, ids, -math.inf)
        assert torch.equal(y2.nan_to_num(), want_y.nan_to_num())
        want = S.block_max(want_y)
        assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())
        assert S.exclude_columns(y.clone(), None, ids) is None
        args = _select_args(y2, torch.tensor([1, min(2, V), 1, 1]), trial)
        _check_select(args)
        assert not bool(torch.isin(_kernel_select(args, got)[0], ids).any())


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
    _, tau, _, _ = S.select_candidates_ref(*args)
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
