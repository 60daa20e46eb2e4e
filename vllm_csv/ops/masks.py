"""vLLM's min-p mask on bounds, given each row's thresholds (``csrc/cpu/nucleus_cpu.cpp``),
beside its torch reference. The thresholds and their proof are
:func:`vllm_csv.sampling.nucleus.min_p_bounds`'s.

Why fused: the reference is two comparisons and two ``where`` over ``[R, V]``; torch's ``where``
and ``masked_fill`` on bool masks run a scalar loop on the CPU (about 0.7 ms each for 8 rows of
65536 tokens on 2 cores, where one vectorised pass takes 30 us).
"""

from __future__ import annotations

import math

import torch

from .cpu_step import load_ops, uses_kernels


def min_p_cut_ref(lo: torch.Tensor, hi: torch.Tensor, keep_at: torch.Tensor,
                  drop_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds after a per-row cut.

    Parameters
    ----------
    lo, hi : torch.Tensor
        ``[R, n]`` float32 bounds.
    keep_at, drop_at : torch.Tensor
        ``[R]`` float32 thresholds (NaN: never).

    Returns
    -------
    (new_lo, new_hi): ``[R, n]`` float32; ``new_lo = lo`` where ``lo >= keep_at`` (certainly
    kept), else ``-inf``; ``new_hi = -inf`` where ``hi < drop_at`` and ``lo > -inf`` (certainly
    dropped), else ``hi``.
    """
    new_lo = torch.where(lo >= keep_at[:, None], lo, -math.inf)
    new_hi = hi.masked_fill((hi < drop_at[:, None]) & (lo > -math.inf), -math.inf)
    return new_lo, new_hi


def min_p_cut(lo: torch.Tensor, hi: torch.Tensor, keep_at: torch.Tensor,
              drop_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as :func:`min_p_cut_ref`; one pass on the CPU where the kernel is built."""
    if uses_kernels(lo):
        return load_ops().min_p_cut(lo, hi, keep_at, drop_at)
    return min_p_cut_ref(lo, hi, keep_at, drop_at)
