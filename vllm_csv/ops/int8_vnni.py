"""The int8 screen's GEMM with AVX512-VNNI (``csrc/cpu/int8_vnni.cpp``) or AVX2 (``csrc/cpu/int8_avx2.cpp``),
beside its torch reference.

Same numbers as :class:`vllm_csv.ops.fbgemm.PackedInt8Linear`, bit for bit, for the same input
layout ``x = [c p_b, -64 c, 63 c]`` (:func:`vllm_csv.ops.rows.quantize_act7`):

    y[b, i] = fl(fl(<p_b, q_i>) * fl(c s_i))

Why a kernel of our own: FBGEMM re-quantises its input on every call and cannot hand back what
the candidate search reads first (the block maxima below), and at decode batches of up to 8
rows its GEMM was the slower one here (``benchmarks/int8_gemm_cpu.py``, results in benchmarks/README.md).
The kernel streams a panel of 32 weight rows once for up to 8 batch rows (more rows: one pass
per 8), multiplies with ``vpdpbusd`` (unsigned codes ``p + 64`` in ``[0, 127]`` times signed
``q``, four products summed into each int32 lane, no saturation), and rescales in the same pass:

* ``A = sum_k code_k q_k - 64 rowsum(q)``: exact in int32, ``|A|`` and every partial sum are
  below ``127 * 128 * (d + 3) < 2^31`` (:func:`unavailable_reason` checks ``d``);
* ``fl(A)`` (``vcvtdq2ps``) and the product with ``fl(c s_i)`` (``vmulps``) round to nearest even,
  the two roundings of FBGEMM's ``ReQuantizeForFloat`` and of :func:`int8_vnni_linear_ref`.

With a block size it also returns the maxima of ``y`` over consecutive blocks of tokens, the
first thing the candidate search reads (:func:`vllm_csv.ops.select.select_candidates`): taken
in registers, they save that search its one full pass over ``[B, V]``.

On CPUs with AMX-INT8 (Intel Sapphire Rapids and later), batches of :data:`AMX_FROM` rows or more
take the same kernel's AMX variant (``int8_amx_linear``): tile multiplies (``tdpbusd``) of the same
codes and the same packed weight, 16 batch rows a tile, one pass over the weight for the whole
batch. Its int32 sums are exact too (the same bound), so it returns the same ``y`` and block maxima
bit for bit; the VNNI kernel makes one pass per 8 rows and is bound by its ``vpdpbusd`` count
from about 8 rows (measured in benchmarks/README.md: 12.6 against 6.6 ms at 8 rows, 42.7 against 8.5 ms at
32 rows, on a ``151936 x 1024`` head). Below :data:`AMX_FROM` rows both read the weight once and the
VNNI kernel was as fast or faster.

The op reads ``c`` from the input's last column (``63 c``) and checks, for every call, that each
input is ``c`` times an integer in ``[-64, 63]`` (the no-saturation condition), and refuses
(``RuntimeError``) otherwise.

Where the CPU has no AVX512-VNNI but AVX2 and FMA (AMD Zen 2/3, Intel Haswell to Skylake-SP; or
``VLLM_CSV_CPU_ISA=avx2``), the same class runs the AVX2 kernel (``backend = "avx2"``,
``int8_avx2_linear``): the same packed weight and, bit for bit, the same ``y`` and block maxima,
with ``vpmaddubsw`` (pairs of unsigned codes times signed weights into int16: at most
``2 * 127 * 128 = 32512``, never saturating) and ``vpmaddwd`` by ones into int32. Under
emulation on a Zen 4 core (AVX2 code there, not an AVX2 machine's figure) the screen's call,
``y`` and block maxima, measured 1.1-2.1x faster than FBGEMM's AVX2 GEMM followed by the
search's block-max pass at 1-4 rows, and within 5% either way at 8 and 16
(docs/kernels.md, "The int8 GEMM's AVX2 kernel, measured"). Where the kernels are not built, or the
CPU has neither, :func:`unavailable_reason` says why and the screen takes FBGEMM.
"""

from __future__ import annotations


import torch

from .build import GROUP, PANEL, cpu_supports, fake, load_ops, no_avx512_reason
from .fbgemm import ACT_MIN, Int8Linear, act7_decode, packed_int8_linear_ref


AMX_FROM = 4  # batch rows from which the AMX kernel runs, where the CPU has it


