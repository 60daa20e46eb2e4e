"""Top-p's decisions on CUDA tensors (the V1 runner on a GPU): the same as on the CPU.

On CUDA :func:`vllm_csv.ops.masks.top_p_sums` runs its torch reference (chunked ``[Q, n]``
masks); on the CPU the kernel. Both feed :class:`~vllm_csv.sampling.nucleus.top_p_queries.TopPQueries`,
whose decisions must not depend on the device. Skipped without a CUDA device (no vLLM needed).
"""

import math

import pytest
import torch

from vllm_csv.ops.masks import top_p_sums, top_p_sums_ref
from vllm_csv.sampling.nucleus import top_p_queries
from vllm_csv.testing.heads import peaked_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def _rows(seed, R=24, V=4096):
    y, g = peaked_rows(seed, R, V)
    y[::6, 100:200] = -math.inf
    lo = y - torch.rand(y.shape, generator=g) * 0.2
    hi = y + torch.rand(y.shape, generator=g) * 0.2
    p = torch.rand(R, generator=g) * 0.9 + 0.05
    p[::7] = 1.0
    only = torch.isfinite(y) & (torch.rand(y.shape, generator=g) < 0.05)
    return lo, hi, p, only


def test_top_p_sums_on_cuda_are_the_cpu_sums():
    lo, hi, _, _ = _rows(1)
    c = hi.amax(1, keepdim=True).double()
    el, eh = torch.exp(lo.double() - c), torch.exp(hi.double() - c)
    g = torch.Generator().manual_seed(2)
    qrow = torch.randint(0, lo.shape[0], (300,), generator=g).sort().values
    qcol = torch.randint(0, lo.shape[1], (300,), generator=g)
    want = top_p_sums(lo, hi, el, eh, qrow, qcol)  # the CPU kernel where built
    got = top_p_sums_ref(*(t.cuda() for t in (lo, hi, el, eh, qrow, qcol))).cpu()
    assert torch.allclose(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("listed", [8, 256])
def test_top_p_queries_decide_on_cuda_as_on_cpu(listed, monkeypatch):
    """The same bounds on both devices, with a list of 8 (most asked tokens decided on their
    whole row's sums) and the default one."""
    monkeypatch.setattr(top_p_queries, "QUERY_LIST", listed)
    for seed in (3, 4):
        lo, hi, p, only = _rows(seed)
        want = top_p_queries.TopPQueries(lo, hi, p).bounds(only, only)
        got = top_p_queries.TopPQueries(lo.cuda(), hi.cuda(), p.cuda()).bounds(only.cuda(), only.cuda())
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b)
        assert torch.isfinite(want[0][only]).any() and (want[1][only] == -math.inf).any()
