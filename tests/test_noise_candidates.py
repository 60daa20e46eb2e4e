"""The draw certificate's fused vocabulary pass (``csrc/cpu/gumbel_cpu.cpp``) against its torch
reference (:func:`vllm_csv.ops.noise.noise_candidates_ref`): the same tokens, in the same
order, with the same bits, on vocabulary sizes of real heads and on adversarial rows (tokens
exactly on a level's edge, ``-inf`` tokens, thresholds that keep everything or nothing, forced
columns, packed token ids)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_csv.ops.build import kernels_available
from vllm_csv.ops.noise import noise_candidates, noise_candidates_ref
from vllm_csv.sampling.certificate import LEVEL, LEVELS
from vllm_csv.ops.noise import bits_below
from vllm_csv.ops.noise import noise_bits_ref as noise_bits

pytestmark = pytest.mark.skipif(not kernels_available(), reason="CPU kernels not built here (no compiler)")
K = torch.ops.vllm_csv_cpu if kernels_available() else None


def _case(R: int, n: int, seed: int, packed: bool):
    g = torch.Generator().manual_seed(seed)
    hi = torch.randn(R, n, generator=g) * 4
    hi[:, ::5] = -math.inf
    hmax = hi.amax(1)
    # tokens exactly on level edges (hmax - k LEVEL) and one ulp either side
    edge = hmax[:, None] - LEVEL * torch.randint(0, LEVELS + 4, (R, n), generator=g).float()
    pick = torch.rand(R, n, generator=g) < 0.2
    hi = torch.where(pick, edge, hi)
    nudge = torch.rand(R, n, generator=g)  # one ulp either side of an edge (fp32 arithmetic would round it back)
    hi = torch.where(nudge < 0.1, torch.nextafter(hi, torch.full_like(hi, -math.inf)), hi)
    hi = torch.where((nudge > 0.9) & (hi < hmax[:, None]), torch.nextafter(hi, torch.full_like(hi, math.inf)), hi)
    hi[:, 0] = hmax  # the maximum stays the maximum
    seeds = torch.randint(0, 2**31, (R,), generator=g)
    ids = torch.randint(0, 300_000, (R, n), generator=g) if packed else None
    t = torch.empty(R, dtype=torch.float64).uniform_(-6, 3, generator=g)
    t[0] = -100.0  # every token kept
    if R > 1:
        t[1] = 100.0  # none (but forced ones)
    k = torch.arange(LEVELS + 1, dtype=torch.float64)
    table = bits_below(t[:, None] + (k - 0.01).clamp_min(0) * LEVEL)
    # a few thresholds equal to a token's bits: kept (>=), not skipped
    bits = noise_bits(seeds, torch.arange(n) if not packed else ids)
    gap = ((hmax.double()[:, None] - hi.double()) / LEVEL).floor().clamp(0, LEVELS)
    for r in range(1, R):  # (row 0 keeps every token)
        for j in torch.randperm(n, generator=g)[:8].tolist():
            if hi[r, j] > -math.inf:
                table[r, int(gap[r, j])] = bits[r, j]
    force = torch.stack([torch.randperm(n, generator=g)[:4] for _ in range(R)])
    force[:, -1] = -1
    return hi, seeds, hmax, table, force, ids


@pytest.mark.parametrize("n", [1, 7, 255, 256, 257, 4096, 65536, 151936])
@pytest.mark.parametrize("packed", [False, True])
def test_kernel_equals_reference(n, packed):
    R = 3 if n > 60000 else 8
    hi, seeds, hmax, table, force, ids = _case(R, n, n + packed, packed)
    force = force.clamp_max(n - 1) if n < 4 else force
    want = noise_candidates_ref(hi, seeds, hmax, table, force, ids, 1 / LEVEL)
    got = K.noise_candidates(hi, seeds, hmax, table, force, ids, 1 / LEVEL)
    for w, x in zip(want, got):
        assert torch.equal(w, x)
    rows, cols, bits = got
    tok = cols if ids is None else ids[rows, cols]
    assert torch.equal(bits, noise_bits(seeds[rows], tok[:, None])[:, 0])  # the bits of those tokens
    assert bool((rows == 0).sum() == (hi[0] > -math.inf).sum() + (hi[0][force[0][force[0] >= 0]] == -math.inf).sum())


def test_dispatch_takes_the_kernel_and_the_reference_agrees_on_empty_rows():
    hi = torch.full((2, 16), -math.inf)
    seeds, hmax = torch.tensor([1, 2]), torch.zeros(2)
    table = torch.zeros((2, LEVELS + 1), dtype=torch.long)
    force = torch.full((2, 4), -1)
    for f in (noise_candidates, noise_candidates_ref):
        rows, cols, bits = f(hi, seeds, hmax, table, force, None, 1 / LEVEL)
        assert rows.numel() == cols.numel() == bits.numel() == 0


def test_kernel_refuses_bad_shapes():
    hi = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="table"):
        K.noise_candidates(hi, torch.tensor([1, 2]), torch.zeros(2), torch.zeros(3, 5, dtype=torch.long),
                           torch.full((2, 1), -1), None, 2.0)
    with pytest.raises(RuntimeError, match="ids"):
        K.noise_candidates(hi, torch.tensor([1, 2]), torch.zeros(2), torch.zeros(2, 5, dtype=torch.long),
                           torch.full((2, 1), -1), torch.zeros(2, 7, dtype=torch.long), 2.0)


def test_noise_bits_kernel_is_the_reference():
    """The noise bits of given tokens: the kernel and the torch reference agree bit for bit
    (shared and per-row ids, extreme seeds and ids)."""
    from vllm_csv.ops.noise import noise_bits
    from vllm_csv.ops.noise import noise_bits_ref as ref

    if not kernels_available():
        pytest.skip("CPU kernels not built")
    g = torch.Generator().manual_seed(3)
    seeds = torch.cat([torch.tensor([0, 1, 2**31 - 1, -1, -(2**63), 2**63 - 1]), torch.randint(0, 2**31, (10,), generator=g)])
    ids = torch.cat([torch.tensor([0, 1, 151935, 262143, 2**40]), torch.randint(0, 300000, (59,), generator=g)])
    assert torch.equal(noise_bits(seeds, ids), ref(seeds, ids))
    per_row = torch.randint(0, 300000, (16, 33), generator=g)
    assert torch.equal(noise_bits(seeds, per_row), ref(seeds, per_row))
    assert noise_bits(seeds, ids[:0]).shape == (16, 0)


def _draw_case(R: int, n: int, seed: int, packed: bool):
    """Rows as the certificate sees them: bounds of every shape it meets (two-sided, one-sided,
    masked tokens, a row all masked but its top, tied lower bounds, duplicate packed ids so that
    two columns tie on their noisy bound too), with each row's top lower bounds."""
    from vllm_csv.ops.live import row_stats_ref
    from vllm_csv.sampling.certificate import TOP_FIRST

    g = torch.Generator().manual_seed(seed)
    lo = torch.randn(R, n, generator=g) * torch.logspace(-1, 1.5, R)[:, None]
    hi = lo + torch.rand(R, n, generator=g) * torch.logspace(-4, 0.5, R)[:, None]
    lo[:, 3::7], hi[:, 3::7] = -math.inf, -math.inf  # masked
    if R > 1:
        lo[1] = -math.inf  # one-sided: no lower bound (top values -inf: nothing forced, every token a candidate)
    if R > 2:
        lo[2, 1:], hi[2, 1:] = -math.inf, -math.inf  # one live token
    if R > 3 and n > 8:
        lo[3, :8] = lo[3].max() + 1  # tied lower bounds at the top
        hi[3, :8] = lo[3, :8] + 0.5
    if R > 4:
        lo[4], hi[4] = -math.inf, -math.inf  # nothing live
    if R > 6:  # flat rows: the noise thresholds cut through many tokens (on and between level edges)
        lo[5], hi[5] = 2.0, 2.0 + 2.0**-10
        step = LEVEL * torch.randint(0, 6, (n,), generator=g).float()
        lo[6], hi[6] = 1.0 - step, 1.0 - step + LEVEL / 4
    seeds = torch.randint(0, 2**31, (R,), generator=g)
    ids = None
    if packed:
        ids = torch.randint(0, 300_000, (R, n), generator=g).sort(1).values
        if n > 8:
            ids[:, 5] = ids[:, 4]  # a duplicate id: columns 4 and 5 share their noise
            lo[:, 5], hi[:, 5] = lo[:, 4], hi[:, 4]
    st = row_stats_ref(lo, hi, min(TOP_FIRST, n))
    delta = (st.absmax.double() + 64) * 2.0**-44
    return lo, hi, seeds, st.hmax, delta, st.top_values, st.top_indices, ids


