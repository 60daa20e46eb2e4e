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

from ..fp import FP32_UNIT_ROUNDOFF, gamma
from ..index import _round_up

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
    two_sided = True
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bits: int = 8, chunk: int = 8192):
        self.name = f"int{bits}"
        self.bits, self.chunk = bits, chunk
        V, d = weight.shape
        self.q, self.s = quantize(weight, bits)
        r = torch.empty(V, dtype=torch.float64, device=weight.device)
        deq_norm = torch.empty_like(r)
        for a in range(0, V, chunk):  # chunked: never materialise a float64 copy of W
            deq = self._deq(a, a + chunk).double()
            r[a : a + chunk] = (weight[a : a + chunk].double() - deq).norm(dim=1)
            deq_norm[a : a + chunk] = deq.norm(dim=1)
        self.radius = _round_up(r + gamma(d + 2) * deq_norm) * (1 + 4 * FP32_UNIT_ROUNDOFF)
        self.bias = None if bias is None else bias.float()
        # This reference keeps int4 values unpacked in int8; packed kernels halve that term.
        self.extra_bytes = self.q.numel() + self.s.numel() * 4 + V * 4

    def _deq(self, a: int, b: int) -> torch.Tensor:
        return self.q[a:b].float() * _expand(self.s[a:b], self.q.shape[1])

    def screen(self, h: torch.Tensor) -> torch.Tensor:
        """``y = fl(h @ deq^T)`` in fp32, ``[B, V]``."""
        hf = h.float()
        return torch.cat([hf @ self._deq(a, a + self.chunk).T for a in range(0, self.q.shape[0], self.chunk)], 1)

    def center_radius(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``y = fl(<deq_i, h>) + b_i`` (``[B, V]``) and ``r = rad`` (``[V]``):
        ``|<w_i, h> + b_i - y_i| <= r_i ||h||`` up to the relative error of adding ``b_i``."""
        y = self.screen(h)
        return (y if self.bias is None else y + self.bias), self.radius, True
