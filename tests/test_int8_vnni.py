"""The int8 GEMM (csrc/cpu/int8_vnni.cpp, int8_avx2.cpp; vllm_csv/ops/int8_vnni.py) against its torch
reference and FBGEMM, bit for bit, over head shapes x batches x scales x code extremes, and its
refusal of inputs outside the 7-bit layout. It runs the AVX512-VNNI kernel where the CPU has it,
else the AVX2 one (under VLLM_CSV_CPU_ISA=avx2 every test here runs that: tests/test_cpu_isa.py);
the AVX2 kernel is also tested on its own against the reference and the VNNI kernel."""

import pytest
import torch

from vllm_csv.ops import build, select
from vllm_csv.ops import int8_vnni as vnni
from vllm_csv.ops.fbgemm import PackedInt8Linear, act7_layout, packed_int8_linear_ref
from vllm_csv.screens.fbgemm import quantize_rows

pytestmark = pytest.mark.skipif(vnni.unavailable_reason(8, 8) is not None,
                                reason=f"int8 kernel unavailable: {vnni.unavailable_reason(8, 8)}")


def extreme_inputs(B, d, g):
    """Random 7-bit codes, with rows at every extreme: all -64, all 63, alternating."""
    p = torch.randint(-64, 64, (B, d), generator=g).float()
    for i, row in enumerate((-64.0, 63.0, None)[:B]):
        if row is None:
            p[i, ::2], p[i, 1::2] = -64, 63
        else:
            p[i] = row
    return p


def extreme_weights(V, d, g):
    """int8 rows at +-127 / -128 (the accumulator's extremes) among random ones."""
    q = torch.randint(-128, 128, (V, d), dtype=torch.int8, generator=g)
    q[0], q[1 % V] = 127, -128
    if V > 2:
        q[2, ::2], q[2, 1::2] = -128, 127
    return q


# (V, d): real head shapes cut to test size, and every remainder of the 32-row panels and the
# 4-column groups
@pytest.mark.parametrize("V,d", [(1, 1), (31, 3), (32, 4), (33, 5), (1000, 7), (4099, 64), (2053, 1024),
                                 (515, 2048), (129, 4099)])
def test_bit_exact_against_reference_and_fbgemm(V, d):
    g = torch.Generator().manual_seed(V * 7 + d)
    q = extreme_weights(V, d, g)
    s = torch.rand(V, generator=g) * 0.01 + 2.0**-20
    gemm = vnni.VnniInt8Linear(q, s)
    fb = PackedInt8Linear(q, s)
    for B in (1, 2, 3, 7, 8, 9, 16, 17):
        p = extreme_inputs(B, d, g)
        for c in (1.0, 2.0**-14, 2.0**-3, 2.0**40):
            x = act7_layout(p, c)
            y = gemm.linear(x)
            assert torch.equal(y, packed_int8_linear_ref(p, q, s, c)), (B, c)
            assert torch.equal(y, vnni.int8_vnni_linear_ref(x, q, s))
            assert torch.equal(y, fb.linear(x)), (B, c)
            y2, bmax = gemm.linear_block_max(x, build.BLOCK)
            assert torch.equal(y2, y) and torch.equal(bmax, select.block_max(y)), (B, c)


def test_integer_exact_at_the_accumulator_extremes():
    """d = 2048 (fl(A) exact below 2^24): every code and weight at the extremes, so the int32
    sums reach 127 * 128 * d; y / s recovers the integer product."""
    V, d = 64, 2048
    q = torch.full((V, d), 127, dtype=torch.int8)
    q[1::2] = -128
    s = torch.ones(V)
    p = torch.stack([torch.full((d,), -64.0), torch.full((d,), 63.0)])
    y = vnni.VnniInt8Linear(q, s)(p, 1.0)
    assert torch.equal(y.double(), p.double() @ q.double().T)


