"""Screens: cheap, sound bounds on every logit of the vocabulary.

A screen's ``center_radius(h)`` returns a :class:`ScreenOut` for hidden states ``h [B, d]``:
a center ``y [B, V]`` (float32), a per-token radius ``r [V]``, optionally a per-token
``n [V]`` and per-row ``e [B]``, a relative term ``rel``, and whether the bound is two-sided:
``|<w_i, h_b> + b_i - y_bi| <= r_i ||h_b|| + n_i e_b + rel |y_bi|`` (one-sided: only ``<=``), in exact
real arithmetic up to a few units of relative rounding of ``y`` *before* its bias term
(:class:`~vllm_csv.head.CertifiedHead` takes every relative term of ``|y| + |b|``; a screen
that adds another per-token constant than the head's bias, as the ball's ``bmax``, says so in
``offset_abs [V]``). The runtime
(:mod:`vllm_csv.head`) widens this by the dense GEMM's own rounding error and certifies. Screens differ in cost and tightness:

========  ===========================================================  =====================
name      bound                                                        extra memory
========  ===========================================================  =====================
ball      paper's cluster bound ``<mu_c,h> + R_c ||h|| + bmax_c``      ``C (d + 3)`` fp32
          (two-sided form ``|z_i - <mu_c,h> - b_i| <= R_c ||h||`` under TP)
int8      per-row int8 copy, ``|<w_i - s_i q_i, h>| <= r_i ||h||``     ``V d`` bytes + ``8 V``
          (+ the activation's quantisation residual); backends: our
          AVX512-VNNI / AVX2 kernels, else FBGEMM, on x86 CPUs
          (:mod:`.fbgemm`), cuBLASLt on CUDA, torch elsewhere
int4      per-group int4 copy, same bound; backends: AVX512-VNNI /     ``V d / 2`` + scales
          AVX2 on x86 CPUs (:mod:`.int4`), torch elsewhere
fp16      fp16 copy, ``|<w_i - fp16(w_i), h>| <= r_i ||h||`` + GEMM     ``2 V d`` + ``8 V``
========  ===========================================================  =====================

``auto`` (the default) is the fastest sound screen measured (README, Benchmarks; benchmarks/README.md): ``int8``
everywhere it has an exact fast GEMM (on x86 CPUs our kernels or FBGEMM, cuBLASLt on CUDA), and on x86 CPUs
with AVX512-VNNI or AVX2 ``int4`` for one-row batches on heads of at least ``2^25`` weights
(``int8+int4``, :mod:`.by_batch`, which says what AVX2 measured); on a CPU where
FBGEMM refuses (op missing, another quantized engine), ``fp16``, then the ``int8`` reference.
Each fallback logs one line at start-up, with the reason.
"""

from __future__ import annotations

import logging

import torch

from dataclasses import dataclass

from ..errors import CSVError


@dataclass
class ScreenOut:
    y: torch.Tensor  # [B, V] fp32 center
    radius: torch.Tensor  # [V], coefficient of ||h_b||
    two_sided: bool
    n: torch.Tensor | None = None  # [V], coefficient of e_b (e.g. ||deq_i||)
    e: torch.Tensor | None = None  # [B], e.g. the norm of the activation quantisation residual
    rel: float = 0.0  # plus rel * |y| (e.g. a half-precision rounding of the GEMM's output)
    row_scale: torch.Tensor | None = None  # [B]: when set, the center is fl(y * row_scale[:, None])
    block_max: torch.Tensor | None = None  # [B, ceil(V / ops.build.BLOCK)]: block maxima of y, when the GEMM took them


from .ball import BallScreen  # noqa: E402
from .half import HalfScreen  # noqa: E402
from .quantized import QuantizedScreen  # noqa: E402

logger = logging.getLogger("vllm.csv_decode")

SCREENS = ("auto", "int8", "int4", "fp16", "ball")  # the one list of names: CLI, config, HeadConfig
DEFAULT_SCREEN = "auto"


def _x86_screen(kind: str, weight: torch.Tensor, bias: torch.Tensor | None):
    """The x86 kernel screen ``kind`` (``int8``: AVX512-VNNI / AVX2 / FBGEMM; ``int4``: AVX512-VNNI / AVX2), or
    None (one log line saying why) where it refuses."""
    if kind == "int8":
        from .fbgemm import FbgemmInt8Screen as cls
        missing = "no exact x86 int8 GEMM"
    else:
        from .int4 import VnniInt4Screen as cls
        missing = "no AVX512-VNNI or AVX2 int4 kernel"
    try:
        return cls(weight, bias)
    except CSVError as e:
        logger.info("CSV screen %s: %s (%s); falling back", kind, missing, e)
        return None


def make_screen(name: str, weight: torch.Tensor, bias: torch.Tensor | None, index=None, two_sided: bool = False):
    """Build the screen ``name`` for the head ``weight [V, d]`` (and ``bias``); ``auto`` is
    ``int8`` with an exact fast GEMM (VNNI, AVX2 or FBGEMM on CPU, with the ``int4`` kernel for one-row
    batches; cuBLASLt on CUDA), else ``fp16``, else the ``int8`` torch reference (module
    docstring). ``two_sided`` asks the ball for its two-sided form (every other screen is
    two-sided)."""
    if name not in SCREENS:
        raise CSVError(f"unknown screen {name!r}; choose one of {', '.join(SCREENS)}")
    on_cpu = weight.device.type == "cpu"
    if name in ("auto", "int8") and on_cpu:
        screen = _x86_screen("int8", weight, bias)
        if screen is not None:
            from . import by_batch

            if name == "auto" and weight.numel() >= by_batch.MIN_WEIGHTS:  # one-row batches on int4
                threads = torch.get_num_threads()
                if not by_batch.small_screen_pays(getattr(screen, "backend", None), threads):
                    logger.info("CSV screen auto: int8 alone (the one-row int4 screen does not pay on the %s "
                                "kernels at %d thread)", screen.backend, threads)
                    return screen
                small = _x86_screen("int4", weight, bias)
                if small is not None:
                    return by_batch.ByBatchScreen(screen, small)
            return screen
        if name == "auto":
            try:
                return HalfScreen(weight, bias)
            except CSVError as e:
                logger.info("CSV screen fp16 refused (%s); using the int8 torch reference", e)
        name = "int8"
    if name == "auto":
        name = "int8"
    if name == "int4" and on_cpu:
        screen = _x86_screen("int4", weight, bias)
        if screen is not None:
            return screen
    if name == "ball":
        if index is None:
            raise CSVError("screen 'ball' needs a CSV index (--csv-index, or let vllm-csv build one)")
        return BallScreen(index, weight, bias, two_sided=two_sided)
    if name == "fp16":
        return HalfScreen(weight, bias)
    return QuantizedScreen(weight, bias, bits=int(name[3:]))


def hidden_norm_upper(h: torch.Tensor) -> torch.Tensor:
    """``||h_b||`` in float64, rounded up to float32: an upper bound used by every screen."""
    n64 = h.double().norm(dim=1)
    n32 = n64.float()
    return torch.where(n32.double() < n64, torch.nextafter(n32, torch.tensor(torch.inf, device=h.device)), n32)
