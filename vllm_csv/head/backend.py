"""What runs the certified step, chosen once when a head is built and logged once.

Three backends, one interface (:class:`Backend`):

* ``torch``: the torch reference of every op (the ``*_ref`` of :mod:`vllm_csv.ops.rows`,
  :mod:`vllm_csv.ops.select` and :mod:`vllm_csv.ops.step`), on any device; the CPU's choice
  where the CSV CPU kernels are not built (``VLLM_CSV_CPU_KERNELS=0``, no compiler) and the one
  the mutation tests patch (``tests/conftest.py``, ``torch_reference_step``: set before the head
  is built);
* ``cpu``: the fused CPU kernels (the kernel paths, ``*_cpu``, of :mod:`vllm_csv.ops.rows`,
  :mod:`vllm_csv.ops.select` and :mod:`vllm_csv.ops.step`: the same bits as the reference,
  ``tests/test_rows.py``, ``tests/test_select.py`` and ``tests/test_step.py``; the build is not
  asked again a call);
* ``cuda``: the torch reference on the device, plus the fused Triton step where it applies
  (:mod:`vllm_csv.gpu`, built by the head on its first CUDA step) and a device synchronisation
  at the end of a step (the step's time is a host clock).

The head and its selection call ``head.backend.<op>`` and never ask which device a tensor is on.
(The CPU ops may still check a tensor's layout, e.g. contiguity, inside :mod:`vllm_csv.ops`.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..ops import build, rows as row_ops, select as select_ops, step as cpu_ops

logger = logging.getLogger("vllm.csv_decode")
_logged: set[str] = set()


class Backend:
    """The torch reference (``torch``): every op of the step as plain torch, on any device."""

    name = "torch"
    fused_gpu = False  # the fused Triton step may run (CUDA only)
    certify_plain: Callable | None = None  # a fused plain certificate (certificate.certify's plain_kernel)

    prepare_rows = staticmethod(row_ops.prepare_rows_ref)
    abs_max_rows = staticmethod(row_ops.abs_max_rows_ref)
    interval_rows = staticmethod(row_ops.interval_rows_ref)
    select_candidates = staticmethod(select_ops.select_candidates_ref)
    finish_selection = staticmethod(cpu_ops.finish_selection_ref)

    def score_fused(self, h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, coef: float, tiny32: float):
        """``(z, lower, upper)`` of a bias-free head in one kernel, or None: the head's reference
        (:func:`vllm_csv.head.bounds.score`) computes them."""
        return None

    def synchronize(self, device: torch.device) -> None:
        """Wait for the device's work (a step's time is read on the host clock)."""

    def __repr__(self) -> str:
        return f"<CSV backend {self.name}>"


class CpuKernels(Backend):
    """The fused CPU kernels (``cpu``): the ops of :mod:`vllm_csv.ops.rows`, :mod:`vllm_csv.ops.select`
    and :mod:`vllm_csv.ops.step`, built and loaded."""

    name = "cpu"
    # the kernel paths themselves (``*_cpu``): the build was checked once, by backend_for
    certify_plain = staticmethod(cpu_ops.certify_topk_cpu)
    prepare_rows = staticmethod(row_ops.prepare_rows_cpu)
    abs_max_rows = staticmethod(row_ops.abs_max_rows_cpu)
    interval_rows = staticmethod(row_ops.interval_rows_cpu)
    select_candidates = staticmethod(select_ops.select_candidates_cpu)
    finish_selection = staticmethod(cpu_ops.finish_selection_cpu)

    def score_fused(self, h, w, ids, coef, tiny32):
        if h.dtype != w.dtype:  # (a hidden state in another dtype: the reference converts it)
            return None
        *_, lower, upper, z = cpu_ops.score_intervals_cpu(h, w, ids, coef, tiny32)  # the engine's rounding included
        return z, lower, upper


class Cuda(Backend):
    """CUDA (``cuda``): the torch reference on the device, the fused Triton step, a sync a step."""

    name = "cuda"
    fused_gpu = True

    def synchronize(self, device):
        torch.cuda.synchronize(device)


def backend_for(device: torch.device) -> Backend:
    """The backend of a head whose weight is on ``device`` (builds the CPU kernels on the first
    CPU head: :func:`vllm_csv.ops.build.load_ops`); the choice is logged once per process."""
    if device.type == "cuda":
        backend = Cuda()
    elif device.type == "cpu" and build.load_ops() is not None:
        backend = CpuKernels()
    else:
        backend = Backend()
    if backend.name not in _logged:
        _logged.add(backend.name)
        logger.info("CSV certified step: backend %s", backend.name)
    return backend
