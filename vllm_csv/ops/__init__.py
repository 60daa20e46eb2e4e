"""Kernels of vllm-csv, each beside its torch reference; each op states its math in its docstring.

* here: the CUDA extension ``vllm_csv._C``'s int8 screen where it was built (a torch reference
  everywhere else);
* the CPU kernels (``csrc/cpu/X.cpp``, one library ``torch.ops.vllm_csv_cpu``): built and loaded
  by :mod:`~vllm_csv.ops.build`, and wrapped one module a source (:data:`~vllm_csv.ops.build.KERNELS`):
  :mod:`~vllm_csv.ops.rows` (``rows_cpu.cpp``: the certified step's per-row passes),
  :mod:`~vllm_csv.ops.select` (``select_cpu.cpp``: its candidate search),
  :mod:`~vllm_csv.ops.step` (``csv_cpu.cpp``: its exact scores and certificate),
  :mod:`~vllm_csv.ops.int8_vnni`, :mod:`~vllm_csv.ops.int4_vnni` (the screens' GEMMs),
  :mod:`~vllm_csv.ops.noise` (``gumbel_cpu.cpp``: the draw certificate's pass and the noise's hash),
  :mod:`~vllm_csv.ops.live` (``live_cpu.cpp``: a sampled row's statistics and live columns),
  :mod:`~vllm_csv.ops.masks` (``nucleus_cpu.cpp``), :mod:`~vllm_csv.ops.topk` (``topk_cpu.cpp``),
  :mod:`~vllm_csv.ops.bools` (``bools_cpu.cpp``);
* pure torch: :mod:`~vllm_csv.ops.fbgemm` (FBGEMM's exact int8 GEMM), :mod:`~vllm_csv.ops.gather`.
"""

from __future__ import annotations

import logging

import torch

from ..fp import matmul32

logger = logging.getLogger("vllm.csv_decode")

try:
    from .. import _C  # built by setup.py from csrc/ where nvcc and CUDA torch exist
except ImportError:
    _C = None


def has_cuda_kernels() -> bool:
    return _C is not None


INT_GEMM_ALIGN = 8  # cuBLASLt int8 GEMM: inner and output dims multiples of 8, more than 16 rows


def pad_for_int_gemm(q: torch.Tensor) -> torch.Tensor:
    """``q [V, d]`` int8, zero-padded to ``[V8, d8]`` on CUDA and ``[V, d8]`` on CPU (multiples
    of 8) for :func:`int8_gemm`. Zero rows/columns add nothing to a dot product. The CPU needs
    it too: torch 2.13's CPU ``_int_mm`` returns wrong sums for an inner dimension of 1
    (``tests/test_ops.py`` checks every ``d``)."""
    V, d = q.shape
    pad_v = (-V) % INT_GEMM_ALIGN if q.is_cuda else 0
    return torch.nn.functional.pad(q, (0, (-d) % INT_GEMM_ALIGN, 0, pad_v)).contiguous()


def int8_gemm(p: torch.Tensor, q: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``acc[b, i] = sum_j p[b, j] q[i, j]`` for int8 ``p [B, d]`` and ``q`` from
    :func:`pad_for_int_gemm`, exactly, in int32 (no overflow while ``127^2 d < 2^31``);
    ``[B, vocab_size]``. cuBLASLt's int8 tensor-core GEMM on CUDA; on CPU whatever ATen has (a
    scalar loop on CPUs without VNNI)."""
    B, d = p.shape
    p = torch.nn.functional.pad(p, (0, q.shape[1] - d, 0, max(0, 17 - B) if q.is_cuda else 0))
    return torch._int_mm(p, q.t())[:B, :vocab_size]


def int8_screen_ref(h: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y[b, i] = s_i * sum_j q[i, j] h[b, j] (+ bias_i)`` in fp32 (torch reference)."""
    y = matmul32(h.float(), q.float().T) * scale.float().reshape(1, -1)
    return y if bias is None else y + bias.float()


def int8_screen(h: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same math as :func:`int8_screen_ref`; the CUDA kernel reads ``q`` once per batch."""
    if _C is not None and h.is_cuda:
        return _C.int8_screen(h, q, scale.reshape(-1), bias)
    return int8_screen_ref(h, q, scale, bias)