def amx_available() -> bool:
    """Whether this CPU has AMX-INT8 and this process may use it (the kernels built)."""
    return cpu_supports("amx_int8")


def unavailable_reason(d: int, vocab: int) -> str | None:
    """Why :class:`VnniInt8Linear` cannot run here (``None`` if it can): it needs AVX512-VNNI or,
    for its AVX2 kernel, AVX2 and FMA."""
    if load_ops() is None:
        return "the CSV CPU kernels are not built"
    if not cpu_supports("avx512_vnni") and not cpu_supports("avx2_fma"):
        return no_avx512_reason("AVX512-VNNI") + ", and no AVX2 with FMA"
    if 127 * 128 * (d + 3) >= 2**31:
        return f"hidden size {d} overflows the int32 accumulator"
    return None


class VnniInt8Linear(Int8Linear):
    """:class:`~vllm_csv.ops.fbgemm.Int8Linear` with the AVX512-VNNI kernel (same parameters)."""

    backend = "vnni"

    def __init__(self, q: torch.Tensor, s: torch.Tensor):
        super().__init__(q, s, unavailable_reason(q.shape[1], q.shape[0]))
        V = q.shape[0]
        ops = load_ops()
        vnni = cpu_supports("avx512_vnni")  # else AVX2 and FMA (unavailable_reason)
        self._op = ops.int8_vnni_linear if vnni else ops.int8_avx2_linear
        self._amx = ops.int8_amx_linear if vnni and amx_available() else None  # (batches of AMX_FROM rows or more)
        self.backend = "vnni+amx" if self._amx is not None else "vnni" if vnni else "avx2"
        self.packed = ops.pack_int8_vnni(q)
        n = self.packed.shape[0] * PANEL
        self.zsum = torch.zeros(n, dtype=torch.int32)
        self.zsum[:V] = q.sum(1, dtype=torch.int32) * -ACT_MIN  # 64 rowsum(q): the codes' zero point
        self.s = torch.zeros(n, dtype=torch.float32)
        self.s[:V] = s

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """The GEMM on ``x [B, d + 2]`` fp32 laid out as :func:`~vllm_csv.ops.fbgemm.act7_layout`
        lays it out; ``RuntimeError`` if it is not."""
        return self._op_for(x)(x, self.packed, self.zsum, self.s, self.vocab_size, self.hidden_size, 0)[0]

    def linear_block_max(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`linear` and, in the same pass, the maxima of ``y`` over consecutive blocks of
        ``block`` tokens (a multiple of 32): ``(y [B, V], bmax [B, ceil(V / block)])``, ``bmax``
        equal to :func:`vllm_csv.ops.select.block_max` of ``y`` (NaN propagates)."""
        return self._op_for(x)(x, self.packed, self.zsum, self.s, self.vocab_size, self.hidden_size, block)

    def kernel_for(self, rows: int) -> str:
        """Which kernel a batch of ``rows`` rows runs: ``"amx"`` from :data:`AMX_FROM` rows where the
        CPU has AMX-INT8, ``"avx2"`` where it has no AVX512-VNNI, else ``"vnni"``."""
        if self.backend == "avx2":
            return "avx2"
        return "amx" if self._amx is not None and rows >= AMX_FROM else "vnni"

    def _op_for(self, x: torch.Tensor):
        return self._amx if self.kernel_for(x.shape[0]) == "amx" else self._op


def int8_vnni_linear_ref(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Torch reference of :meth:`VnniInt8Linear.linear`: ``c`` from the last column, then
    :func:`~vllm_csv.ops.fbgemm.packed_int8_linear_ref`."""
    d = q.shape[1]
    if x.shape[0] == 0:
        return torch.empty((0, q.shape[0]), dtype=torch.float32)
    p, c = act7_decode(x, d, "int8_vnni_linear")
    return packed_int8_linear_ref(p, q, s, c)


@fake("pack_int8_vnni")
def _(q):
    V, d = q.shape
    return q.new_empty(-(-V // PANEL), -(-d // GROUP), 2, PANEL // 2, GROUP)


def _int8_linear_fake(x, packed, zsum, s, V, d, block):
    return s.new_empty(x.shape[0], V), s.new_empty(x.shape[0], -(-V // block) if block else 0)


for _name in ("int8_vnni_linear", "int8_amx_linear", "int8_avx2_linear"):  # (one op on three instruction sets)
    fake(_name)(_int8_linear_fake)
