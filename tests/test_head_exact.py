"""Certified top-k == dense top-k, on random, peaked and adversarial heads."""

import math

import pytest
import torch

from vllm_csv import CertifiedHead, CSVError, HeadConfig, build_index
from vllm_csv.testing.exact import dense_topk, same_bits
from vllm_csv.testing.heads import hidden_near_rows, peaked_head

SCREENS = ["int8", "int4", "fp16", "ball"]


def make(W, b=None, screen="int8", **kw):
    idx = build_index(W[: kw.get("vocab_size") or W.shape[0]],
                      None if b is None else b[: kw.get("vocab_size") or W.shape[0]],
                      progress=False) if screen == "ball" else None
    cfg = HeadConfig(screen=screen, budget=kw.pop("budget", 1.0))
    return CertifiedHead(W, b, config=cfg, index=idx, **kw)


def check_exact(head, W, b, h, k, softcap=None, scale=1.0, vocab=None):
    """Certified ids are the dense ids; values are the dense bits in bf16/fp16. An fp32 head's
    values cannot be known bit for bit (the dense GEMM's accumulation order is unknown), so
    there only ids are certified (``values=False``) and values agree to fp32 rounding."""
    V = vocab or W.shape[0]
    values = W.dtype != torch.float32
    res = head.topk(h, k, values=values)
    ids, vals, _ = dense_topk(W[:V], None if b is None else b[:V], h, k, softcap, scale)
    if values:
        assert torch.equal(res.ids, ids), (res.ids, ids)
        assert same_bits(res.values, vals)
    else:  # the top-k set; its order follows values known to within rounding
        assert torch.equal(res.ids.sort(1).values, ids.sort(1).values), (res.ids, ids)
        assert torch.allclose(res.values.sort(1).values, vals.sort(1).values, rtol=1e-5, atol=1e-5)
    return res


@pytest.mark.parametrize("screen", SCREENS)
@pytest.mark.parametrize("V,d", [(997, 16), (5003, 64), (4099, 129)])
@pytest.mark.parametrize("k", [1, 5])
def test_random_heads(screen, V, d, k):
    W, g = peaked_head(V, d, seed=V + d)
    h = torch.cat([hidden_near_rows(W, 24, g), torch.randn(8, d, generator=g)])
    res = check_exact(make(W, screen=screen), W, None, h, k)
    if screen == "int8":
        assert res.certified.float().mean() > 0.9  # the peaked rows certify without fallback


@pytest.mark.parametrize("screen", SCREENS)
def test_bias_softcap_scale_padding(screen):
    V, pad, d = 3001, 67, 48
    W, g = peaked_head(V + pad, d, seed=3)
    W[V:] = 100.0  # padding rows would win if they were ever looked at
    b = torch.randn(V + pad, generator=g)
    b[V:] = 1e4
    h = hidden_near_rows(W[:V], 32, g)
    head = make(W, b, screen, vocab_size=V, softcap=3.0, scale=0.7)
    res = check_exact(head, W, b, h, 3, softcap=3.0, scale=0.7, vocab=V)
    assert int(res.ids.max()) < V


@pytest.mark.parametrize("screen", SCREENS)
def test_ties_duplicates_zero_rows(screen):
    V, d = 1024, 32
    W, g = peaked_head(V, d, seed=5)
    W[100:110] = W[7]  # duplicate rows: exact ties, lowest id must win
    W[200:300] = 0.0
    h = torch.cat([hidden_near_rows(W, 16, g), W[7:8].repeat(4, 1) * 30, torch.zeros(2, d)])
    res = check_exact(make(W, screen=screen), W, None, h, 4)
    assert (res.ids[16:20, 0] == 7).all()


def test_bf16_head():
    V, d = 4001, 96
    W, g = peaked_head(V, d, seed=9, dtype=torch.bfloat16)
    h = hidden_near_rows(W, 32, g)
    check_exact(make(W), W, None, h, 2)