@pytest.mark.parametrize("n", [1, 9, 300, 4096, 65536])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("direct", [False, True])
def test_draw_contenders_kernel_is_the_reference(n, packed, direct):
    """The sampled rows' certificate pass: the kernel lists the same contenders as the torch
    reference, with the same winners, counts and best noisy lower bounds (up to the ulps by which
    ``std::log`` may differ from torch's; none did on these rows)."""
    from vllm_csv.ops.noise import draw_contenders, draw_contenders_ref

    if direct and n > 4096:
        pytest.skip("direct rows are short")
    lo, hi, seeds, hmax, delta, top_v, top_i, ids = _draw_case(8, n, 7 * n + 2 * packed + direct, packed)
    want = draw_contenders_ref(lo, hi, seeds, hmax, delta, top_v, top_i, ids, direct, LEVEL, LEVELS)
    got = draw_contenders(lo, hi, seeds, hmax, delta, top_v, top_i, ids, direct, LEVEL, LEVELS)
    for name in ("winner", "count", "rows", "cols"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.allclose(got.best, want.best, rtol=2.0**-50, atol=0)
    assert bool(torch.isneginf(got.best[4])) and int(got.winner[4]) == n and int(got.count[4]) == 0  # nothing live
    if packed and n > 8:  # the tie between columns 4 and 5 (same id, same bounds) goes to column 4
        assert bool((got.winner != 5).all())
    # every contender is one the full reference scan of all tokens would list
    from vllm_csv.sampling.gumbel import gumbel_noise

    tok = torch.arange(n).expand(8, n) if ids is None else ids
    gn = gumbel_noise(seeds, tok)
    nlo, nhi = lo.double() + gn, hi.double() + gn
    best = nlo.amax(1)
    assert torch.allclose(got.best[best > -math.inf], best[best > -math.inf], rtol=2.0**-50, atol=0)
    full = (hi > -math.inf) & (nhi >= (got.best - 2 * delta)[:, None])  # (masked tokens never listed)
    listed = torch.zeros(8, n, dtype=torch.bool)
    listed[got.rows, got.cols] = True
    assert torch.equal(listed, full)


def test_draw_contenders_refuses_bad_shapes():
    lo = torch.zeros(2, 8)
    args = (torch.tensor([1, 2]), torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2, 1),
            torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="lo, hi"):
        K.draw_contenders(lo, torch.zeros(2, 7), *args, None, False, LEVEL, LEVELS)
    with pytest.raises(RuntimeError, match="ids"):
        K.draw_contenders(lo, lo, *args, torch.zeros(2, 7, dtype=torch.long), False, LEVEL, LEVELS)
    with pytest.raises(RuntimeError, match="top_v"):
        K.draw_contenders(lo, lo, *args[:3], torch.zeros(3, 1), torch.zeros(3, 1, dtype=torch.long), None, False,
                          LEVEL, LEVELS)
