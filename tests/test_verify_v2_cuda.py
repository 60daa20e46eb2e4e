"""V2's verification arithmetic on a GPU (vllm_csv/sampling/verify_v2_bounds.py): Triton's ``tl.rand``
compiled for the device against :func:`~vllm_csv.gumbel_noise.philox_uniform` bit for bit (and the device's
op, :mod:`vllm_csv.gpu.philox`, against it on the device), and
the device's fp32 ``x_d - lse`` (the operations of V2's ``_compute_max_and_sumexp``,
``_compute_global_logsumexp`` and ``_compute_global_logprobs_and_logsumexp``, in its blocks of
8192 tokens, with the GPU's ``exp`` and ``log``) within
:func:`~vllm_csv.sampling.verify_v2_bounds.logprob_slack` of the real value, at vocabulary scale. The
interpreted test (test_verify_v2.py) runs vLLM's own functions with numpy's arithmetic; this one
the GPU's. Skipped without CUDA."""

import math

import pytest
import torch

from vllm_csv.gumbel_noise import philox_uniform
from vllm_csv.sampling import verify_v2_bounds as vv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _rand_kernel(out, seeds, pos, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = tl.load(seeds + tl.program_id(0) * 0)  # (a scalar seed per program, as V2's kernels load it)
    u = tl.rand(s, tl.load(pos + i, mask=m))
    tl.store(out + i, tl.maximum(u, 4.6566127342e-10), mask=m)


@triton.jit
def _stats_kernel(lmax, lsum, x, V, NB, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    off = b * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + r * V + off, mask=off < V, other=float("-inf")).to(tl.float32)
    mx = tl.max(v, axis=0)
    se = tl.where(mx > float("-inf"), tl.sum(tl.exp(v - mx)), 0.0)
    tl.store(lmax + r * NB + b, mx)
    tl.store(lsum + r * NB + b, se)


@triton.jit
def _logprob_kernel(out, x, drafts, lmax, lsum, V, NB, PADDED: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    blocks = tl.arange(0, PADDED)
    m = blocks < NB
    maxes = tl.load(lmax + r * NB + blocks, mask=m, other=float("-inf"))
    sums = tl.load(lsum + r * NB + blocks, mask=m, other=0.0)
    g = tl.max(maxes, axis=0)
    lse = g + tl.log(tl.sum(sums * tl.exp(maxes - g)))
    d = tl.load(drafts + r)
    tl.store(out + r, tl.load(x + r * V + d).to(tl.float32) - lse)


def test_philox_uniform_bit_for_bit_on_the_gpu():
    g = torch.Generator().manual_seed(2)
    worst = 0
    for seed in torch.randint(-2**63, 2**63 - 1, (64,), generator=g).tolist() + [0, -1, 2**32]:
        pos = torch.randint(0, 2**40, (4096,), generator=g)
        pos[:2048] = torch.arange(2048)
        out = torch.empty(4096, device="cuda")
        _rand_kernel[(4,)](out, torch.tensor([seed], device="cuda"), pos.cuda(), 4096, BLOCK=1024)
        mine = philox_uniform(torch.full((4096,), seed), pos)
        worst += int((out.cpu().view(torch.int32) != mine.view(torch.int32)).sum())
    assert worst == 0


@pytest.mark.parametrize("V", [151936, 262144])
def test_the_gpus_logprob_lies_within_the_slack(V):
    g = torch.Generator().manual_seed(V)
    M = 256
    scale = torch.logspace(-3, 2.5, M)[:, None]
    x = (torch.randn(M, V, generator=g) * scale).float()
    x[::7, ::5] = -math.inf
    x[1::7] += 3e3
    drafts = torch.randint(0, V, (M,), generator=g)
    drafts[::7] = (drafts[::7] // 5) * 5 + 1  # (finite tokens of the rows with -inf ones)
    drafts[2::7] = x[2::7].argmax(1)
    NB = triton.cdiv(V, 8192)
    xc, lmax, lsum = x.cuda(), torch.empty(M, NB, device="cuda"), torch.empty(M, NB, device="cuda")
    _stats_kernel[(M, NB)](lmax, lsum, xc, V, NB, BLOCK=8192)
    out = torch.empty(M, device="cuda")
    _logprob_kernel[(M,)](out, xc, drafts.cuda(), lmax, lsum, V, NB, PADDED=triton.next_power_of_2(NB))
    real = x.double().gather(1, drafts[:, None]).squeeze(1) - torch.logsumexp(x.double(), 1)
    big = torch.maximum(x.double().amax(1).abs(), real.abs()) + x.double().gather(1, drafts[:, None]).squeeze(1).abs()
    err = (out.cpu().double() - real).abs()
    slack = vv.logprob_slack(V, big)
    assert bool((err <= slack).all()), float((err / slack).max())
    print(f"V {V}: largest error {float(err.max()):.3e}, {float((err / slack).max()):.3f} of the slack")


def test_the_device_op_draws_v2s_bits():
    """The op (vllm_csv/gpu/philox.py, one seed per row) against the kernel above, which loads one
    seed a program as V2's kernels do, and against the torch reference run on the device."""
    from vllm_csv.gpu.philox import philox_uniform as op

    g = torch.Generator().manual_seed(7)
    for seed in torch.randint(-2**63, 2**63 - 1, (16,), generator=g).tolist() + [0, -1, 2**32]:
        pos = torch.randint(0, 2**40, (4096,), generator=g).cuda()
        seeds = torch.full((4096,), seed, device="cuda")
        out = torch.empty(4096, device="cuda")
        _rand_kernel[(4,)](out, seeds[:1], pos, 4096, BLOCK=1024)
        got = op(seeds, pos)
        assert torch.equal(got.view(torch.int32), out.view(torch.int32))
        assert torch.equal(got.view(torch.int32), philox_uniform(seeds, pos).view(torch.int32))