@pytest.mark.parametrize("screen", SCREENS)
def test_nonfinite_and_huge_hidden_take_dense_path(screen):
    V, d = 2003, 32
    W, g = peaked_head(V, d, seed=11)
    h = hidden_near_rows(W, 6, g)
    h[0, 3] = math.nan
    h[1, 0] = math.inf
    h[2] *= 1e36  # huge but finite bounds
    h[3] *= 3e38 / h[3].abs().max()  # ||h|| overflows fp32: no sound bound, dense path
    head = make(W, screen=screen)
    res = head.topk(h, 1)
    assert not res.certified[[0, 1, 3]].any() and res.fallback[[0, 1, 3]].all()
    # Row 3's logits overflow to inf inside the GEMM: which one wins depends on the GEMM's
    # blocking, i.e. on the batch shape. Dense rows come from the dense head on the whole
    # batch, so every row, dense or certified, matches the dense head on this batch.
    ids, _, _ = dense_topk(W, None, h, 1)
    assert torch.equal(res.ids, ids)


@pytest.mark.parametrize("screen", SCREENS)
@pytest.mark.parametrize("bad", [math.inf, math.nan, None])
def test_a_nonfinite_row_sends_its_whole_batch_dense(screen, bad):
    """One hidden row with an inf or a NaN: no row of the batch is certified (the dense GEMM may
    write NaN into another row: CertifiedHead.prepare), every row is the dense head's, and all
    are counted ``nonfinite``; the same batch without it is certified."""
    W, g = peaked_head(2003, 32, seed=12, dtype=torch.bfloat16)
    h = hidden_near_rows(W, 17, g)
    if bad is not None:
        h[8, 15] = bad
    head = make(W, screen=screen)
    res = head.topk(h, 1)
    if bad is None:
        assert bool(res.certified.all())
    else:
        assert not bool(res.certified.any()) and bool(res.fallback.all())
        _, stats = head.sampler_logits(h, torch.ones(17, dtype=torch.long), use_switch=False)
        assert stats.certified == 0 and stats.fallbacks["nonfinite"] == 17
    ids, _, _ = dense_topk(W, None, h, 1)
    assert torch.equal(res.ids, ids)


def test_budget_fallback_is_dense_and_counted():
    V, d = 2048, 64
    W, g = peaked_head(V, d, seed=2)
    h = torch.randn(8, d, generator=g)  # no clear winner: int4 cannot certify with 3 tokens
    # off-switch off: with it on, a batch size's first step is a dense probe
    head = CertifiedHead(W, config=HeadConfig(screen="int4", budget=0.001, off_switch=False))
    logits, stats = head.sampler_logits(h, torch.ones(8, dtype=torch.long))
    assert stats.fallbacks["budget"] == 8 and stats.certified == 0
    assert torch.equal(logits, torch.nn.functional.linear(h, W))


def test_sampler_logits_rows_and_sampling():
    V, d = 4096, 64
    W, g = peaked_head(V, d, seed=4)
    h = hidden_near_rows(W, 12, g)
    head = CertifiedHead(W, config=HeadConfig(budget=0.2))
    topk = torch.tensor([1, 1, 0, 5, 5, 0, 1, 3, 3, 1, 0, 65])
    logits, stats = head.sampler_logits(h, topk)
    dense = torch.nn.functional.linear(h, W)
    dense_rows = topk == 0
    assert torch.equal(logits[dense_rows], dense[dense_rows])
    assert stats.fallbacks["unsupported"] == 1 and torch.equal(logits[11], dense[11])
    finite = torch.isfinite(logits)
    reads = (topk >= 2)[:, None] & finite  # values read by top-k sampling: the dense bits
    assert torch.equal(logits[reads], dense[reads])
    # greedy rows: the argmax's value is only known to its rounding interval (README)
    assert torch.allclose(logits[finite], dense[finite], rtol=1e-5, atol=0)
    assert torch.equal(logits.argmax(1), dense.argmax(1))
    # top-k sampling with the same random draw picks the same token
    for row in range(12):
        k = int(topk[row]) if 0 < topk[row] <= 64 else V
        q = torch.empty(V).exponential_(generator=torch.Generator().manual_seed(row))
        def sample(z):
            kth = z.topk(k).values[-1]
            p = torch.softmax(z.masked_fill(z < kth, -math.inf), 0)
            return int((p / q).argmax())
        assert sample(logits[row]) == sample(dense[row])


