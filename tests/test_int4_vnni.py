"""The int4 screen (csrc/cpu/int4_vnni.cpp: AVX512-VNNI, else AVX2; vllm_csv/ops/int4_vnni.py,
vllm_csv/screens/int4.py): the GEMM bit for bit against its float64 reference over head shapes x
batches x scales x extremes, its refusal of other inputs; the screen's bound on adversarial
inputs, certified top-k == dense top-k, a broken bound that the same checks catch; and the
``auto`` screen's choice by batch size."""

import pytest
import torch

from test_screen_fbgemm import (adversarial_hidden, adversarial_weights, check_bound,
                                nonfinite_rows_do_not_disturb_the_others, topk_equals_dense)
from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.errors import CSVError
from vllm_csv.ops import build, int4_vnni
from vllm_csv.ops.fbgemm import act7_layout
from vllm_csv.screens import make_screen
from vllm_csv.testing.exact import dense_topk
from vllm_csv.testing.heads import hidden_near_rows, peaked_head

pytestmark = pytest.mark.skipif(int4_vnni.unavailable_reason() is not None,
                                reason=f"int4 VNNI kernel unavailable: {int4_vnni.unavailable_reason()}")


def extreme_weights(V, d, g):
    """int4 rows at +-7 (the accumulator's extremes) among random ones; fp16 scales from the
    smallest normal to large."""
    q = torch.randint(-7, 8, (V, d), dtype=torch.int8, generator=g)
    q[0], q[1 % V] = 7, -7
    if V > 2:
        q[2, ::2], q[2, 1::2] = -7, 7
    G = -(-d // int4_vnni.GROUP)
    s = (torch.rand(V, G, generator=g) * 3).exp().mul(2.0**-14).half()
    s[0, 0] = 2.0**-14
    s[1 % V] = 1000.0
    return q, s


@pytest.mark.parametrize("V,d", [(1, 1), (31, 3), (32, 32), (33, 33), (1000, 7), (4099, 64), (2053, 1024),
                                 (515, 2048), (129, 4099)])
def test_bit_exact_against_reference(V, d):
    g = torch.Generator().manual_seed(V * 11 + d)
    q, s = extreme_weights(V, d, g)
    gemm = int4_vnni.VnniInt4Linear(q, s)
    for B in (1, 2, 3, 7, 8, 9, 17):
        p = torch.randint(-64, 64, (B, d), generator=g).float()
        p[0] = 63.0
        if B > 1:
            p[1] = -64.0
        for c in (1.0, 2.0**-14, 2.0**-3, 2.0**40):
            x = act7_layout(p, c)
            assert torch.equal(gemm.linear(x), int4_vnni.int4_linear_ref(x, q, s)), (B, c)


@pytest.mark.skipif(not build.cpu_supports("avx2_fma_f16c"), reason="this CPU has no AVX2 with FMA and F16C")
@pytest.mark.parametrize("V,d", [(1, 1), (7, 3), (31, 31), (33, 33), (47, 65), (1001, 100), (4099, 130), (515, 1027)])
def test_avx2_kernel_equals_the_reference_bit_for_bit(V, d):
    """The AVX2 kernel (int4_avx2_linear: nibbles unpacked with and/shift, vpmaddubsw into int16
    over a group, vpmaddwd by ones; run whatever the CPU has) on the VNNI kernel's layout: V not
    a multiple of 8 or 32 (masked tails), d not a multiple of the 32-column group or of 4, every
    batch 1..9 (tiles of 2 rows), the extremes, scales up to overflow; against the reference
    and, where the CPU has it, the VNNI kernel, bit for bit."""
    g = torch.Generator().manual_seed(V * 13 + d)
    q, s = extreme_weights(V, d, g)
    s[0] = 2047 / 1024  # a full fp16 significand: with an odd A of 14 bits, s A needs 25 (one FMA rounds once)
    gemm = int4_vnni.VnniInt4Linear(q, s)
    ops = build.load_ops()
    for B in range(1, 10):
        p = torch.randint(-64, 64, (B, d), generator=g).float()
        p[0] = 63.0
        p[0, ::32] = 62.0  # A = 63 * 7 * 32 - 7 on row 0: odd
        if B > 1:
            p[1] = -64.0
        for c in (2.0**-14, 1.0, 2.0**100):
            x = act7_layout(p, c)
            y = ops.int4_avx2_linear(x, gemm.packed, gemm.scales, V, d)
            want = int4_vnni.int4_linear_ref(x, q, s)
            assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.nan_to_num(), want.nan_to_num()), (B, c)
            if build.cpu_supports("avx512_vnni_f16c"):
                v = ops.int4_vnni_linear(x, gemm.packed, gemm.scales, V, d)
                assert torch.equal(y.view(torch.int32), v.view(torch.int32)), (B, c)


