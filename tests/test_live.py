"""A sampled row's fused statistics and live columns (``csrc/cpu/live_cpu.cpp``) against their
torch references (:mod:`vllm_csv.ops.live`): maxima, magnitudes, live counts and top lower bounds
on adversarial rows (masked tokens, ties, NaN and infinite bounds), and each row's live columns
packed, on lengths off the vector width."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_csv.ops.build import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="CPU kernels not built here (no compiler)")


def _stats_inputs():
    g = torch.Generator().manual_seed(9)
    R, n = 12, 5000
    lo = torch.randn(R, n, generator=g) * torch.logspace(-3, 4, R)[:, None]
    hi = lo + torch.rand(R, n, generator=g)
    lo[0, 100:4000], hi[0, 100:4000] = -math.inf, -math.inf  # masked tokens
    lo[1] = -math.inf  # one-sided: no lower bounds
    lo[2, ::7] = lo[2].max()  # ties at the top
    lo[3, :] = 1.5  # the whole row tied
    hi[3, :] = 2.0
    lo[4, 10], hi[4, 10] = math.nan, math.nan  # NaN row
    hi[5, 77] = math.inf  # +inf upper bound
    lo[6, :4997], hi[6, :4997] = -math.inf, -math.inf  # fewer live tokens than k
    lo[7], hi[7] = -lo[7].abs() - 1, -lo[7].abs() - 0.5  # all negative: absmax from the minima
    return lo, hi


@pytest.mark.parametrize("k", [1, 4, 16])
def test_row_stats_kernel_is_the_reference(k):
    """The fused row statistics equal the torch reference: maxima (NaN rows included), absmax
    (rows without NaN or +inf), live counts, and the top k lower bounds (values; indices hold
    those values, ties to the lowest index)."""
    from vllm_csv.ops.live import row_stats, row_stats_ref

    if not kernels_available():
        pytest.skip("CPU kernels not built")
    lo, hi = _stats_inputs()
    got, want = row_stats(lo, hi, k), row_stats_ref(lo, hi, k)
    for name in ("lmax", "hmax", "live"):
        assert torch.equal(getattr(got, name), getattr(want, name)) or \
            torch.allclose(getattr(got, name), getattr(want, name), rtol=0, atol=0, equal_nan=True), name
    clean = ~(torch.isnan(lo).any(1) | torch.isnan(hi).any(1) | (hi == math.inf).any(1))
    assert torch.equal(got.absmax[clean], want.absmax[clean])
    ok = ~torch.isnan(lo).any(1)
    assert torch.equal(got.top_values[ok], want.top_values[ok])
    held = lo.gather(1, got.top_indices)
    fin = got.top_values > -math.inf
    assert torch.equal(held[fin & ok[:, None]], got.top_values[fin & ok[:, None]])
    assert got.top_indices[3].tolist() == list(range(k))  # all tied: the lowest indices, in order
    assert got.top_indices[2].tolist() == [7 * j for j in range(k)]  # tied maxima: the same


@pytest.mark.parametrize("V", [1, 7, 16, 33, 65536 + 5])
def test_pack_live_kernel_is_the_reference(V):
    """Each row's live columns, packed: the kernel equals the reference (NaN lower bounds and NaN
    upper bounds live, +inf live, -inf dead, rows all dead or all live, lengths off the vector
    width), and both refuse an n below a row's live count."""
    from vllm_csv.ops.live import pack_live, pack_live_ref

    g = torch.Generator().manual_seed(V)
    R = 6
    hi = torch.randn(R, V, generator=g)
    hi[torch.rand(R, V, generator=g) < 0.9] = -math.inf
    lo = hi - 1
    hi[0] = -math.inf  # all dead
    hi[1] = 1.0  # all live
    lo[1] = 0.0
    lo[2, ::3] = math.nan  # NaN lower bound under a -inf upper one: live
    hi[3, ::5] = math.nan
    hi[4, ::4] = math.inf
    n = int(((hi != -math.inf) | torch.isnan(lo)).sum(1).max())
    for m in (n, n + 3):
        want = pack_live_ref(lo, hi, m)
        assert torch.equal(pack_live(lo, hi, m), want)
        assert want.shape == (R, m) and bool((want[0] == V).all()) and want[1, :V].tolist() == list(range(V))
    for f in (pack_live, pack_live_ref):
        with pytest.raises(RuntimeError, match="more than n"):
            f(lo, hi, n - 1)
