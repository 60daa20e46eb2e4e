"""The draw certificate's fused vocabulary pass (``csrc/cpu/gumbel_cpu.cpp``) against its torch
reference (:func:`vllm_csv.ops.noise.noise_candidates_ref`): the same tokens, in the same
order, with the same bits, on vocabulary sizes of real heads and on adversarial rows (tokens
exactly on a level's edge, ``-inf`` tokens, thresholds that keep everything or nothing, forced
columns, packed token ids)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_csv.ops import cpu_step
from vllm_csv.ops.noise import noise_candidates, noise_candidates_ref
from vllm_csv.sampling.certificate import LEVEL, LEVELS
from vllm_csv.sampling.gumbel import bits_below, noise_bits

pytestmark = pytest.mark.skipif(not cpu_step.kernels_available(), reason="CPU kernels not built here (no compiler)")
K = torch.ops.vllm_csv_cpu if cpu_step.kernels_available() else None


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
