"""Low-precision copies of the head with a proven per-row error bound.

Each row is stored as ``deq_i = s_i * q_i`` (int8: one scale a row; int4: one scale per
group of 32 columns). With ``r_i = ||w_i - deq_i||`` (computed in float64 from the
materialised ``deq_i``, rounded up) and ``y_i = fl(<deq_i, h>)`` accumulated in fp32:

    |<w_i, h> - y_i| <= |<w_i - deq_i, h>| + |<deq_i, h> - y_i|
                    <= r_i ||h|| + gamma_d ||deq_i|| ||h||          (Cauchy-Schwarz, Higham 3.4)

so ``y_i + b_i -/+ rad_i ||h||`` with ``rad_i = r_i + gamma_{d+2} ||deq_i||`` bound the
exact logit; the runtime adds the relative rounding of the additions. This module is the torch reference;
fast kernels (``vllm_csv.ops``) compute the same ``y``.
"""

from __future__ import annotations

import torch

from ..fp import FP32_UNIT_ROUNDOFF, gamma, matmul32, round_up32
from .copy_error import copy_error_norms

GROUP = 32


def quantize(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantisation: ``q`` in ``[-(2^(bits-1)-1), 2^(bits-1)-1]`` (int8 storage) and
    fp32 scales, one per row (8 bits) or per group of ``GROUP`` columns (4 bits)."""
    w = weight.detach().float()
    qmax = 2 ** (bits - 1) - 1
    if bits == 8:
        s = w.abs().amax(1, keepdim=True) / qmax
    else:
        V, d = w.shape
        pad = (-d) % GROUP
        wg = torch.nn.functional.pad(w, (0, pad)).view(V, -1, GROUP)
        s = wg.abs().amax(2) / qmax  # [V, groups]
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / _expand(s, w.shape[1])).clamp_(-qmax, qmax).to(torch.int8)
    return q, s.contiguous()


def _expand(s: torch.Tensor, d: int) -> torch.Tensor:
    """Per-row ``[V, 1]`` or per-group ``[V, G]`` scales as a ``[V, d]`` (broadcastable) tensor."""
    return s if s.shape[1] == 1 else s.repeat_interleave(GROUP, 1)[:, :d]


class QuantizedScreen:
    """Screen with a low-precision copy ``deq_i = s_i q_i`` of every row.

    Three ways to compute the center ``y``, each with its bound (``r_i = ||w_i - deq_i||``
    in float64 with ``deq`` the exact real product, ``n_i = ||deq_i||``, ``u = 2^-24``):

    * int8, exact integer GEMM (``torch._int_mm``: cuBLASLt int8 tensor cores on CUDA, see
      :func:`vllm_csv.ops.int8_gemm`): ``h_b = t_b p_b + f_b`` with ``p_b`` int8 and
      ``t_b = max|h_b| / 127``; ``<q_i, p_b>`` is exact in int32 (``127^2 d < 2^31``), so
      ``y = s_i t_b <q_i, p_b>`` (three roundings, absorbed by the runtime's relative
      slack) and ``|<w_i, h_b> - y| <= r_i ||h_b|| + n_i ||f_b||``.
    * int8 fp32 kernel (``csrc/int8_screen.cu``, :func:`vllm_csv.ops.int8_screen`) and the
      int4 reference: ``y = fl(<deq_i, h_b>)`` with fp32 accumulation,
      ``|<w_i, h_b> - y| <= (r_i + gamma_{d+2} n_i) ||h_b||``.
    """

    two_sided = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bits: int = 8, chunk: int = 8192):
        self.name = f"int{bits}"
        self.bits, self.chunk = bits, chunk
        V, d = weight.shape
        self.q, self.s = quantize(weight, bits)
        r, n = copy_error_norms(  # deq = q * s, exact in float64
            weight, lambda a, b: self.q[a:b].double() * _expand(self.s[a:b], d).double(), chunk)
        slack = 1 + 4 * FP32_UNIT_ROUNDOFF
        self.r_exact = round_up32(r) * slack  # exact-integer path: radius without accumulation error
        self.n = round_up32(n) * slack
        self.radius = round_up32(r + gamma(d + 2) * n) * slack  # fp32-accumulation paths
        self.bias = None if bias is None else bias.float()
        self.int_gemm = bits == 8 and weight.device.type in ("cpu", "cuda") and d * 127 * 127 < 2**31
        if self.int_gemm:  # padded for cuBLASLt on CUDA; self.q stays a view of it
            from ..ops import pad_for_int_gemm

            self.q_gemm = pad_for_int_gemm(self.q)
            self.q = self.q_gemm[:V, :d]
        self.s_row = self.s.reshape(1, -1) if bits == 8 else None
        # The int4 reference keeps values unpacked in int8 (a packed kernel halves the first term).
        self.extra_bytes = self.q.numel() + self.s.numel() * 4 + V * 8

    def _deq(self, a: int, b: int) -> torch.Tensor:
        return self.q[a:b].float() * _expand(self.s[a:b], self.q.shape[1])

    def center_radius(self, h: torch.Tensor):
        from . import ScreenOut

        if self.int_gemm:
            from ..ops import int8_gemm

            hf = h.float()
            t = (hf.abs().amax(1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
            p = torch.round(hf / t).clamp_(-127, 127).to(torch.int8)
            acc = int8_gemm(p, self.q_gemm, self.q.shape[0])  # exact
            y = acc.float().mul_(t).mul_(self.s_row)
            f = (h.double() - t.double() * p.double()).norm(dim=1)
            e = round_up32(f) * (1 + 4 * FP32_UNIT_ROUNDOFF)
            out = ScreenOut(y, self.r_exact, True, self.n, e)
        elif self.bits == 8:
            from ..ops import int8_screen

            out = ScreenOut(int8_screen(h, self.q, self.s, None), self.radius, True)
        else:
            hf = h.float()
            y = torch.cat([matmul32(hf, self._deq(a, a + self.chunk).T) for a in range(0, self.q.shape[0], self.chunk)],
                          1)
            out = ScreenOut(y, self.radius, True)
        if self.bias is not None:
            out.y += self.bias
        return out
