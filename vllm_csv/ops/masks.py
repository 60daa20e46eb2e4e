"""vLLM's min-p and top-k masks on bounds, given each row's thresholds
(``csrc/cpu/nucleus_cpu.cpp``), beside their torch references. The thresholds and their proofs
are :func:`vllm_csv.sampling.nucleus.min_p_bounds`' and :func:`~vllm_csv.sampling.nucleus.top_k_bounds`'.

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


def top_k_cut_ref(lo: torch.Tensor, hi: torch.Tensor, hk: torch.Tensor, hk1: torch.Tensor,
                  lk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds after a row's top-k decisions.

    Parameters
    ----------
    lo, hi : torch.Tensor
        ``[R, n]`` float32 bounds.
    hk, hk1, lk : torch.Tensor
        ``[R]`` float32: the ``k``-th and ``(k + 1)``-th largest upper bounds ``H_k``, ``H_(k+1)``
        and the ``k``-th largest lower bound ``L_k`` of the row.

    Returns
    -------
    (new_lo, new_hi): ``[R, n]`` float32; ``new_lo = lo`` where ``lo >= H_(k+1)`` if ``hi >= H_k``
    (the token is among the ``k`` highest upper bounds: the others' ``k``-th is ``H_(k+1)``), else
    where ``lo >= H_k`` (certainly kept), and ``-inf`` elsewhere; ``new_hi = -inf`` where
    ``hi < L_k`` (certainly dropped), else ``hi``.
    """
    new_lo = lo.masked_fill(~(lo >= torch.where(hi >= hk[:, None], hk1[:, None], hk[:, None])), -math.inf)
    new_hi = hi.masked_fill(hi < lk[:, None], -math.inf)
    return new_lo, new_hi


def top_k_cut(lo: torch.Tensor, hi: torch.Tensor, hk: torch.Tensor, hk1: torch.Tensor,
              lk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as :func:`top_k_cut_ref`; one pass on the CPU where the kernel is built (the reference's
    ``where``, comparisons and two ``masked_fill`` took about 4 ms for 8 rows of 65536 tokens on 2
    cores)."""
    if uses_kernels(lo):
        return load_ops().top_k_cut(lo, hi, hk, hk1, lk)
    return top_k_cut_ref(lo, hi, hk, hk1, lk)
