"""V2's verification uniform on the device: ``u = max(tl.rand(seed, pos), RAND_MIN)`` per row, the
number vLLM's V2 rejection sampler compares each draft's probability against
(``spec_decode/rejection_sampler_utils.py``: ``tl_rand32(seed, pos, includes_zero=False)``). One
custom op, ``torch.ops.vllm_csv_gpu.philox_uniform``: a Triton kernel calling Triton's own
``tl.rand`` as V2's kernel does (so the same Philox bits on the same Triton), beside its torch
reference :func:`~vllm_csv.gumbel_noise.philox_uniform` (the same Philox in integer ops; tests hold
the two to each other and to V2's code). No host read, fixed shapes:
:func:`vllm_csv.sampling.verify_v2_fused.verify_fused` takes the uniforms without waiting for the
seeds and positions to reach the host.
"""

from __future__ import annotations

import torch

from ..gumbel_noise import RAND_MIN
from ..gumbel_noise import philox_uniform as philox_uniform_ref
from .common import LIB, _launch, _use_triton, tl, triton

BLOCK = 256  # rows a program

if triton is not None:
    from .common import _pdl_wait

    @triton.jit
    def _philox_uniform_kernel(seed_ptr, pos_ptr, out_ptr, N, rand_min, BLOCKC: tl.constexpr, PDL: tl.constexpr):
        _pdl_wait(PDL)  # (common._launch: PDL launches wait for the kernel before)
        i = tl.program_id(0) * BLOCKC + tl.arange(0, BLOCKC)
        m = i < N
        seed = tl.load(seed_ptr + i, mask=m, other=0)
        pos = tl.load(pos_ptr + i, mask=m, other=0)
        tl.store(out_ptr + i, tl.maximum(tl.rand(seed, pos), rand_min), mask=m)


def philox_uniform_triton(seeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    N = seeds.shape[0]
    out = torch.empty(N, dtype=torch.float32, device=seeds.device)
    if N:
        _philox_uniform_kernel[(triton.cdiv(N, BLOCK),)](seeds.long().contiguous(), pos.long().contiguous(), out, N,
                                                        RAND_MIN, BLOCKC=BLOCK, **_launch())
    return out


@torch.library.custom_op(f"{LIB}::philox_uniform", mutates_args=())
def philox_uniform(seeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """V2's verification uniform of each row (module docstring).

    Parameters
    ----------
    seeds, pos : torch.Tensor
        ``[N]`` int64, each row's request seed and position, on one device.

    Returns
    -------
    torch.Tensor
        ``[N]`` float32 on that device.
    """
    return (philox_uniform_triton if _use_triton(seeds) else philox_uniform_ref)(seeds, pos)


@philox_uniform.register_fake
def _(seeds, pos):
    return seeds.new_empty(seeds.shape[0], dtype=torch.float32)
