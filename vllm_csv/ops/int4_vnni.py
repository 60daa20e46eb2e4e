"""The int4 screen's GEMM with AVX512-VNNI, else AVX2 (``csrc/cpu/int4_vnni.cpp``), beside its torch
reference. (The AVX2 kernel, ``int4_avx2_linear``, ``backend = "avx2"``: the same layout and bits,
``vpmaddubsw`` into int16 over a group and ``vpmaddwd`` by ones instead of ``vpdpbusd``: the .cpp's top.)

For ``x = [c p_b, -64 c, 63 c]`` (:func:`vllm_csv.ops.rows.quantize_act7`'s layout: ``p_b``
integers in ``[-64, 63]``, ``c`` a power of two), int4 weights ``q`` in ``[-7, 7]`` and fp16
scales ``s`` per group of :data:`GROUP` columns, both return, bit for bit,

    y[b, i] = fl(z[b, i] c),   z = fl(... fl(fl(s_i0 A_i0) + s_i1 A_i1) ...)  (one rounding a group)
    A_ig = sum_{k in group g} p_bk q_ik                                        (exact integers)

Why: the head's bytes. The int8 copy of a ``151936 x 1024`` head is 155 MB; this one is 78 MB of
nibbles and 9.7 MB of fp16 scales, and the screen's GEMM reads all of it every step. The kernel
streams a panel of 32 rows once for up to 8 batch rows, multiplies the unsigned nibbles
``q + 8`` by the signed activation bytes with ``vpdpbusd`` (four products into each int32 lane,
no saturation: ``|sum (q + 8) p| <= 15 * 64 * 32`` a group), takes
``A = sum (q + 8) p - 8 sum p`` (exact in int32, and in fp32 after ``vcvtdq2ps``:
``|A| < 2^24``), and adds ``s A`` to ``z`` with one fused multiply-add a group (``vfmadd``:
one rounding, as the reference's float64 sum then fp32 rounding). The op checks, on every call,
that its input has the layout above and refuses (``RuntimeError``) otherwise.
"""

from __future__ import annotations


import torch

from .build import cpu_supports, load_ops, no_avx512_reason
from .fbgemm import act7_decode

GROUP = 32  # columns a scale
QMAX = 7
SCALE_MIN = 2.0**-14  # the smallest normal fp16: scales are raised to it
SCALE_MAX = 65504.0  # the largest fp16


def unavailable_reason() -> str | None:
    """Why :class:`VnniInt4Linear` cannot run here (``None`` if it can): it needs AVX512-VNNI
    (and F16C) or, for its AVX2 kernel, AVX2, FMA and F16C."""
    if load_ops() is None:
        return "the CSV CPU kernels are not built"
    if not cpu_supports("avx512_vnni_f16c") and not cpu_supports("avx2_fma_f16c"):
        return no_avx512_reason("AVX512-VNNI") + ", and no AVX2 with FMA and F16C"
    return None


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [V, d] int8 in [-7, 7], s [V, G] float16)``: per group of :data:`GROUP` columns,
    ``s = fp16(max|w| / 7)`` raised to :data:`SCALE_MIN` (a normal fp16), ``q = round(w / s)``
    clamped. Refuses (``ValueError``) weights whose scale would not fit in fp16."""
    w = weight.detach().float()
    V, d = w.shape
    G = -(-d // GROUP)
    wg = torch.nn.functional.pad(w, (0, G * GROUP - d)).view(V, G, GROUP)
    amax = wg.abs().amax(2)
    top = float(amax.max()) if amax.numel() else 0.0
    if not bool(torch.isfinite(amax).all()) or top / QMAX > SCALE_MAX:
        raise ValueError("weights not finite or too large for fp16 group scales")
    s = (amax / QMAX).clamp_(min=SCALE_MIN).half()
    q = torch.round(wg / s.float()[:, :, None]).clamp_(-QMAX, QMAX).to(torch.int8).view(V, G * GROUP)[:, :d]
    return q.contiguous(), s


def dequantized(q: torch.Tensor, s: torch.Tensor, a: int = 0, b: int | None = None) -> torch.Tensor:
    """``s q`` of rows ``a:b`` in float64, exactly (an fp16 times an integer of 3 bits)."""
    qd = q[a:b].double()
    return qd * s[a:b].double().repeat_interleave(GROUP, 1)[:, : q.shape[1]]


def int4_linear_ref(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Torch reference of :meth:`VnniInt4Linear.linear` (module docstring): ``y [B, V]`` fp32."""
    V, d = q.shape
    B = x.shape[0]
    if B == 0:
        return torch.empty((0, V), dtype=torch.float32)
    p, c = act7_decode(x, d, "int4_vnni_linear")
    z = torch.zeros((B, V), dtype=torch.float32)
    for g in range(s.shape[1]):
        cols = slice(g * GROUP, min(d, (g + 1) * GROUP))
        a = p[:, cols] @ q[:, cols].double().T  # exact: integers below 2^53
        # one rounding: z (a multiple of 2^-24 below 2^40) plus an exact product, summed exactly
        # in float64, then rounded to fp32 -- a fused multiply-add
        z = (z.double() + a * s[:, g].double()[None]).float()
    return z * c  # a power of two: exact unless the result leaves the normal range


class VnniInt4Linear:
    """The packed int4 copy and its GEMM (``linear(x) -> y``, module docstring)."""

    backend = "vnni"

    def __init__(self, q: torch.Tensor, s: torch.Tensor):
        why = unavailable_reason()
        if why is not None:
            raise RuntimeError(why)
        ops = load_ops()
        vnni = cpu_supports("avx512_vnni_f16c")  # else AVX2, FMA and F16C (unavailable_reason)
        self._op = ops.int4_vnni_linear if vnni else ops.int4_avx2_linear
        self.backend = "vnni" if vnni else "avx2"
        self.vocab_size, self.hidden_size = q.shape
        self.packed = ops.pack_int4_vnni(q)
        np_, G = self.packed.shape[0], s.shape[1]
        sc = torch.zeros((np_ * 32, G), dtype=torch.float16)
        sc[: q.shape[0]] = s
        self.scales = sc.view(np_, 32, G).transpose(1, 2).contiguous().view(torch.int16)  # [panel, G, 32]
        self.nbytes = self.packed.numel() + self.scales.numel() * 2

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.packed, self.scales, self.vocab_size, self.hidden_size)
