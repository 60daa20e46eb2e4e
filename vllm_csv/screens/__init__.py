"""Screens: cheap, sound bounds on every logit of the vocabulary.

A screen's ``center_radius(h)`` returns, for hidden states ``h [B, d]``, a center
``y [B, V]`` (float32), a per-token radius ``r [V]`` and whether the bound is two-sided:
``|<w_i, h_b> + b_i - y_bi| <= r_i ||h_b||`` (one-sided: only ``<=`` ``y + r ||h||``), in
exact real arithmetic up to the relative rounding of ``y``'s last additions. The runtime
(:mod:`vllm_csv.head`) widens this by the dense GEMM's own rounding error and certifies. Screens differ in cost and tightness:

========  ===========================================================  =====================
name      bound                                                        extra memory
========  ===========================================================  =====================
ball      paper's cluster bound ``<mu_c,h> + R_c ||h|| + bmax_c``      ``C (d + 3)`` fp32
int8      per-row int8 copy, ``|<w_i - s_i q_i, h>| <= r_i ||h||``     ``V d`` bytes + ``8 V``
int4      per-group int4 copy, same bound                              ``V d / 2`` + scales
========  ===========================================================  =====================
"""

from __future__ import annotations

import torch

from ..errors import CSVError
from .ball import BallScreen
from .quantized import QuantizedScreen

SCREENS = ("int8", "int4", "ball")
DEFAULT_SCREEN = "int8"


def make_screen(name: str, weight: torch.Tensor, bias: torch.Tensor | None, index=None):
    """Build the screen ``name`` for the head ``weight [V, d]`` (and ``bias``)."""
    if name == "ball":
        if index is None:
            raise CSVError("screen 'ball' needs a CSV index (--csv-index, or let vllm-csv build one)")
        return BallScreen(index, weight, bias)
    if name in ("int8", "int4"):
        return QuantizedScreen(weight, bias, bits=int(name[3:]))
    raise CSVError(f"unknown screen {name!r}; choose one of {', '.join(SCREENS)}")


def hidden_norm_upper(h: torch.Tensor) -> torch.Tensor:
    """``||h_b||`` in float64, rounded up to float32: an upper bound used by every screen."""
    n64 = h.double().norm(dim=1)
    n32 = n64.float()
    return torch.where(n32.double() < n64, torch.nextafter(n32, torch.tensor(torch.inf, device=h.device)), n32)
