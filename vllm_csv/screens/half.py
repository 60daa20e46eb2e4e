"""An fp16 copy of the head: the fastest sound screen where half-precision GEMV is the
cheapest read of ``W`` (x86 CPUs without int8 dot-product instructions, where the int8
GEMMs of torch are scalar loops).

``w16_i = fp16(w_i)``, ``r_i = ||w_i - w16_i||`` and ``n_i = ||w16_i||`` (float64, rounded
up). Per row ``b``: ``t_b = 2^ceil(log2 max|h_b|)`` (a power of two: scaling is exact),
``h16_b = fp16(h_b / t_b)`` and ``f_b = h_b - t_b h16_b``. The GEMM accumulates in fp32
(oneDNN and ATen's CPU BLAS, cuBLAS) and rounds once to fp16: ``acc = <w16_i, h16_b>`` up
to ``gamma_d n_i ||h16_b||``, ``y16 = fl16(acc)`` within ``2^-11 (1 + 2^-10) |y16| + 2^-25``.
With ``y = t_b y16`` (exact):

    |<w_i, h_b> - y| <= r_i ||h_b|| + n_i ||f_b|| + gamma_d n_i t_b ||h16_b||
                        + 2^-11 (1 + 2^-10) |y| + t_b 2^-25,

and ``t_b 2^-25 <= 2^-24 ||h_b||``. No overflow: ``|acc| <= n_i ||h16_b|| <= max n sqrt(d)``,
checked below 60000 at construction.
"""

from __future__ import annotations

import math

import torch

from ..errors import CSVError
from ..fp import FP32_UNIT_ROUNDOFF, gamma, round_up32
from .copy_error import copy_error_norms

FP16_REL = 2.0**-11 * (1 + 2.0**-10)


def fp32_reduced(h16: torch.Tensor, w16: torch.Tensor) -> torch.Tensor:
    """``F.linear(h16, w16)`` in fp16 with its partial sums kept in fp32 (the error term below,
    ``gamma_d``, assumes fp32 accumulation). cuBLAS may otherwise reduce split-K partial sums in
    fp16 (torch's ``allow_fp16_reduced_precision_reduction``, on by default): on CUDA that flag is
    turned off for this call only and set back (vLLM's own GEMMs are untouched; torch reads it at
    each call, so a CUDA graph captures the call as made here)."""
    m = torch.backends.cuda.matmul
    if not (h16.is_cuda and m.allow_fp16_reduced_precision_reduction):
        return torch.nn.functional.linear(h16, w16)
    old = m.allow_fp16_reduced_precision_reduction
    m.allow_fp16_reduced_precision_reduction = False
    try:
        return torch.nn.functional.linear(h16, w16)
    finally:
        m.allow_fp16_reduced_precision_reduction = old


class HalfScreen:
    name = "fp16"
    two_sided = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int = 8192):
        V, d = weight.shape
        self.w16 = weight.to(torch.float16).contiguous()
        r, n = copy_error_norms(weight, lambda a, b: self.w16[a:b].double(), chunk)
        if not bool(torch.isfinite(self.w16).all()) or float(n.max()) * math.sqrt(d) * (1 + gamma(d)) >= 60000:
            raise CSVError("screen 'fp16': LM head rows too large for fp16 (use --csv-screen int8)")
        slack = 1 + 4 * FP32_UNIT_ROUNDOFF
        self.radius = round_up32(r + 2.0**-24) * slack
        self.n = round_up32(n) * slack
        self.gamma = gamma(d)
        self.bias = None if bias is None else bias.float()
        self.extra_bytes = self.w16.numel() * 2 + V * 8

    def center_radius(self, h: torch.Tensor):
        from . import ScreenOut

        hf = h.float()
        amax = hf.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        t = torch.exp2(torch.ceil(torch.log2(amax)))
        t = torch.where(t < amax, t * 2, t)  # log2 rounding: t >= max|h_b| for sure
        h16 = (hf / t).to(torch.float16)
        y16 = fp32_reduced(h16, self.w16)
        # one pass: fp32 y = y16 * t (exact: t is a power of two) + bias (one fp32 rounding)
        y = torch.mul(y16, t) if self.bias is None else torch.addcmul(self.bias, y16, t)
        f = (h.double() - t.double() * h16.double()).norm(dim=1)
        e = f + self.gamma * t[:, 0].double() * h16.double().norm(dim=1)
        return ScreenOut(y, self.radius, True, self.n, round_up32(e) * (1 + 4 * FP32_UNIT_ROUNDOFF), FP16_REL)