@pytest.mark.parametrize("block", [32, 64, 256, 512])
def test_block_maxima_with_inf_and_nan(block):
    """Scales that overflow (c s_i = inf) make y inf, -inf, and NaN where the integer is 0: the
    fused block maxima still equal torch's amax of y (NaN propagates, -inf stays)."""
    g = torch.Generator().manual_seed(block)
    V, d = 1000, 8
    q = torch.randint(-3, 4, (V, d), dtype=torch.int8, generator=g)
    q[5] = 0  # A = 0 -> 0 * inf = NaN
    s = torch.full((V,), 2.0**-20)
    s[::97] = 2.0**100  # times c = 2^40: inf
    gemm = vnni.VnniInt8Linear(q, s)
    p = torch.randint(-64, 64, (10, d), generator=g).float()
    p[3] = 0  # every A = 0 on this row
    y, bmax = gemm.linear_block_max(act7_layout(p, 2.0**40), block)
    assert bool(y.isnan().any()) and bool(y.isinf().any())
    same_with_nan(y, packed_int8_linear_ref(p, q, s, 2.0**40))
    same_with_nan(bmax, torch.stack([y[:, i:i + block].amax(1) for i in range(0, V, block)], 1))


def same_with_nan(a, b):
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_batch_zero_and_threads():
    g = torch.Generator().manual_seed(1)
    q = extreme_weights(777, 40, g)
    s = torch.rand(777, generator=g) + 0.5
    gemm = vnni.VnniInt8Linear(q, s)
    assert gemm(torch.empty(0, 40), 1.0).shape == (0, 777)
    p = extreme_inputs(5, 40, g)
    want = packed_int8_linear_ref(p, q, s, 0.5)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(gemm(p, 0.5), want)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bad", ["code_64", "code_-65", "fraction", "scale_not_pow2", "columns", "nan", "shape"])
def test_refuses_inputs_outside_the_layout(bad):
    """Every call checks the no-saturation condition: codes in [0, 127] (p in [-64, 63]), integers,
    c a power of two shared by the rows; anything else raises instead of returning numbers."""
    g = torch.Generator().manual_seed(2)
    d = 12
    q = extreme_weights(40, d, g)
    gemm = vnni.VnniInt8Linear(q, torch.ones(40))
    x = act7_layout(extreme_inputs(3, d, g), 0.25)
    if bad == "code_64":
        x[1, 3] = 64 * 0.25
    elif bad == "code_-65":
        x[2, 0] = -65 * 0.25
    elif bad == "fraction":
        x[0, 5] = 0.125
    elif bad == "scale_not_pow2":
        x[:, :d] *= 1.5
        x[:, d:] *= 1.5
    elif bad == "columns":
        x[2, d] = -64 * 0.5
    elif bad == "nan":
        x[1, 1] = float("nan")
    else:
        x = x[:, 1:].contiguous()
    with pytest.raises(RuntimeError, match="int8_vnni_linear|does not match|float32"):
        gemm.linear(x)
    if bad != "shape":
        with pytest.raises(RuntimeError, match="7-bit integers"):
            vnni.int8_vnni_linear_ref(x, q, torch.ones(40))


def test_screen_uses_it_and_the_fake_traces():
    from vllm_csv.screens.fbgemm import FbgemmInt8Screen

    W = torch.randn(300, 20)
    assert FbgemmInt8Screen(W, None).backend == ("vnni+amx" if vnni.amx_available() else "vnni"
                                                 if build.cpu_supports("avx512_vnni") else "avx2")
    q, s = quantize_rows(W)
    gemm = vnni.VnniInt8Linear(q, s)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(act7_layout(torch.zeros(3, 20), 1.0))
        out = build.load_ops().int8_vnni_linear(x, mode.from_tensor(gemm.packed), mode.from_tensor(gemm.zsum),
                                                   mode.from_tensor(gemm.s), 300, 20, 256)[0]
    assert out.shape == (3, 300) and out.dtype == torch.float32


