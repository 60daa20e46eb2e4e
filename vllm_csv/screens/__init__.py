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
int8      per-row int8 copy, ``|<w_i - s_i q_i, h>| <= r_i ||h||``     ``V d`` bytes + ``8 V``
int4      per-group int4 copy, same bound                              ``V d / 2`` + scales
fp16      fp16 copy, ``|<w_i - fp16(w_i), h>| <= r_i ||h||`` + GEMM     ``2 V d`` + ``8 V``
========  ===========================================================  =====================
"""

from __future__ import annotations

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


from .ball import BallScreen  # noqa: E402
from .half import HalfScreen  # noqa: E402
from .quantized import QuantizedScreen  # noqa: E402

SCREENS = ("auto", "int8", "int4", "fp16", "ball")
DEFAULT_SCREEN = "auto"


def make_screen(name: str, weight: torch.Tensor, bias: torch.Tensor | None, index=None):
    """Build the screen ``name`` for the head ``weight [V, d]`` (and ``bias``). ``auto`` is the
    fastest measured (README, Benchmarks): ``int8`` on CUDA, where cuBLASLt's exact int8 GEMM
    reads half the bytes of a bf16 head; ``fp16`` elsewhere (torch's CPU int8 GEMMs are scalar
    loops on CPUs without int8 dot-product instructions), ``int8`` if the head overflows fp16."""
    if name == "auto":
        if not weight.is_cuda:
            try:
                return HalfScreen(weight, bias)
            except CSVError:
                pass
        name = "int8"
    if name == "ball":
        if index is None:
            raise CSVError("screen 'ball' needs a CSV index (--csv-index, or let vllm-csv build one)")
        return BallScreen(index, weight, bias)
    if name == "fp16":
        return HalfScreen(weight, bias)
    if name in ("int8", "int4"):
        return QuantizedScreen(weight, bias, bits=int(name[3:]))
    raise CSVError(f"unknown screen {name!r}; choose one of {', '.join(SCREENS)}")


def hidden_norm_upper(h: torch.Tensor) -> torch.Tensor:
    """``||h_b||`` in float64, rounded up to float32: an upper bound used by every screen."""
    n64 = h.double().norm(dim=1)
    n32 = n64.float()
    return torch.where(n32.double() < n64, torch.nextafter(n32, torch.tensor(torch.inf, device=h.device)), n32)
