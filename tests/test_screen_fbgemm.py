"""The int8 screen on x86 (vllm_csv/screens/fbgemm.py), with each GEMM backend (FBGEMM, and the
AVX512-VNNI kernel where this CPU has it): its bound, bit for bit against float64, adversarial
inputs, certified top-k == dense top-k, a broken bound that the same checks catch, and a clean
refusal where the op is missing."""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import vllm_csv.ops.fbgemm as fbops
import vllm_csv.ops.int8_vnni as vnni
import vllm_csv.screens.fbgemm as fbscreen
from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.errors import CSVError
from vllm_csv.ops.fbgemm import packed_int8_linear_ref
from vllm_csv.screens import SCREENS, hidden_norm_upper, make_screen
from vllm_csv.screens.fbgemm import FbgemmInt8Screen, quantize_rows
from vllm_csv.screens.half import HalfScreen
from vllm_csv.screens.quantized import QuantizedScreen
from vllm_csv.testing.exact import dense_topk, same_bits
from vllm_csv.testing.heads import hidden_near_rows, peaked_head

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.skipif(fbops.unavailable_reason(8, 8) is not None,
                                reason=f"FBGEMM unavailable: {fbops.unavailable_reason(8, 8)}")
_OURS = vnni.unavailable_reason(8, 8) is None
BACKENDS = (["fbgemm"] + (["vnni"] if _OURS and vnni.cpu_supports("avx512_vnni") else [])
            + (["vnni+amx"] if vnni.amx_available() else [])
            + (["avx2"] if _OURS and vnni.cpu_supports("avx2_fma") else []))


@pytest.fixture(autouse=True, params=BACKENDS)
def backend(request, monkeypatch):
    """Every test here runs with each GEMM backend this machine has (the screen picks VNNI, with
    AMX from a few rows, where it can, else the AVX2 kernel: pinning FBGEMM, VNNI alone, or the
    AVX2 kernel as on a CPU without AVX-512, hides the others)."""
    if request.param == "fbgemm":
        monkeypatch.setattr(vnni, "unavailable_reason", lambda d, V: "pinned to FBGEMM by the test")
    elif request.param == "vnni":
        monkeypatch.setattr(vnni, "amx_available", lambda: False)
    elif request.param == "avx2":
        has = vnni.cpu_supports
        monkeypatch.setattr(vnni, "cpu_supports", lambda f: f not in ("avx512_vnni", "amx_int8") and has(f))
    return request.param


def check_bound(screen, W, h, b=None):
    """``|<w_i, h_b> + b_i - y_bi| <= r_i ||h_b|| + n_i e_b + rel |y_bi - b_i|`` in float64, with
    the screen's own fp32 terms and nothing added (plus one fp32 rounding of the bias add)."""
    out = screen.center_radius(h)
    exact = h.double() @ W.double().T
    y = out.y.double()
    y0 = y if b is None else y - b.double()
    if b is not None:
        exact = exact + b.double()
    bound = (out.radius.double()[None] * hidden_norm_upper(h).double()[:, None]
             + out.n.double()[None] * out.e.double()[:, None] + out.rel * y0.abs())
    if b is not None:
        bound = bound + 2.0**-24 * y.abs() + 2.0**-149  # the fp32 bias add
    err = (exact - y).abs()
    ok = err <= bound
    assert bool(ok.all()), f"bound broken at {(~ok).nonzero()[:5].tolist()}: err {err[~ok][:5]}, bound {bound[~ok][:5]}"
    return out, err, bound


