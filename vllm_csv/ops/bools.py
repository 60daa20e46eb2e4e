"""``any``, ``all`` and ``nonzero`` of bool tensors, without torch's CPU bool reductions
(:func:`any_columns`: ``any`` over some rows and columns of a mask).

On torch 2.13's CPU build ``Tensor.any`` and ``Tensor.all`` over a ``[32, 65536]`` bool tensor
take about 1 ms (2 threads, this repository's 2-core CI machine), ``amax`` / ``amin`` over the
same bytes viewed as ``uint8`` 20-40 us (measured 2026-11-26). A torch bool is one byte holding
0 or 1, so the maximum is ``any`` and the minimum ``all``. Other devices, and empty reductions
(``amax`` has no identity), use torch's own. ``tests/test_ops.py`` checks both against torch.

``nonzero`` over the same mask with about 1300 true elements takes 2.8 ms (0.2 ms with none);
:func:`flat_nonzero` takes the flat positions in ``csrc/cpu/bools_cpu.cpp`` (two passes reading
8 bytes at a time) where the CPU kernels are built (``tests/test_ops.py``: the same positions).

:func:`neg_inf_rows` counts each row's ``-inf`` (a model's suppressed tokens, checked on the
deferred rows every step: :func:`vllm_csv.vllm_plugin.fill.upstream_mask`) in one pass of the
kernel, where torch's comparison and reduction take three.
"""

from __future__ import annotations

import math

import torch

from .build import fake, uses_kernels


def _fast(x: torch.Tensor, dim: int | None) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.bool and x.numel() > 0 and (dim is None or x.shape[dim] > 0)


def any_(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``x.any(dim)`` (``x.any()`` for ``dim=None``) for a bool tensor ``x``."""
    if not _fast(x, dim):
        return x.any() if dim is None else x.any(dim)
    u = x.view(torch.uint8)
    return (u.amax() if dim is None else u.amax(dim)).bool()


def all_(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``x.all(dim)`` (``x.all()`` for ``dim=None``) for a bool tensor ``x``."""
    if not _fast(x, dim):
        return x.all() if dim is None else x.all(dim)
    u = x.view(torch.uint8)
    return (u.amin() if dim is None else u.amin(dim)).bool()


def any_columns(x: torch.Tensor, rows: torch.Tensor | None = None, span: torch.Tensor | None = None) -> torch.Tensor:
    """``[V]`` bool: the columns of ``x [R, V]`` (bool) true in some row of ``rows`` (``[R]`` bool;
    None: every row), reading only the columns ``span`` (``[n]`` int64) where given (the others
    are then taken to hold no true element). The certificate loops' contended columns."""
    if span is None:
        return any_(x if rows is None or bool(rows.all()) else x[rows], 0)
    out = torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
    sub = x[:, span]
    out[span] = any_(sub if rows is None else sub[rows], 0)
    return out


def flat_nonzero_ref(x: torch.Tensor) -> torch.Tensor:
    """``[n]`` int64: the positions of ``x``'s true elements in ``x.reshape(-1)``, ascending."""
    return x.reshape(-1).nonzero().squeeze(1)


def flat_nonzero(x: torch.Tensor) -> torch.Tensor:
    """Same as :func:`flat_nonzero_ref`; two passes of 8 bytes at a time on the CPU where the
    kernel is built."""
    if x.dtype == torch.bool and uses_kernels(x):
        return flat_nonzero_cpu(x)
    return flat_nonzero_ref(x)


def flat_nonzero_cpu(x: torch.Tensor) -> torch.Tensor:
    """:func:`flat_nonzero` on the kernels, the build not asked again (for what binds its passes
    once: :class:`vllm_csv.ops.masks.MaskOps`); a mask that is not bool takes the reference."""
    if x.dtype == torch.bool:
        return torch.ops.vllm_csv_cpu.flat_nonzero(x)
    return flat_nonzero_ref(x)


@fake("flat_nonzero")
def _(x):
    return x.new_empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.long)


def neg_inf_rows_ref(x: torch.Tensor) -> torch.Tensor:
    """``[R]`` int64: the ``-inf`` elements of each row of ``x [R, V]`` (float)."""
    return (x == -math.inf).sum(1)


def neg_inf_rows(x: torch.Tensor) -> torch.Tensor:
    """Same as :func:`neg_inf_rows_ref`; one pass on the CPU where the kernel is built."""
    if x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and uses_kernels(x):
        return torch.ops.vllm_csv_cpu.neg_inf_rows(x)
    return neg_inf_rows_ref(x)


@fake("neg_inf_rows")
def _(x):
    return x.new_empty(x.shape[0], dtype=torch.long)