amx_only = pytest.mark.skipif(not vnni.amx_available(), reason="this CPU has no AMX-INT8 (or may not use it)")


@amx_only
@pytest.mark.parametrize("V,d", [(1, 1), (33, 63), (32, 64), (100, 65), (1000, 100), (4099, 128), (2053, 1024),
                                 (515, 1156), (129, 2048)])
def test_amx_equals_vnni_bit_for_bit(V, d):
    """The AMX kernel against the VNNI kernel (and the torch reference) on the same packed weight:
    every batch size across the 16-row tiles, d with and without groups past the last whole
    64 (those go through vpdpbusd), code and weight extremes, scales up to overflow (inf, and
    NaN where the integer is 0), with and without the block maxima."""
    g = torch.Generator().manual_seed(V * 13 + d)
    q = extreme_weights(V, d, g)
    q[min(3, V - 1)] = 0
    s = torch.rand(V, generator=g) * 0.01 + 2.0**-20
    s[::37] = 2.0**100
    gemm = vnni.VnniInt8Linear(q, s)
    ops = build.load_ops()
    for B in (1, 2, 3, 4, 8, 15, 16, 17, 31, 32, 33, 48):
        p = extreme_inputs(B, d, g)
        for c in (2.0**-14, 1.0, 2.0**40):
            x = act7_layout(p, c)
            for block in (0, 32, build.BLOCK):
                args = (x, gemm.packed, gemm.zsum, gemm.s, V, d, block)
                y_v, m_v = ops.int8_vnni_linear(*args)
                y_a, m_a = ops.int8_amx_linear(*args)
                same_with_nan(y_a, y_v)
                same_with_nan(m_a, m_v)
            same_with_nan(y_a, vnni.int8_vnni_linear_ref(x, q, s))


@amx_only
def test_amx_picked_by_batch_and_refuses_bad_input():
    """linear() takes the AMX kernel from AMX_FROM rows (a broken AMX op shows there only), and the
    AMX op checks the 7-bit layout on every call as the VNNI op does."""
    g = torch.Generator().manual_seed(5)
    V, d = 300, 128
    q = extreme_weights(V, d, g)
    s = torch.rand(V, generator=g) + 0.5
    gemm = vnni.VnniInt8Linear(q, s)
    assert gemm.backend == "vnni+amx"
    calls = []
    real = gemm._amx
    gemm._amx = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    for B in (1, vnni.AMX_FROM - 1, vnni.AMX_FROM, 20):
        p = extreme_inputs(B, d, g)
        assert torch.equal(gemm(p, 0.5), packed_int8_linear_ref(p, q, s, 0.5)), B
    assert calls == [vnni.AMX_FROM, 20]
    assert [gemm.kernel_for(B) for B in (1, vnni.AMX_FROM - 1, vnni.AMX_FROM, 20)] == ["vnni", "vnni", "amx", "amx"]
    x = act7_layout(extreme_inputs(8, d, g), 0.25)
    x[3, 7] = 64 * 0.25
    with pytest.raises(RuntimeError, match="7-bit integers"):
        build.load_ops().int8_amx_linear(x, gemm.packed, gemm.zsum, gemm.s, V, d, 0)