def adversarial_hidden(d, g):
    """Rows at the code extremes, outliers, ties, zeros, tiny and huge norms, mixed in one batch."""
    rows = [torch.randn(d, generator=g)]
    r = torch.randn(d, generator=g)
    r[0] = r.abs().max() * 1.0001  # max|h| just above a power of two's neighbourhood
    rows.append(r)
    rows.append(torch.full((d,), 1.0))  # max|h| a power of two: every code at +63 (clamped from 64)
    rows.append(torch.full((d,), -1.0))  # every code at -64
    alt = torch.ones(d)
    alt[::2] = -1
    rows.append(alt * 0.75)  # alternating extremes
    out = torch.randn(d, generator=g)
    out[d // 2] = 1e4 * out.abs().max()  # one outlier dimension
    rows.append(out)
    rows.append(torch.full((d,), 0.3))  # ties: every coordinate equal
    rows.append(torch.zeros(d))
    rows.append(torch.randn(d, generator=g) * (127.5 / 64))  # values on the .5 rounding boundary scale
    return torch.stack(rows)


def adversarial_weights(V, d, g):
    """``[V, d]`` random head rows with, from ``V > 10`` on, duplicate rows (3-5 equal to 2), a
    zero row (7), a small and a large row (8, 9)."""
    W = torch.randn(V, d, generator=g) / d**0.5
    if V > 10:
        W[3:6] = W[2]  # duplicate rows
        W[7] = 0.0  # zero row
        W[8] *= 1e-3  # a small row, a large row
        W[9] *= 1e3
    return W


@pytest.mark.parametrize("V,d", [(1, 1), (7, 3), (997, 65), (4099, 129), (2053, 1031)])
@pytest.mark.parametrize("hscale", [1e-30, 1e-6, 1.0, 1e30])
def test_bound_holds_on_adversarial_inputs(V, d, hscale):
    g = torch.Generator().manual_seed(V * 7 + d)
    W = adversarial_weights(V, d, g)
    screen = FbgemmInt8Screen(W, None)
    h = adversarial_hidden(d, g) * hscale
    check_bound(screen, W, h)  # mixed norms: per-row scaling after the GEMM
    for row in h:  # one row at a time: the exponent folded into FBGEMM's activation scale
        check_bound(screen, W, row[None])


def test_bound_holds_with_bias_and_tiny_weights_that_underflow():
    g = torch.Generator().manual_seed(1)
    V, d = 1001, 77
    W = torch.randn(V, d, generator=g)
    W[:500] *= 1e-33  # products y * t / 64 fall below 2^-126: the underflow term of e_b
    b = torch.randn(V, generator=g)
    screen = FbgemmInt8Screen(W, None)
    for hs in (1e-12, 1e-3, 1.0):
        h = torch.randn(6, d, generator=g) * hs
        h[1] *= 1000
        check_bound(screen, W, h)
    check_bound(FbgemmInt8Screen(W, b), W, torch.randn(6, d, generator=g), b)


def nonfinite_rows_do_not_disturb_the_others(make):
    """Hidden rows with NaN / inf beside finite ones, on the screen ``make(W)`` of a random head:
    the finite rows' centers are the ones they get alone, the others' ``e`` is not finite (the
    runtime's finite check sends them dense). Returns ``W``."""
    g = torch.Generator().manual_seed(2)
    W = torch.randn(513, 40, generator=g)
    screen = make(W)
    h = torch.randn(5, 40, generator=g)
    ref = screen.center_radius(h[1:3]).y
    bad = h.clone()
    bad[0, 3], bad[3, 0], bad[4, 5] = float("nan"), float("inf"), -float("inf")
    out = screen.center_radius(bad)
    assert torch.equal(out.y[1:3], ref)
    assert not torch.isfinite(out.e[[0, 3, 4]]).any()
    return W


def test_nonfinite_rows_do_not_disturb_the_others():
    nonfinite_rows_do_not_disturb_the_others(lambda W: FbgemmInt8Screen(W, None))


def test_deferred_row_scale_is_the_same_product():
    """``defer_row_scale``: rows with different exponents (huge, tiny: subnormal products
    included) come back unscaled; ``fl(y * row_scale)`` is bit for bit the scaled center, and
    the bound terms are unchanged."""
    g = torch.Generator().manual_seed(4)
    W = torch.randn(777, 48, generator=g)
    W[5] *= 1e-30  # tiny scales: products that may underflow
    screen = FbgemmInt8Screen(W, None)
    h = torch.randn(6, 48, generator=g) * torch.tensor([1.0, 1e3, 1e-3, 2.0**-100, 7.5, 0.0])[:, None]
    full = screen.center_radius(h)
    lazy = screen.center_radius(h, defer_row_scale=True)
    assert full.row_scale is None and lazy.row_scale is not None
    assert torch.equal(lazy.y * lazy.row_scale[:, None], full.y) and torch.equal(lazy.e, full.e)
    one = screen.center_radius(h[:1], defer_row_scale=True)  # one exponent: folded into the GEMM
    assert one.row_scale is None and torch.equal(one.y, full.y[:1])
    with_bias = FbgemmInt8Screen(W, torch.randn(777, generator=g))  # the bias is added to the center
    assert with_bias.center_radius(h, defer_row_scale=True).row_scale is None


@pytest.mark.parametrize("d", [64, 2053, 4099])  # d > 2064: fl(<p, q>) rounds, same bits as torch
def test_integer_gemm_is_bit_exact(d):
    g = torch.Generator().manual_seed(d)
    V = 1031
    W = torch.randn(V, d, generator=g)
    W[0] = 1.0  # q = 127 everywhere
    W[1] = -1.0
    q, s = quantize_rows(W)
    gemm = fbscreen.int8_linear(q, s)
    p = torch.randint(-64, 64, (4, d), generator=g).float()
    p[0], p[1] = -64, 63
    for c in (1.0, 2.0**-14, 2.0**-3, 2.0**40):
        assert torch.equal(gemm(p, c), packed_int8_linear_ref(p, q, s, c))
    acc = p.double() @ q.double().T
    if d <= 2048:  # exactly the integer: y / (c s_i) recovers <p_b, q_i>
        assert torch.equal((gemm(p, 1.0).double() / s.double()).round(), acc)


def test_screen_center_is_the_exact_integer_product():
    """``y_bi = fl(<p_b, q_i> s_i t_b / 64)``: built from hidden states that are exactly
    ``t p / 64``, the screen's residual is 0 and its center is the reference product."""
    g = torch.Generator().manual_seed(3)
    V, d = 2003, 96
    W = torch.randn(V, d, generator=g)
    q, s = quantize_rows(W)
    screen = FbgemmInt8Screen(W, None)
    p = torch.randint(-64, 64, (3, d), generator=g).float()
    p[:, 0] = -64  # max|h| = t exactly: t = 2^k, codes unchanged
    for k in (-3, 0, 5):
        h = p * 2.0 ** (k - 6)
        out = screen.center_radius(h)
        assert float(out.e.max()) == 0.0
        assert torch.equal(out.y, packed_int8_linear_ref(p, q, s, 2.0 ** (k - 6)))


AVX2_SCRIPT = textwrap.dedent("""
    import torch, warnings
    from vllm_csv.ops.fbgemm import PackedInt8Linear, packed_int8_linear_ref
    V, d = 512, 256
    q = torch.full((V, d), 127, dtype=torch.int8); q[1::2] = -127; q[2::4] = -128
    s = torch.rand(V) + 0.5
    p = torch.full((3, d), 63.0); p[1] = -64; p[2, ::2] = -64
    ours = torch.equal(PackedInt8Linear(q, s)(p, 1.0), packed_int8_linear_ref(p, q, s, 1.0))
    # control: the full 8-bit code range (what reduce_range avoids) saturates vpmaddubsw on AVX2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(q, torch.ones(V, dtype=torch.double),
                                                      torch.zeros(V, dtype=torch.long), 0)
    x = torch.full((1, d), 127.0); x[0, 0] = -128.0
    full = torch.ops.quantized.linear_dynamic(x, torch.ops.quantized.linear_prepack(qw, None), False)
    print(ours, torch.equal(full, (x.double() @ q.double().T).float()))
""")


def test_exact_on_the_avx2_kernel_where_full_range_codes_saturate():
    """FBGEMM_ENABLE_INSTRUCTIONS=AVX2 forces the vpmaddubsw kernel (int16 pair sums that
    saturate): the screen's 7-bit codes stay exact there, while the control with 8-bit codes
    is wrong, which shows that the AVX2 kernel really ran."""
    env = dict(os.environ, FBGEMM_ENABLE_INSTRUCTIONS="AVX2", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", AVX2_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False"], r.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V,d,bias", [(5003, 64, False), (4099, 129, True), (1531, 1030, False)])
def test_certified_topk_equals_dense(dtype, V, d, bias):
    W, g = peaked_head(V, d, seed=V + d, dtype=dtype)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype) if bias else None
    head = CertifiedHead(W, b, config=HeadConfig(screen="int8", budget=1.0))
    assert isinstance(head.screen, FbgemmInt8Screen)
    h = topk_equals_dense(head, W, b, g)
    logits, stats = head.sampler_logits(h[:8], torch.ones(8, dtype=torch.long))
    dense = torch.nn.functional.linear(h[:8], W, b)
    assert torch.equal(logits.argmax(1), dense.argmax(1)) and stats.screen == "int8"


