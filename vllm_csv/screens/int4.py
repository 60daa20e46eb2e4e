"""The int4 screen on x86 CPUs with AVX512-VNNI or AVX2: half the bytes of the int8 copy.

Weights: per group of 32 columns, ``deq_ig = s_ig q_ig`` with ``s_ig`` an fp16 normal number
(``>= 2^-14``) and ``q`` integers in ``[-7, 7]`` (:func:`~vllm_csv.ops.int4_vnni.quantize_int4`);
``r_i = ||w_i - deq_i||`` and ``n_i = ||deq_i||`` in float64 from the exact ``deq_i``, rounded
up.

Activations: as the int8 screen's (:mod:`.fbgemm`, whose docstring has the proof):
``h_b = c_b p_b + f_b`` with ``p_b`` integers in ``[-64, 63]``, ``c_b = t_b / 64`` a power of two,
``e_b >= ||f_b||`` (:func:`~vllm_csv.ops.rows.quantize_act7`).

The GEMM (:mod:`vllm_csv.ops.int4_vnni`): ``A_big = <p_b, q_i>`` over group ``g`` (exact
integers), ``z_bi`` their sum ``sum_g s_ig A_big`` with one rounding a group (fused
multiply-add), then ``y = z c`` with ``c`` a power of two. Every term ``s_ig A_big`` is a multiple
of ``2^-24`` (an fp16 normal times an integer), so every partial sum is one as well and none is
subnormal: recursive summation gives ``|z - sum_g s_ig A_big| <= gamma_G sum_g |s_ig A_big|
<= gamma_G <|deq_i|, |p_b|> <= gamma_G n_i ||p_b||`` (Cauchy-Schwarz). ``|z| <= 7 * 64 * d * s_max``
and a nonzero ``|z| >= 2^-24``: those are the ``s_max``, ``s_min`` given to ``quantize_act7``, so
that the folded ``c`` keeps ``z c`` normal (exact), and otherwise the per-row scaling ``z t_b /
64`` (the head's deferred row scale) is exact except for an absolute ``2^-149`` where it may
underflow, which ``quantize_act7`` adds to ``e_b`` as ``2^-149 / s_min``; ``n_i >= 2^-14`` for any
row with a nonzero ``q``, so ``n_i e_b`` covers it (a row of zeros gives exactly 0). With
``x_bi = c_b sum_g s_ig A_big = <deq_i, c_b p_b>``:

    <w_i, h_b> = <w_i - deq_i, h_b> + <deq_i, f_b> + x_bi
    |<w_i, h_b> - y_bi| <= r_i ||h_b|| + n_i (e_b + gamma_G ||c_b p_b||)

with ``||c_b p_b|| <= ||h_b|| + e_b``; :class:`~vllm_csv.screens.ScreenOut` ``(y + b, r, n, e',
rel=3u)``, ``e'_b = e_b + gamma_G (||h_b|| + e_b)`` rounded up (``rel`` covers the bias's fp32
addition and the per-row scaling's rounding). The constructor checks the kernel against its
float64 reference on probe rows (activation extremes, the largest weights), bit for bit, and
refuses (:class:`~vllm_csv.errors.CSVError`) where anything differs or is missing.
"""

from __future__ import annotations

import torch

from ..errors import CSVError
from ..fp import FP32_UNIT_ROUNDOFF, gamma, round_up32
from ..ops import int4_vnni, rows
from ..ops.build import uses_kernels
from ..ops.fbgemm import ACT_MIN, act7_layout
from ..ops.int4_vnni import GROUP, QMAX, dequantized, int4_linear_ref, quantize_int4
from .copy_error import copy_error_norms
from .fbgemm import REL, apply_row_scale, self_test_probe

Z_MIN = 2.0**-24  # the smallest nonzero |z| (module docstring)


class VnniInt4Screen:
    """Per-group int4 copy of the head, scored by the int4 kernel (x86 CPUs: AVX512-VNNI, else AVX2).

    Parameters
    ----------
    weight : torch.Tensor
        ``[V, d]`` LM head, any float dtype, on the CPU.
    bias : torch.Tensor, optional
        ``[V]``.
    """

    name = "int4"
    two_sided = True
    defers_row_scale = True
    backend = "vnni"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int = 8192):
        if weight.device.type != "cpu":
            raise CSVError("the int4 VNNI screen runs on the CPU only")
        why = int4_vnni.unavailable_reason()
        if why is not None:
            raise CSVError(why)
        V, d = weight.shape
        try:
            q, s = quantize_int4(weight)
        except ValueError as e:
            raise CSVError(str(e)) from None
        self.gemm = int4_vnni.VnniInt4Linear(q, s)
        self.backend = self.gemm.backend  # "vnni", or "avx2" where the CPU has no AVX512-VNNI
        r, n = copy_error_norms(weight, lambda a, b: dequantized(q, s, a, b), chunk)
        slack = 1 + 4 * FP32_UNIT_ROUNDOFF
        self.radius = round_up32(r) * slack
        self.n = round_up32(n) * slack
        self.z_max = QMAX * -ACT_MIN * d * float(s.float().max()) if s.numel() else 1.0
        self.gamma_g = gamma(-(-d // GROUP)) * (1 + 8 * FP32_UNIT_ROUNDOFF)
        self.bias = None if bias is None else bias.float()
        # the activations' pass bound once: the CPU kernels where built (the GEMM needs them), else the reference
        self._quantize_act7 = rows.quantize_act7_cpu if uses_kernels(weight) else rows.quantize_act7_ref
        self.extra_bytes = self.gemm.nbytes + V * 4 * 2  # nibbles, fp16 scales; r, n
        self._self_test(q, s)

    def _self_test(self, q: torch.Tensor, s: torch.Tensor) -> None:
        """Probe activations at the extremes of their range and random ones, at two scales, on
        a sample of rows of ``W`` (with its largest scale), against the float64 reference."""
        p, rows = self_test_probe(*q.shape, int(s.float().amax(1).argmax()))
        for c in (1.0, 2.0**-10):
            x = act7_layout(p, c)
            if not torch.equal(self.gemm.linear(x)[:, rows], int4_linear_ref(x, q[rows], s[rows])):
                raise CSVError("the int4 VNNI GEMM is not exact on this machine (self-test)")

    def center_radius(self, h: torch.Tensor, defer_row_scale: bool = False):
        """Screen values for ``h [B, d]``: ``ScreenOut(y [B, V] fp32, r [V], n [V], e' [B], rel)``
        (module docstring); with ``defer_row_scale`` (and no bias) rows quantised with different
        exponents come back unscaled, with ``row_scale [B]``, as the int8 screen's
        (:meth:`~vllm_csv.screens.fbgemm.FbgemmInt8Screen.center_radius`)."""
        from . import ScreenOut

        B = h.shape[0]
        if B == 0:
            y = torch.empty((0, self.n.shape[0])) if self.bias is None else self.bias.expand(0, -1).clone()
            return ScreenOut(y, self.radius, True, self.n, torch.empty(0), REL)
        x, scale, e, c = self._quantize_act7(h, Z_MIN, self.z_max)
        # e' = e + gamma_G (||h|| + e), rounded up (NaN / inf rows stay NaN / inf: dense)
        e = round_up32((e.double() + self.gamma_g * (h.double().norm(dim=1) + e.double()))
                       * (1 + 4 * FP32_UNIT_ROUNDOFF))
        y = self.gemm.linear(x)
        out = ScreenOut(y, self.radius, True, self.n, e, REL, apply_row_scale(y, scale, c, defer_row_scale, self.bias))
        if self.bias is not None:
            out.y += self.bias
        return out
