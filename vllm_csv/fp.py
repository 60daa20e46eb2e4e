"""Floating-point error terms used by every bound.

A dot product of length ``d`` accumulated in a format with unit round-off ``u``
satisfies ``|fl(<w, h>) - <w, h>| <= gamma_d * sum_j |w_j h_j| <= gamma_d * ||w|| * ||h||``
with ``gamma_d = d u / (1 - d u)`` (Higham, *Accuracy and Stability of Numerical
Algorithms*, Thm 3.4, plus Cauchy-Schwarz). Rounding a real ``x`` to a format with
``p`` significand bits moves it by at most ``ulp(x) = 2^(floor(log2|x|) - p + 1)``,
and rounding is monotone, so ``x <= y`` implies ``round(x) <= round(y)``.
"""

from __future__ import annotations

import math

import torch

FP32_UNIT_ROUNDOFF = 2.0**-24


def gamma(n: int, u: float = FP32_UNIT_ROUNDOFF) -> float:
    """``gamma_n = n u / (1 - n u)``: relative error bound of an ``n``-term accumulation."""
    nu = n * u
    if nu >= 0.5:
        raise ValueError(f"accumulation of {n} terms at unit round-off {u} has no useful bound")
    return nu / (1.0 - nu)


def significand_bits(dtype: torch.dtype) -> int:
    """Bits of precision ``p`` (implicit bit included) of a floating dtype."""
    return {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}[dtype]


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An upper bound on one unit in the last place of ``dtype`` at ``|x|``:
    ``|x| 2^(1-p) + tiny 2^(1-p)`` (``ulp(x) = 2^(e-p) <= |x| 2^(1-p)`` for ``|x| >= 2^(e-1)``,
    and the subnormal spacing ``tiny 2^(1-p)`` below the smallest normal)."""
    rel = 2.0 ** (1 - significand_bits(dtype))
    return x.abs() * rel + torch.finfo(dtype).tiny * rel


def round_up32(x64: torch.Tensor) -> torch.Tensor:
    """fp64 -> fp32, rounding up (an upper bound stays an upper bound; ``inf`` past the range)."""
    x32 = x64.float()
    return torch.where(x32.double() < x64, torch.nextafter(x32, torch.full_like(x32, math.inf)), x32)


def round_down32(x64: torch.Tensor) -> torch.Tensor:
    """fp64 -> fp32, rounding down (a lower bound stays a lower bound; ``-inf`` past the range)."""
    x32 = x64.float()
    return torch.where(x32.double() > x64, torch.nextafter(x32, torch.full_like(x32, -math.inf)), x32)
