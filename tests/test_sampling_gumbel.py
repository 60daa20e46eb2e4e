"""The replica of vLLM's CPU Gumbel noise picks the same token as vLLM's own kernel."""

import math

import pytest
import torch

from vllm_csv.sampling.gumbel import GUMBEL_MAX, GUMBEL_MIN, gumbel_argmax, gumbel_noise

pytest.importorskip("vllm")
import vllm._custom_ops  # noqa: E402,F401  (registers torch.ops._C.fused_gumbel_argmax)

kernel = torch.ops._C.fused_gumbel_argmax
N = 100_000  # draws per mode


def _seeds(n, gen):
    return torch.randint(0, 2**31, (n,), generator=gen, dtype=torch.long)


def _masked(gen):
    x = torch.randn(N, V, generator=gen) * 2
    x[torch.rand(N, V, generator=gen) < 0.7] = -math.inf  # masked tokens
    x[: N // 100] = -math.inf  # all-masked rows: the kernel returns 0
    return x


def _set(x, cols, value):
    x[:, cols] = value
    return x


def _near_ties(gen):
    x = torch.randn(N, V, generator=gen)
    x[:, ::2] = x[:, 1::2] + 1e-6  # near-ties of neighbours
    return x


V = 64
MODES = {  # random and adversarial rows, [N, V] fp32
    "randn": lambda g: torch.randn(N, V, generator=g) * 3,
    "wide": lambda g: torch.randn(N, V, generator=g) * 40,
    "ties": lambda g: torch.randn(N, V, generator=g).round(),  # many exact ties in the logits
    "neg_inf": _masked,
    "huge_equal": lambda g: torch.full((N, V), 3e38),  # x + g loses g in float64: the kernel compares dx
    "huge_two": lambda g: _set(torch.randn(N, V, generator=g), [5, 9], 1e30),
    "pos_inf": lambda g: _set(torch.randn(N, V, generator=g), [3, 40], math.inf),  # the first +inf wins
    "tiny": lambda g: torch.randn(N, V, generator=g) * 1e-30,
    "near_ties": _near_ties,
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_replica_matches_vllm_kernel(mode):
    gen = torch.Generator().manual_seed(0)
    x = MODES[mode](gen).contiguous()
    seeds = _seeds(x.shape[0], gen)
    assert torch.equal(gumbel_argmax(x, seeds), kernel(x, seeds))


def test_large_vocab_rows_match():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 50_000, generator=gen) * 4
    seeds = _seeds(64, gen)
    assert torch.equal(gumbel_argmax(x, seeds), kernel(x, seeds))


def test_noise_per_token_is_recomputable_and_in_range():
    gen = torch.Generator().manual_seed(2)
    seeds = _seeds(256, gen)
    full = gumbel_noise(seeds, torch.arange(1000))
    ids = torch.randint(0, 1000, (256, 17), generator=gen)
    assert torch.equal(gumbel_noise(seeds, ids), full.gather(1, ids))
    assert float(full.min()) >= GUMBEL_MIN and float(full.max()) <= GUMBEL_MAX


def test_a_wrong_noise_is_caught():
    """Broken replica (token index off by one): the comparison with the kernel fails."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(10_000, 64, generator=gen)
    seeds = _seeds(10_000, gen)
    wrong = (x.double() + gumbel_noise(seeds, torch.arange(1, 65))).argmax(1)
    assert not torch.equal(wrong, kernel(x, seeds))


def test_in_place_hash_is_splitmix64():
    """noise_bits (in place, one buffer) == the out-of-place SplitMix64 of the module docstring."""
    from vllm_csv.ops.noise import GOLDEN, _i64, _shr, splitmix64
    from vllm_csv.ops.noise import noise_bits_ref as noise_bits

    gen = torch.Generator().manual_seed(5)
    seeds = torch.cat([_seeds(30, gen), torch.tensor([0, 2**31 - 1])])
    ids = torch.arange(5000)
    want = _shr(splitmix64(splitmix64(seeds)[:, None] + (ids[None] + 1) * _i64(GOLDEN)), 11)
    assert torch.equal(noise_bits(seeds, ids), want)


def test_bits_below_skips_only_noise_below_the_threshold():
    """Every token whose bits are below bits_below(t) has noise < t (thresholds across the noise's
    range and past both ends), and the cut is tight: few tokens at or above it have noise < t."""
    from vllm_csv.ops.noise import bits_below, noise_of_bits
    from vllm_csv.ops.noise import noise_bits_ref as noise_bits

    gen = torch.Generator().manual_seed(6)
    seeds = _seeds(64, gen)
    bits = noise_bits(seeds, torch.arange(20_000))
    g = noise_of_bits(bits)
    t = torch.linspace(-6.0, 40.0, 64, dtype=torch.float64)
    t[::9] = g[::9].max(1).values  # thresholds at a token's exact noise
    b = bits_below(t)[:, None]
    assert not ((g >= t[:, None]) & (bits < b)).any()
    assert int(((bits >= b) & (g < t[:, None])).sum(1).max()) <= 2
    assert bool((bits_below(torch.tensor([-10.0, math.nan])) <= 0).all())  # nothing skipped
