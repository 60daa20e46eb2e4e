"""FBGEMM's exact int8 GEMM on x86 CPUs, through torch's ``quantized`` ops, beside its torch reference.

``torch.ops.quantized.linear_prepack`` packs a per-channel symmetric int8 weight once;
``torch.ops.quantized.linear_dynamic(x, packed, reduce_range=True)`` then runs, in FBGEMM
(``aten/src/ATen/native/quantized/cpu/qlinear_dynamic.cpp``, ``PackedLinearWeight::apply_dynamic_impl``):

1. ``FindMinMax`` over all of ``x`` and ``ChooseQuantizationParams(min, max, 0, 255,
   reduce_range=True)``: ``qmin, qmax = 0, 127``, ``scale = (max - min) / 127`` (double, then
   float), ``zero_point = round(qmin - min / scale)``.
2. ``QuantizeAvx2``: ``code = clamp(cvt_rne(x / scale + zero_point), 0, 255)`` (uint8).
3. The uint8 x int8 GEMM with int32 accumulation: ``vpdpbusd`` (AVX512-VNNI, no saturation)
   or ``vpmaddubsw`` + ``vpmaddwd`` (AVX2/AVX512), whose int16 pair sums saturate above
   ``2^15 - 1``; with codes in ``[0, 127]`` and ``|q| <= 128`` a pair is at most
   ``2 * 127 * 128 = 32512``: no saturation (this is why ``reduce_range`` exists).
4. ``ReQuantizeForFloat`` (per channel): ``acc = raw - zero_point * col_offset_i`` (int32, exact),
   ``out = fl(fl(acc) * fl(scale * s_i))``.

:class:`PackedInt8Linear` drives it so that every step is exact but the last product: its
inputs are integers ``p`` in ``[-64, 63]`` times a power of two ``c``, and two extra input
columns (zero weight columns) hold ``-64 c`` and ``63 c``. Then ``min, max = -64 c, 63 c``,
``scale = c`` and ``zero_point = 64`` exactly (``c`` a power of two in
``[2^-14, 2^100]``: ``ChooseQuantizationParams`` replaces scales below ``6.1e-5``), the codes
are ``p + 64`` exactly, ``acc = <p, q_i>`` exactly (``|acc| <= 127 * 128 * (d + 2) < 2^31``),
and ``out = fl(fl(<p, q_i>) * c s_i)`` (``c s_i`` exact unless it leaves the normal range,
which the caller excludes). :func:`packed_int8_linear_ref` computes the same bits in torch.

Availability: ``quantized::linear_prepack``/``linear_dynamic`` with the FBGEMM backend ship in
every x86 build of torch since 1.3; torch 2.13 deprecates the quantized *tensor constructors*
(pytorch/pytorch#184982) with a warning, filtered here around the one call that needs them.
"""

from __future__ import annotations

import math
import warnings

import torch

from ..errors import CSVError

ACT_MIN, ACT_MAX = -64, 63  # 7-bit activation codes: p + 64 in [0, 127]
C_MIN_LOG2, C_MAX_LOG2 = -14, 100  # powers of two c that ChooseQuantizationParams keeps exactly
_DEPRECATION = r"torch\.quantize_per_tensor, torch\.quantize_per_channel and other quantized tensor creation"


def _ops():
    """The two torch ops (raises ``AttributeError``/``RuntimeError`` where torch lacks them)."""
    return torch.ops.quantized.linear_prepack, torch.ops.quantized.linear_dynamic


def unavailable_reason(d: int, vocab: int) -> str | None:
    """Why :class:`PackedInt8Linear` cannot run here (``None`` if it can)."""
    try:
        _ops()
    except (AttributeError, RuntimeError) as e:
        return f"torch has no quantized::linear_dynamic ({e})"
    engine = torch.backends.quantized.engine
    if engine not in ("x86", "fbgemm"):  # other engines pack for QNNPACK/oneDNN: other numerics
        return f"quantized engine is {engine!r}, not x86/fbgemm"
    if 127 * 128 * (d + 2) >= 2**31:
        return f"hidden size {d} overflows FBGEMM's int32 accumulator"
    if vocab * (d + 2) >= 2**31:
        return f"head of {vocab}x{d} is too large for FBGEMM's int32 indexing"
    return None


