"""Kernels of vllm-csv: the CUDA extension ``vllm_csv._C`` where it was built, a torch
reference everywhere (and always on CPU). Each op states its math in the docstring."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vllm.csv_decode")

try:
    from .. import _C  # built by setup.py from csrc/ where nvcc and CUDA torch exist
except ImportError:
    _C = None


def has_cuda_kernels() -> bool:
    return _C is not None


def int8_screen_ref(h: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y[b, i] = s_i * sum_j q[i, j] h[b, j] (+ bias_i)`` in fp32 (torch reference)."""
    y = (h.float() @ q.float().T) * scale.float().reshape(1, -1)
    return y if bias is None else y + bias.float()


def int8_screen(h: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same math as :func:`int8_screen_ref`; the CUDA kernel reads ``q`` once per batch."""
    if _C is not None and h.is_cuda:
        return _C.int8_screen(h, q, scale.reshape(-1), bias)
    return int8_screen_ref(h, q, scale, bias)