@pytest.mark.parametrize("distance", [0, 64, 4096, 1 << 20])
def test_software_prefetch_changes_no_result(distance):
    """The kernels' prefetch distance (csrc/cpu/int8_vnni.cpp, prefetch_ahead; 0 = none) is a hint
    only: the int8 kernel (VNNI and, where the CPU has it, AMX) and the int4 kernel give the same
    bits at every distance, including one far past the weight's end (a prefetch never faults).
    Bad distances are refused."""
    from vllm_csv.ops import int4_vnni

    ops = build.load_ops()
    g = torch.Generator().manual_seed(distance + 1)
    V, d = 4099, 1024
    q = extreme_weights(V, d, g)
    gemm = vnni.VnniInt8Linear(q, torch.rand(V, generator=g) * 0.01 + 2.0**-20)
    q4 = (int4_vnni.VnniInt4Linear(*int4_vnni.quantize_int4(torch.randn(V, d, generator=g)))
          if int4_vnni.unavailable_reason() is None else gemm)  # (no int4 kernel here: the int8 one twice)
    xs = [act7_layout(extreme_inputs(B, d, g), 2.0**-7) for B in (1, 3, vnni.AMX_FROM, 8, 17)]
    before = ops.set_prefetch_ahead(0)
    try:
        want = [(gemm.linear(x), gemm.linear_block_max(x, build.BLOCK), q4.linear(x)) for x in xs]
        assert ops.set_prefetch_ahead(distance) == 0
        for x, (y, (y2, bmax), y4) in zip(xs, want):
            got2, gotmax = gemm.linear_block_max(x, build.BLOCK)
            assert torch.equal(gemm.linear(x), y) and torch.equal(got2, y2) and torch.equal(gotmax, bmax)
            assert torch.equal(q4.linear(x), y4)
        for bad in (-64, 100, (1 << 20) + 64):
            with pytest.raises(RuntimeError, match="prefetch distance"):
                ops.set_prefetch_ahead(bad)
    finally:
        ops.set_prefetch_ahead(before)


def same_bits(a, b):
    """Equal bit for bit (NaN where the other is NaN, whatever its payload; every other value,
    the sign of zero included, by its bits)."""
    assert torch.equal(a.isnan(), b.isnan())
    keep = ~a.isnan()
    assert torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))


@pytest.mark.skipif(not build.cpu_supports("avx2_fma"), reason="this CPU has no AVX2 with FMA")
@pytest.mark.parametrize("V,d", [(1, 1), (7, 3), (31, 5), (33, 7), (47, 13), (1001, 37), (4099, 130), (515, 1027)])
def test_avx2_kernel_equals_the_reference_bit_for_bit(V, d):
    """The AVX2 kernel (int8_avx2_linear: vpmaddubsw, vpmaddwd; run whatever the CPU has) on the
    VNNI kernel's packed weight: V not a multiple of 32 (masked 8-row tails), d not a multiple
    of 4, every batch 1..9 (tiles of 4 rows), code and weight extremes, scales that overflow
    (inf, and NaN where the integer is 0), y and block maxima against the torch reference, and
    against the VNNI kernel where the CPU has it."""
    g = torch.Generator().manual_seed(V * 11 + d)
    q = extreme_weights(V, d, g)
    q[min(3, V - 1)] = 0  # A = 0: NaN times an infinite scale
    s = torch.rand(V, generator=g) * 0.01 + 2.0**-20
    s[::37] = 2.0**100  # times c = 2^40: inf
    gemm = vnni.VnniInt8Linear(q, s)
    ops = build.load_ops()
    threads = torch.get_num_threads()
    try:
        for B in range(1, 10):
            torch.set_num_threads(1 + B % 3)
            p = extreme_inputs(B, d, g)
            if B > 4:
                p[4] = 0  # every A = 0 on this row
            for c in (2.0**-14, 1.0, 2.0**40):
                x = act7_layout(p, c)
                want = packed_int8_linear_ref(p, q, s, c)
                for block in (0, 32, build.BLOCK):
                    args = (x, gemm.packed, gemm.zsum, gemm.s, V, d, block)
                    y, bmax = ops.int8_avx2_linear(*args)
                    same_bits(y, want)
                    same_with_nan(bmax, torch.stack([want[:, i:i + block].amax(1) for i in range(0, V, block)], 1)
                                  if block else want[:, :0])
                    if build.cpu_supports("avx512_vnni"):
                        y_v, m_v = ops.int8_vnni_linear(*args)
                        same_bits(y, y_v)
                        same_bits(bmax, m_v)
    finally:
        torch.set_num_threads(threads)
    if V > 37:  # (a scale that overflows on a row that is not all zeros)
        assert bool(want.isnan().any()) and bool(want.isinf().any())