class Int8Linear:
    """``y[b, i] = fl(fl(<p_b, q_i>) * (c s_i))`` for int8 ``q [V, d]``, fp32 scales ``s [V]``
    (normal numbers), integer ``p [B, d]`` in ``[-64, 63]`` and a power of two ``c``: the screen's
    exact int8 GEMM, whatever computes it (:class:`PackedInt8Linear`,
    :class:`~vllm_csv.ops.int8_vnni.VnniInt8Linear`); a backend implements :meth:`linear`.

    Parameters
    ----------
    q : torch.Tensor
        ``[V, d]`` int8, values in ``[-128, 127]``.
    s : torch.Tensor
        ``[V]`` float32, positive normal numbers.
    unavailable : str or None
        Why the backend cannot run here (:class:`~vllm_csv.errors.CSVError`), or None.
    """

    backend = ""

    def __init__(self, q: torch.Tensor, s: torch.Tensor, unavailable: str | None):
        if unavailable is not None:
            raise CSVError(unavailable)
        self.vocab_size, self.hidden_size = q.shape

    def __call__(self, p: torch.Tensor, c: float) -> torch.Tensor:
        """``p [B, d]`` float32 integers in ``[-64, 63]``, ``c = 2^j`` with ``-14 <= j <= 100``;
        returns ``[B, V]`` float32."""
        return self.linear(act7_layout(p, c))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """The GEMM on an input already laid out as :meth:`__call__` lays it out, ``[B, d + 2]``
        fp32 (:func:`act7_layout`; :func:`vllm_csv.ops.rows.quantize_act7` builds it in one pass)."""
        raise NotImplementedError


class PackedInt8Linear(Int8Linear):
    """:class:`Int8Linear` with FBGEMM (same parameters)."""

    backend = "fbgemm"

    def __init__(self, q: torch.Tensor, s: torch.Tensor):
        super().__init__(q, s, unavailable_reason(q.shape[1], q.shape[0]))
        V = q.shape[0]
        prepack, self._linear = _ops()
        q2 = torch.nn.functional.pad(q, (0, 2))  # two zero columns for the forced min/max
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_DEPRECATION, category=UserWarning)
                qw = torch._make_per_channel_quantized_tensor(
                    q2, s.double(), torch.zeros(V, dtype=torch.long), 0)
            self.packed = prepack(qw, None)
        except (AttributeError, RuntimeError) as e:
            raise CSVError(f"FBGEMM int8 prepack failed: {e}") from None

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.packed, True)


def act7_layout(p: torch.Tensor, c: float) -> torch.Tensor:
    """``x [B, d + 2] = [c p_b, -64 c, 63 c]`` fp32: the input layout of the int8 GEMMs (the two
    extra columns force FBGEMM's quantisation parameters; see the module docstring)."""
    B, d = p.shape
    x = torch.empty((B, d + 2), dtype=torch.float32)
    torch.mul(p, c, out=x[:, :d])  # exact: 7-bit integers times a power of two
    x[:, d] = ACT_MIN * c
    x[:, d + 1] = ACT_MAX * c
    return x


def act7_decode(x: torch.Tensor, d: int, op: str) -> tuple[torch.Tensor, float]:
    """The inverse of :func:`act7_layout` for the kernels' torch references: ``(p [B, d] float64,
    c)`` from ``x [B, d + 2]`` (``c`` read from the last column), or ``RuntimeError`` (naming
    ``op``) where ``x`` is not ``c`` times integers in ``[-64, 63]`` with ``c`` a power of two in
    that layout -- the no-saturation condition the kernels check on every call. ``B > 0``."""
    c = float(x[0, d + 1]) / ACT_MAX
    p = x[:, :d].double() / c
    ok = (math.isfinite(c) and c > 0 and math.frexp(c)[0] == 0.5 and bool((p == p.round()).all())
          and float(p.min()) >= ACT_MIN and float(p.max()) <= ACT_MAX
          and bool((x[:, d] == ACT_MIN * c).all()) and bool((x[:, d + 1] == ACT_MAX * c).all()))
    if not ok:
        raise RuntimeError(f"{op}: input is not c times 7-bit integers")
    return p, c


def packed_int8_linear_ref(p: torch.Tensor, q: torch.Tensor, s: torch.Tensor, c: float) -> torch.Tensor:
    """Torch reference of :class:`PackedInt8Linear`: the exact integer product (float64 holds
    it: ``|<p, q>| < 2^31``), rounded to float32, times ``c s`` (exact), rounded to float32."""
    acc = (p.double() @ q.double().T).float()
    return acc * (s.float() * c)
