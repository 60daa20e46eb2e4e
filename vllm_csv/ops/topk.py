"""Each row's ``k`` largest values and their columns (``csrc/cpu/topk_cpu.cpp``), beside its torch
reference.

Why a kernel: ``torch.topk`` on this CPU build takes about 45 us a row of 65536 whatever ``k``
(350 us for 8 rows on 2 cores), and the sampling certificate calls it several times a step (the
tokens to score, top-k's levels, top-p's lists). The kernel reads each row once in blocks of 16 and
looks into a block only when one of its values may enter the ``k`` best kept so far.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .build import fake, uses_kernels


class TopK(NamedTuple):
    values: torch.Tensor  # [R, k], descending
    indices: torch.Tensor  # [R, k] int64


def row_topk_ref(x: torch.Tensor, k: int) -> TopK:
    """``torch.topk(x, k, dim=1)``.

    Parameters
    ----------
    x : torch.Tensor
        ``[R, n]``.
    k : int
        ``0 <= k <= n``.

    Returns
    -------
    TopK
        ``values [R, k]`` descending (NaN above every number), ``indices [R, k]`` int64 their
        columns (equal values in an unspecified order).
    """
    values, indices = x.topk(k, dim=1)
    return TopK(values, indices)


def row_topk(x: torch.Tensor, k: int) -> TopK:
    """Same as :func:`row_topk_ref` (the same values; equal values' columns ascending); one pass
    a row on the CPU where the kernel is built, for ``float32`` rows."""
    if x.dim() == 2 and x.dtype == torch.float32 and uses_kernels(x):
        return row_topk_cpu(x, k)
    return row_topk_ref(x, k)


def row_topk_cpu(x: torch.Tensor, k: int) -> TopK:
    """:func:`row_topk` on the kernels, the build not asked again (for what binds its passes once:
    :class:`vllm_csv.ops.masks.MaskOps`); rows that are not ``float32 [R, n]`` take the reference."""
    if x.dim() == 2 and x.dtype == torch.float32:
        return TopK(*torch.ops.vllm_csv_cpu.row_topk(x, k))
    return row_topk_ref(x, k)


@fake("row_topk")
def _(x, k):
    return x.new_empty(x.shape[0], k), x.new_empty(x.shape[0], k, dtype=torch.long)
