"""V2's verification uniform on the device (vllm_csv/gpu/philox.py): the op's Triton kernel (Triton's
own ``tl.rand``, one seed per row) against its torch reference (vllm_csv/gumbel_noise.py, the same
Philox in int64 ops) bit for bit, over seeds and positions at the ends of their ranges. On CUDA
compiled, in process; elsewhere under Triton's interpreter through test_gpu_kernels_interpreted.py
(in this process, without it, the op runs its reference and the comparison is the reference with
itself: skipped). The reference against vLLM's own ``tl_rand32``: test_verify_v2.py."""

from __future__ import annotations

import pytest
import torch

from vllm_csv.gpu.common import INTERPRET
from vllm_csv.gpu.philox import BLOCK, philox_uniform, philox_uniform_triton
from vllm_csv.gumbel_noise import RAND_MIN
from vllm_csv.gumbel_noise import philox_uniform as reference

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                reason="the kernel runs compiled on CUDA or under TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _hostile(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-2**63, 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    ends = [0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, -2**63, 2**63 - 1, -2**31]
    k = min(n, len(ends))
    seeds[:k] = torch.tensor(ends)[:k]
    pos = torch.randint(0, 2**20, (n,), generator=g)
    pos[: n // 4] = torch.randint(0, 2**40, (n // 4,), generator=g)  # (the counter's high word)
    far = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**40, 2**62, 2**63 - 1])
    pos[-k:] = far[-k:]
    return seeds.to(DEV), pos.to(DEV)


@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK + 3, 3000])
def test_the_kernel_draws_the_references_bits(n):
    seeds, pos = _hostile(n, n)
    got = philox_uniform(seeds, pos)
    assert got.dtype == torch.float32 and got.shape == (n,) and got.device == seeds.device
    want = reference(seeds, pos)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(philox_uniform_triton(seeds, pos).view(torch.int32), want.view(torch.int32))
    assert bool((got >= RAND_MIN).all()) and bool((got <= 1.0).all())


def test_a_draw_follows_its_own_seed_and_position():
    """Swapping one row's seed or position changes its uniform and no other row's (each program
    reads one seed per row, not the first row's)."""
    seeds, pos = _hostile(BLOCK + 7, 3)
    base = philox_uniform(seeds, pos)
    s2, p2 = seeds.clone(), pos.clone()
    s2[5] += 1
    p2[BLOCK + 2] += 1
    out = philox_uniform(s2, p2)
    changed = (out.view(torch.int32) != base.view(torch.int32)).nonzero().flatten().tolist()
    assert changed == [5, BLOCK + 2]


def test_no_rows():
    e = torch.empty(0, dtype=torch.int64, device=DEV)
    assert philox_uniform(e, e).shape == (0,)