def topk_equals_dense(head, W, b, g):
    """The certified top-2 (ids, and values bit for bit in half precision) of ``head`` equal the
    dense head's, batch by batch, on peaked, random and adversarial hidden states, and peaked rows
    certify; returns those hidden states."""
    dtype, d = W.dtype, W.shape[1]
    h = torch.cat([hidden_near_rows(W, 24, g), torch.randn(8, d, generator=g).to(dtype),
                   adversarial_hidden(d, g).to(dtype)])
    for B in (1, 8, h.shape[0]):  # batch shapes change the dense GEMM's rounding: compare per batch
        for a in range(0, h.shape[0] - B + 1, B):
            hb = h[a : a + B]
            values = dtype != torch.float32  # fp32 values come from another GEMM call: ids only
            res = head.topk(hb, 2, values=values)
            ids, vals, _ = dense_topk(W, b, hb, 2)
            assert torch.equal(res.ids if values else res.ids.sort(1).values, ids if values else ids.sort(1).values)
            if values:
                assert same_bits(res.values, vals)
    assert head.topk(h[:24], 1, values=False).certified.float().mean() > 0.9  # peaked rows certify
    return h


def wrong_tokens(head, W, h):
    ids = torch.cat([head.topk(h[i : i + 64], 1, values=False).ids for i in range(0, h.shape[0], 64)])
    return int((ids[:, 0] != torch.nn.functional.linear(h, W).argmax(1)).sum())