def test_bad_config_is_clear():
    W = torch.randn(10, 4)
    with pytest.raises(CSVError, match="unknown screen"):
        HeadConfig(screen="bogus")
    with pytest.raises(CSVError, match="budget"):
        HeadConfig(budget=0)
    with pytest.raises(CSVError, match="needs a CSV index"):
        CertifiedHead(W, config=HeadConfig(screen="ball"))
    with pytest.raises(CSVError, match="k must be"):
        CertifiedHead(W).topk(torch.randn(1, 4), 11)


@pytest.mark.parametrize("V", [1, 255, 256, 257, 1000, 4096])
def test_block_maxima_and_columns(V):
    """The candidate search reads ``y`` once as block maxima: every token at or above a
    threshold lies in a block whose maximum reaches it (tails and NaN rows included)."""
    from vllm_csv.ops.select import block_cols as _block_cols, block_max as _block_max

    g = torch.Generator().manual_seed(V)
    y = torch.randn(3, V, generator=g)
    y[2, V // 2] = math.nan
    bm = _block_max(y)
    thr = torch.tensor([[0.5], [2.0], [0.0]])
    blocks = (bm >= thr).any(0).nonzero().squeeze(1)
    cols = _block_cols(blocks, V)
    want = (y[:2] >= thr[:2]).any(0).nonzero().squeeze(1)
    assert set(want.tolist()) <= set(cols.tolist()) and all(c < V for c in cols.tolist())
    assert torch.isnan(bm[2]).any() and not (bm[2] >= 0).all()


def test_topk_above_vocab_is_dense_and_transform_is_vllms():
    """``k > V`` (possible when ``max_topk > V``) goes dense as ``unsupported`` instead of raising;
    ``transform`` is vLLM's soft-cap/scale, also at ``-inf`` (``-softcap``, not ``-inf``)."""
    V, d = 40, 8
    W, g = peaked_head(V, d, seed=1)
    h = hidden_near_rows(W, 3, g)
    head = CertifiedHead(W, config=HeadConfig(max_topk=64, off_switch=False), softcap=5.0, scale=0.5)
    logits, stats = head.sampler_logits(h, torch.tensor([V + 1, 64, 1]))
    assert stats.fallbacks["unsupported"] == 2 and stats.certified == 1
    assert torch.equal(logits[:2], head.dense_logits(h)[:2])
    z = torch.tensor([-math.inf, 0.0, 3.0])
    want = torch.tanh(z / 5.0) * 5.0 * 0.5
    assert torch.equal(head.transform(z), want) and head.transform(z)[0] == -2.5


@pytest.mark.parametrize("screen", ["int8", "int4", "fp16"])
@pytest.mark.parametrize("left", [1, 2, 3])
def test_left_out_tokens_never_count(screen, left):
    """``exclude`` (a suppressing model's tokens: ``sampler_logits``' argument) leaving only
    ``left`` tokens of a row: a top-k row (``k = 2``) is certified only as the top-k of the tokens
    left, with their values. With every block's maximum left out but fewer than ``k``, the search's
    ``k``-th value is ``-inf`` and every column is a candidate, left-out ones included: their
    exact scores must not count (``select_two_sided``)."""
    W, g = peaked_head(600, 32, seed=left)
    W = W.to(torch.bfloat16)
    h = hidden_near_rows(W.float(), 6, g).to(torch.bfloat16)
    head = make(W, screen=screen)
    keep = torch.randperm(600, generator=g)[:left]
    exclude = torch.tensor(sorted(set(range(600)) - set(keep.tolist())))
    for k in (1, 2):
        out, _ = head.sampler_logits(h, torch.full((6,), k), exclude=exclude)
        c = head.last_certified
        dense = torch.nn.functional.linear(h, W).index_fill(1, exclude, -math.inf)
        out = out.index_fill(1, exclude, -math.inf)
        kk = min(k, left)
        dv, di = torch.sort(dense, dim=1, descending=True, stable=True)
        ov, oi = torch.sort(out, dim=1, descending=True, stable=True)
        assert torch.equal(oi[c, :kk], di[c, :kk]) and same_bits(ov[c, :kk], dv[c, :kk]) if k > 1 else \
            torch.equal(oi[c, :1], di[c, :1])
        if k <= left:  # (fewer tokens than k left: nothing to certify)
            assert bool(c.any()), (screen, left, k)
        else:
            assert not bool(c.any())


@pytest.mark.parametrize("path", ["cpu", "int_gemm_torch", "int_gemm_torch_scaled", "fused_quantize_ref"])
def test_an_integer_screens_product_never_overflows(path, monkeypatch):
    """An integer screen's codes stretch ``h`` to ``+-127`` whatever its scale, so its first
    product, scaled back (``fl(acc) t``), reaches ``127 d max|h|`` even where the true logits are
    modest: at ``max|h| = 1e35`` (d = 64) it overflowed fp32 on the CUDA screen's paths (the exact
    int8 GEMM's ``-inf`` centre, the fused step's NaN bound that Triton's maximum drops), and the
    certified token was not the dense one (found by review, run under Triton's interpreter).
    The accumulator guard covers it now (``ErrorModel.guard_scale``): such a row is dense."""
    import vllm_csv.head.certified as certified
    from vllm_csv.head.backend import Backend
    from vllm_csv.screens.quantized import QuantizedScreen

    d, V = 64, 65
    W = torch.zeros(V, d)
    for j in range(64):
        W[j, j] = -(1.0 + (j > 0) * 0.5 + j / 128)
    W[64] = -1e-20  # (the dense argmax: tiny weights pointing against h)
    W = W.to(torch.bfloat16)
    h = torch.full((1, d), 1e35).to(torch.bfloat16)
    scale = 0.5 if path.endswith("scaled") else 1.0
    dense = (torch.nn.functional.linear(h, W) * scale).float()
    assert int(dense.argmax(1)) == 64
    if path.startswith("int_gemm"):  # (the CUDA head's non-fused selection: exact int8 GEMM, torch ops)
        monkeypatch.setattr(certified, "make_screen", lambda name, w, b, index, two_sided: QuantizedScreen(w, b, bits=8))
        monkeypatch.setattr(certified, "backend_for", lambda device: Backend())
    head = CertifiedHead(W, None, config=HeadConfig(budget=1.0, off_switch=False), scale=scale)
    if path == "fused_quantize_ref":  # (the fused GPU step's first kernel, its reference: the row not ok)
        from vllm_csv.gpu.quantize import quantize_rows_ref

        ok = quantize_rows_ref(h, True, 16, head.errors.guard_scale, head.errors.babs_max)[4]
        assert not bool(ok.any())
        return
    for k in (1, 2):
        res = head.topk(h, k, values=True)
        want = torch.sort(dense, dim=1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(res.ids[res.certified], want[res.certified]), (path, k, res.ids, want)
    # the sampler's bounds of that row are not usable either (head.bounds.intervals: the guard
    # comes with the error model's widths)
    from vllm_csv.sampling.head_adapter import HeadAdapter

    assert not bool(HeadAdapter(head).intervals(h)[3].any()), path


def test_error_model_widths_are_its_terms():
    """``ErrorModel.widths`` (the intervals' one query of the model) hands out the terms its own
    methods give, with a bias and without: ``rad_total``, ``delta + rel``, ``bias_slack`` and
    ``accumulator_safe`` (a row of huge norm not safe)."""
    from vllm_csv.head.error_model import ErrorModel

    g = torch.Generator().manual_seed(2)
    W = torch.randn(300, 48, generator=g).to(torch.bfloat16)
    hnorm = torch.tensor([1.0, 3e37, 40.0])
    radius = torch.rand(300, generator=g)
    for bias in (None, torch.randn(300, generator=g)):
        errors = ErrorModel.of_head(W, bias)
        for rel in (0.0, 2.0**-10):
            w = errors.widths(radius, rel, hnorm)
            rad, rad_max = errors.rad_total(radius)
            bslack, bmax = errors.bias_slack(rel)
            assert torch.equal(w.rad, rad) and w.rad_max == rad_max and w.delta == errors.delta + rel
            assert torch.equal(w.bslack, bslack) and w.bmax == bmax and (bmax > 0) == (bias is not None)
            assert torch.equal(w.safe, errors.accumulator_safe(hnorm)) and w.safe.tolist() == [True, False, True]