def test_refuses_inputs_outside_the_layout():
    g = torch.Generator().manual_seed(0)
    q, s = extreme_weights(64, 40, g)
    gemm = int4_vnni.VnniInt4Linear(q, s)
    x = act7_layout(torch.randint(-64, 64, (2, 40), generator=g).float(), 0.5)
    for bad in (x * 3, x + 0.1, torch.cat([x[:, :40], x[:, 40:] * 2], 1)):
        with pytest.raises(RuntimeError):
            gemm.linear(bad.contiguous())
        with pytest.raises(RuntimeError):
            int4_vnni.int4_linear_ref(bad, q, s)
    with pytest.raises(RuntimeError):
        torch.ops.vllm_csv_cpu.pack_int4_vnni(torch.full((4, 4), 8, dtype=torch.int8))  # outside [-7, 7]


def int4_screen(W, b=None):
    from vllm_csv.screens.int4 import VnniInt4Screen

    return VnniInt4Screen(W, b)


@pytest.mark.parametrize("V,d", [(1, 1), (7, 3), (997, 65), (4099, 129), (2053, 1031)])
@pytest.mark.parametrize("hscale", [1e-30, 1e-6, 1.0, 1e30])
def test_bound_holds_on_adversarial_inputs(V, d, hscale):
    g = torch.Generator().manual_seed(V * 5 + d)
    W = adversarial_weights(V, d, g)
    if V > 10:
        W[10, ::7] *= 1e4  # outlier columns inside a group
    screen = int4_screen(W)
    h = adversarial_hidden(d, g) * hscale
    check_bound(screen, W, h)  # mixed norms: per-row scaling after the GEMM
    for row in h:  # one row at a time: the exponent folded into the activation scale
        check_bound(screen, W, row[None])


def test_bound_holds_with_bias_tiny_weights_and_deferred_scale():
    g = torch.Generator().manual_seed(1)
    V, d = 1001, 77
    W = torch.randn(V, d, generator=g)
    W[:500] *= 1e-9  # scales at fp16's smallest normal: q rounds to 0 or +-1
    b = torch.randn(V, generator=g)
    screen = int4_screen(W)
    for hs in (1e-30, 1e-3, 1.0):
        h = torch.randn(6, d, generator=g) * hs
        h[1] *= 1e20
        check_bound(screen, W, h)
        out = screen.center_radius(h, defer_row_scale=True)
        if out.row_scale is not None:  # rows with different exponents: unscaled, the same product
            assert torch.equal(out.y * out.row_scale[:, None], screen.center_radius(h).y)
    check_bound(int4_screen(W, b), W, torch.randn(6, d, generator=g), b)


def test_nonfinite_rows_and_heads():
    W = nonfinite_rows_do_not_disturb_the_others(int4_screen)
    W[3, 3] = float("nan")
    with pytest.raises(CSVError):
        int4_screen(W)
    W[3, 3] = 1e9  # a scale beyond fp16
    with pytest.raises(CSVError):
        int4_screen(W)
    assert make_screen("int4", W, None).name == "int4"  # the torch reference takes it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V,d,bias", [(5003, 64, False), (4099, 129, True), (1531, 1030, False)])
def test_certified_topk_equals_dense(dtype, V, d, bias):
    W, g = peaked_head(V, d, seed=V + d, dtype=dtype)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype) if bias else None
    head = CertifiedHead(W, b, config=HeadConfig(screen="int4", budget=1.0))
    assert head.screen_backend == ("vnni" if build.cpu_supports("avx512_vnni_f16c") else "avx2")
    topk_equals_dense(head, W, b, g)


def test_broken_bounds_are_caught():
    """Understate the bound, or make the copy cruder than its radius: the comparison with the
    dense head finds wrong tokens; the intact screen has none."""
    from test_screen_fbgemm import understated_bound_is_caught, wrong_tokens

    g = torch.Generator().manual_seed(0)
    W = torch.randn(4096, 64, generator=g)
    h = torch.randn(1024, 64, generator=g)
    understated_bound_is_caught(CertifiedHead(W, config=HeadConfig(screen="int4", budget=1.0)), W, h)
    # a copy cruder than its radius: half the rows zeroed, on a peaked head (hidden states near
    # its rows), where a zeroed winner then falls below the certified runner-up
    W, g = peaked_head(4096, 64, seed=3)
    h = hidden_near_rows(W, 512, g)
    head = CertifiedHead(W, config=HeadConfig(screen="int4", budget=1.0))
    assert wrong_tokens(head, W, h) == 0
    q, s = int4_vnni.quantize_int4(W)
    gone = torch.rand(q.shape[0], generator=g) < 0.5
    head.screen.gemm = int4_vnni.VnniInt4Linear(q.masked_fill(gone[:, None], 0), s)
    assert wrong_tokens(head, W, h) > 0