def understated_bound_is_caught(head, W, h):
    """The intact screen of ``head`` gives no wrong token on ``h``; with its bound (radius,
    activation term, relative term, the dense GEMM's error) understated to 0 the comparison with
    the dense head finds some."""
    assert wrong_tokens(head, W, h) == 0
    honest = head.screen.center_radius

    def shrunk(x, **kw):
        out = honest(x, **kw)
        out.radius, out.n, out.rel = out.radius * 0, out.n * 0, 0.0
        return out

    head.screen.center_radius = shrunk
    head.errors.acc_err.zero_()
    assert wrong_tokens(head, W, h) > 0


def test_broken_bounds_are_caught():
    """Understate the bound, or make the copy cruder than its radius: the same comparison with
    the dense head must find wrong tokens; the intact screen has none."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(4096, 64, generator=g)
    h = torch.randn(1024, 64, generator=g)
    head = CertifiedHead(W, config=HeadConfig(screen="int8", budget=1.0))
    assert isinstance(head.screen, FbgemmInt8Screen)
    understated_bound_is_caught(head, W, h)
    # a cruder copy with the honest radius
    head = CertifiedHead(W, config=HeadConfig(screen="int8", budget=1.0))
    q, s = quantize_rows(W)
    noise = torch.randint(-40, 41, q.shape, generator=g, dtype=torch.int16)
    head.screen.gemm = fbscreen.int8_linear((q.short() + noise).clamp(-127, 127).to(torch.int8), s)
    assert wrong_tokens(head, W, h) > 0


def test_refuses_cleanly_without_the_op(monkeypatch, caplog, backend):
    W, g = peaked_head(2003, 48, seed=1)
    h = hidden_near_rows(W, 8, g)
    screen = make_screen("auto", W.bfloat16(), None)
    assert isinstance(screen, FbgemmInt8Screen) and screen.backend == backend  # the CPU default
    monkeypatch.setattr(vnni, "unavailable_reason", lambda d, V: "no VNNI (test)")

    def missing():
        raise AttributeError("_OpNamespace 'quantized' object has no attribute 'linear_dynamic'")

    monkeypatch.setattr(fbops, "_ops", missing)
    with pytest.raises(CSVError, match="no quantized::linear_dynamic"):
        FbgemmInt8Screen(W, None)
    with caplog.at_level(logging.INFO, logger="vllm.csv_decode"):
        auto = make_screen("auto", W, None)
        int8 = make_screen("int8", W, None)
    assert isinstance(auto, HalfScreen) and isinstance(int8, QuantizedScreen)
    assert sum("no exact x86 int8 GEMM" in r.getMessage() for r in caplog.records) == 2
    head = CertifiedHead(W, config=HeadConfig(screen="auto"))
    ids, _, _ = dense_topk(W, None, h, 1)
    assert torch.equal(head.topk(h, 1).ids, ids)


def test_refuses_other_engines_and_a_failed_self_test(monkeypatch, backend):
    W, _ = peaked_head(501, 24, seed=2)
    engine = torch.backends.quantized.engine
    if "qnnpack" in torch.backends.quantized.supported_engines:
        monkeypatch.setattr(torch.backends.quantized, "engine", "qnnpack")
        if backend == "fbgemm":
            with pytest.raises(CSVError, match="engine is 'qnnpack'"):
                FbgemmInt8Screen(W, None)
        else:  # the VNNI kernel does not go through torch's quantized engine
            assert FbgemmInt8Screen(W, None).backend == backend
        monkeypatch.setattr(torch.backends.quantized, "engine", engine)
    monkeypatch.setattr(fbscreen, "packed_int8_linear_ref", lambda p, q, s, c: packed_int8_linear_ref(p, q, s, c) + 1)
    with pytest.raises(CSVError, match="self-test"):
        FbgemmInt8Screen(W, None)


def test_no_deprecation_warning_reaches_the_log():
    """torch 2.13 warns once per process when a quantized tensor is created: build the screen
    in a fresh process and look at everything it prints."""
    code = ("import torch, warnings; warnings.simplefilter('always'); "
            "from vllm_csv.screens.fbgemm import FbgemmInt8Screen; FbgemmInt8Screen(torch.randn(300, 20), None)")
    r = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "deprecated" not in r.stderr + r.stdout, r.stderr


def test_one_registry_of_screen_names():
    pytest.importorskip("vllm")
    import typing

    from vllm_csv.vllm_plugin.cli_args import add_csv_args
    from vllm_csv.vllm_plugin.config import CSVDecodeConfig

    import argparse

    parser = argparse.ArgumentParser()
    add_csv_args(parser)
    action = next(a for a in parser._actions if "--csv-screen" in a.option_strings)
    assert tuple(action.choices) == SCREENS
    assert typing.get_args(CSVDecodeConfig.model_fields["screen"].annotation) == SCREENS


def test_huge_weights_refused_with_the_bound_in_the_message():
    """The refusal names the bound it applies (max |w| about 1.7e10), not another (issue 42)."""
    W = torch.randn(64, 32)
    W[3, 4] = 2e10
    with pytest.raises(CSVError, match=r"1\.7e\+10"):
        FbgemmInt8Screen(W, None)
    W[3, 4] = 1e10
    FbgemmInt8Screen(W, None)  # below the bound: built


@pytest.mark.parametrize("factor", [4.0, 16.0, 1e4])
def test_outlier_channels_split_keep_the_bound(factor, backend):
    """Issue 45: channels far above their row's rms are split off the 7-bit activations and scored
    from the head's own weights; the bound holds (several outlier channels, more than
    MAX_OUTLIERS of them, a bias, mixed norms), and the split screen prunes where the plain one
    could not."""
    g = torch.Generator().manual_seed(int(factor))
    V, d = 2053, 96
    W = adversarial_weights(V, d, g)
    b = torch.randn(V, generator=g)
    h = torch.randn(24, d, generator=g)
    h[:, 5] *= factor
    h[::3, 17] *= factor * 3
    h[1, :12] *= factor  # twelve outlier channels in one row: the largest MAX_OUTLIERS split off
    h[2] *= 1e-20
    screen = FbgemmInt8Screen(W, b)
    cols = fbscreen.outlier_channels(h)
    assert cols is not None and cols.numel() <= fbscreen.MAX_OUTLIERS
    assert 17 in cols.tolist() and (5 in cols.tolist() or factor < 16)
    out, err, bound = check_bound(screen, W, h, b)
    assert out.rel == fbscreen.REL_SPLIT
    for row in h[:4]:
        check_bound(screen, W, row[None], b)
    plain = torch.randn(8, d, generator=g)
    assert fbscreen.outlier_channels(plain) is None  # ordinary rows: the screen as before


def cancelling_split():
    """``(W, h, screen)``: integer weights with 127 in every row, so the int8 copy is exact (``r =
    0``) and nothing else hides the split part's rounding; two outlier channels, ``127 H`` and
    ``-126 H``, cancel to ``H``."""
    g = torch.Generator().manual_seed(3)
    W = torch.randint(-127, 128, (512, 64), generator=g).float()
    W[:, 3], W[:, 4] = 127.0, -126.0
    h = torch.randn(64, 64, generator=g)
    h[:, 3] = h[:, 4] = 1e20 * (1 + torch.rand(64, generator=g))
    return W, h, FbgemmInt8Screen(W, None)


def test_mutation_split_without_its_error_term_breaks_the_bound():
    """Drop the split's error term (rho = 0) and the same check finds a broken bound."""
    W, h, screen = cancelling_split()
    assert float(screen.radius.max()) == 0.0
    check_bound(screen, W, h)
    screen.rho = 0.0
    with pytest.raises(AssertionError, match="bound broken"):
        check_bound(screen, W, h)


def test_split_bound_holds_under_reduced_precision_fp32_matmuls(reduced_precision_fp32):
    """The outlier split's fp32 products (``y += h_O W_O^T``) are the screen's own, not the dense
    head's: under a bf16 fp32-matmul setting they run in float64 (``fp.matmul32``), so the
    bound of the cancelling case above holds; the emulated engine breaks it when the split uses
    ``@`` as before (the test has teeth)."""
    from vllm_csv import fp

    W, h, screen = cancelling_split()
    check_bound(screen, W, h)
    real = reduced_precision_fp32
    try:
        fbscreen.matmul32 = lambda a, b: a @ b  # the split as it was: torch's fp32 matmul, whatever its setting
        with pytest.raises(AssertionError, match="bound broken"):
            check_bound(screen, W, h)
    finally:
        fbscreen.matmul32 = fp.matmul32
    assert torch.equal(fp.matmul32(h, W.T), real(h.double(), W.T.double()).float())