def test_auto_takes_int4_for_one_row_and_int8_for_more(monkeypatch):
    from vllm_csv.screens import by_batch
    from vllm_csv.screens.by_batch import ByBatchScreen
    from vllm_csv.screens.fbgemm import FbgemmInt8Screen
    from vllm_csv.screens.int4 import VnniInt4Screen

    W, g = peaked_head(2048, 96, seed=5, dtype=torch.bfloat16)
    assert isinstance(make_screen("auto", W, None), FbgemmInt8Screen)  # a small head: one screen
    monkeypatch.setattr(by_batch, "MIN_WEIGHTS", W.numel())
    screen = make_screen("auto", W, None)
    assert isinstance(screen, ByBatchScreen) and screen.name == "int8+int4"
    assert isinstance(screen.small, VnniInt4Screen) and isinstance(screen.large, FbgemmInt8Screen)
    h = hidden_near_rows(W, 3, g).float()
    assert screen.center_radius(h[:1]).radius is screen.small.radius
    assert screen.center_radius(h).radius is screen.large.radius
    head = CertifiedHead(W, config=HeadConfig(budget=1.0, off_switch=False))
    # the sampler's certificate takes the tight (int8) copy at every batch size
    from vllm_csv.sampling.head_adapter import HeadAdapter

    def refuse(*a, **k):
        raise AssertionError("the int4 copy was used for the sampler's bounds")
    monkeypatch.setattr(head.screen.small, "center_radius", refuse)
    lo, hi, _, finite = HeadAdapter(head).intervals(h[:1].to(W.dtype))
    assert bool(finite.all()) and bool((lo <= hi).all())
    monkeypatch.undo()
    monkeypatch.setattr(by_batch, "MIN_WEIGHTS", W.numel())
    for B in (1, 3, 1):  # alternating batch sizes: each call its own screen's bound
        hb = h[:B].to(W.dtype)
        res = head.topk(hb, 1)
        assert bool(res.certified.all()) and torch.equal(res.ids, dense_topk(W, None, hb, 1)[0])


def test_one_rounding_a_group():
    """Each group's ``z + s A`` is one fused multiply-add (one rounding), in the reference and in
    every kernel: a row whose second group's product ``s A`` needs 25 bits (``s = 2047 / 1024``, a
    full fp16 significand, times ``A = 14105``, odd) and whose first group cancels all but its
    last bits (``z = 2 * -14098``) gives exactly ``231 / 1024``; rounding the product first (a
    multiply then an add) would give ``230 / 1024`` or ``232 / 1024``."""
    d, G = 64, int4_vnni.GROUP
    q = torch.zeros((3, d), dtype=torch.int8)
    q[0, :G], q[0, G:] = -7, 7
    s = torch.ones((3, 2), dtype=torch.float16)
    s[0, 0], s[0, 1] = 2.0, 2047 / 1024
    p = torch.full((1, d), 63.0)
    p[0, :2] = 62.0  # group 0: sum p = 2014, A = -7 * 2014 = -14098
    p[0, G] = 62.0  # group 1: sum p = 2015, A = 7 * 2015 = 14105
    x = act7_layout(p, 1.0)
    want = 231 / 1024
    assert int4_vnni.int4_linear_ref(x, q, s)[0, 0].item() == want
    gemm = int4_vnni.VnniInt4Linear(q, s)
    assert gemm.linear(x)[0, 0].item() == want, gemm.backend
    if build.cpu_supports("avx2_fma_f16c"):
        assert build.load_ops().int4_avx2_linear(x, gemm.packed, gemm.scales, 3, d)[0, 0].item() == want


def test_auto_keeps_int8_alone_on_avx2_kernels_at_one_thread(monkeypatch):
    """``auto``'s one-row int4 screen is skipped where it was measured not to pay (the AVX2 kernels,
    one thread: ``by_batch.small_screen_pays``) and taken otherwise (both branches: natively, and
    under ``VLLM_CSV_CPU_ISA=avx2``, which tests/test_cpu_isa.py runs this file with)."""
    from vllm_csv.screens import by_batch
    from vllm_csv.screens.by_batch import ByBatchScreen, small_screen_pays
    from vllm_csv.screens.fbgemm import FbgemmInt8Screen

    assert not small_screen_pays("avx2", 1) and small_screen_pays("avx2", 2)
    assert small_screen_pays("vnni", 1) and small_screen_pays("fbgemm", 1) and small_screen_pays(None, 1)
    W, _ = peaked_head(2048, 96, seed=5, dtype=torch.bfloat16)
    monkeypatch.setattr(by_batch, "MIN_WEIGHTS", W.numel())
    backend = make_screen("int8", W, None).backend
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        screen = make_screen("auto", W, None)
        if backend == "avx2" and threads == 1:
            assert isinstance(screen, FbgemmInt8Screen)
        else:
            assert isinstance(screen, ByBatchScreen)
