"""Top-k rows certified from their highest upper bounds (``sampling.top_k_rows``): the same token
as vLLM's top-k mask and draw on the dense logits, adversarial heads and rows included, and the
checks it rests on shown to matter (a certificate that skips them is caught)."""

import math

import pytest
import torch

from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.sampling import rows, top_k_rows
from vllm_csv.sampling.head_adapter import HeadAdapter
from vllm_csv.sampling.rows import certify_rows
from vllm_csv.testing.heads import hidden_near_rows, peaked_head

pytest.importorskip("vllm")
import vllm._custom_ops  # noqa: E402,F401
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_only, apply_top_k_top_p_pytorch  # noqa: E402

kernel = torch.ops._C.fused_gumbel_argmax


def temperature_columns(T):
    """vLLM's temperature per row (``Sampler.apply_temperature``: an fp32 division), as the
    sampler hook's ``columns`` maps any columns of any rows."""
    def columns(lo, hi, rows=None):
        t = T if rows is None else T[rows]
        return lo.float() / t[:, None], hi.float() / t[:, None]
    return columns


def vllm_min_p(y, min_p):
    """vLLM's ``MinPLogitsProcessor.apply`` on ``y`` ([R, V] fp32, after the temperature), out of place."""
    probs = torch.nn.functional.softmax(y, dim=-1)
    return y.masked_fill(probs < probs.amax(1, keepdim=True).mul_(min_p[:, None]), -float("inf"))


def vllm_draw(x, T, k, p=None, seeds=None, min_p=None):
    """vLLM-CPU's draw on the sampler's input ``x`` ([R, V]): temperature, (min-p), top-k (top-p), Gumbel."""
    y = x.float() / T[:, None]
    if min_p is not None:
        y = vllm_min_p(y, min_p)
    y = apply_top_k_only(y, k.clone()) if p is None else apply_top_k_top_p_pytorch(y, k.clone(), p.clone())
    return kernel(y.contiguous(), seeds)


class Spy:
    """Counts the rows the fast path certified and the rows that went to the rounds."""

    def __init__(self, monkeypatch):
        self.fast = self.rounds = self.tried = 0
        orig_fast, orig_rounds = rows.certify_top_k, rows.run_rounds

        def fast(*a, **kw):
            self.tried += a[1].shape[0]
            out = orig_fast(*a, **kw)
            self.fast += 0 if out is None else int(out.certified.sum())
            return out

        def rounds(adapter, hidden, *a):
            self.rounds += hidden.shape[0]
            return orig_rounds(adapter, hidden, *a)
        monkeypatch.setattr(rows, "certify_top_k", fast)
        monkeypatch.setattr(rows, "run_rounds", rounds)


def run(head, h, T, k, seeds, batch=16, p=None, min_p=None):
    """(mismatches, certified rows) of certify_rows (with ``columns``) against vLLM's draw on
    the dense logits, in batches of ``batch`` rows."""
    want = vllm_draw(head.dense_logits(h), T, k, p, seeds, min_p)
    bad = cert = 0
    for s in range(0, h.shape[0], batch):
        r = slice(s, s + batch)
        cols = temperature_columns(T[r])
        greedy = torch.zeros(h[r].shape[0], dtype=torch.bool)
        res = certify_rows(HeadAdapter(head), h[r], cols, seeds[r], greedy, elementwise=True, top_k=k[r],
                           top_p=None if p is None else p[r], min_p=None if min_p is None else min_p[r],
                           columns=cols)
        c = res.certified
        # what vLLM's sampler does with a certified row: its masks skipped (vllm_plugin.v1.masks._masks_off),
        # the draw on the row as handed over; and (top-k alone) with the top-k applied again
        got = kernel((res.values.float() / T[r, None]).contiguous(), seeds[r])
        bad += int((got[c] != want[r][c]).sum() + (res.winner[c] != want[r][c]).sum())
        if p is None and min_p is None:
            again = vllm_draw(res.values, T[r], k[r], None, seeds[r])
            bad += int((again[c] != want[r][c]).sum())
        cert += int(c.sum())
    return bad, cert


def int8_case(V, d, B, seed, scale, budget=0.5):
    """``(head, h, seeds)``: a peaked bf16 head with the int8 screen, ``B`` hidden states near its
    rows (``scale``: larger is peakier), and the rows' seeds."""
    W, g = peaked_head(V, d, seed=seed, dtype=torch.bfloat16)
    h = hidden_near_rows(W, B, g, scale=scale)
    head = CertifiedHead(W, None, config=HeadConfig(screen="int8", budget=budget, off_switch=False))
    return head, h, torch.randint(0, 2**31, (B,), generator=g)


def tied_case(V, d, B, seed, dtype, screen="int8", bias=False, softcap=None, scale=1.0):
    """``(head, h, seeds)``: a peaked head with exact ties (rows 300-329 copies of row 7), ``B``
    hidden states near its rows (two thirds peaked, the rest broad), and the rows' seeds."""
    W, g = peaked_head(V, d, seed=seed, dtype=dtype)
    W[300:330] = W[7]  # exact ties
    b = (torch.randn(V, generator=g) * 2).to(dtype) if bias else None
    h = torch.cat([hidden_near_rows(W, B - 160, g, scale=1.0), hidden_near_rows(W, 160, g, scale=0.3)])
    head = CertifiedHead(W, b, config=HeadConfig(screen=screen, budget=0.5, off_switch=False), softcap=softcap,
                         scale=scale)
    return head, h, torch.randint(0, 2**31, (B,), generator=g)


HEADS = [  # (dtype, screen, bias, softcap, scale)
    (torch.bfloat16, "int8", False, None, 1.0),
    (torch.bfloat16, "fp16", True, None, 1.0),
    (torch.float16, "int8", False, 30.0, 1.0),
    (torch.float32, "int8", False, None, 0.5),
    (torch.bfloat16, "int4", False, None, 1.0),
]


@pytest.mark.parametrize("dtype,screen,bias,softcap,scale", HEADS)
def test_fast_top_k_rows_draw_as_vllm(dtype, screen, bias, softcap, scale, monkeypatch):
    """Over 960 rows a head: k from 1 to V - 1, exact ties at the k-th value (duplicated rows of
    W), temperatures from 1e-5 to 1e4, peaked and broad rows, huge norms (logits near the
    dtype's range) and non-finite rows: every certified token is vLLM's, most rows are
    certified by the fast path, and the non-finite rows are not certified."""
    V, d, B = 1024, 48, 960
    W, g = peaked_head(V, d, seed=31, dtype=dtype)
    W[200:240] = W[3]  # exact ties, among them at the k-th place
    b = (torch.randn(V, generator=g) * 2).to(dtype) if bias else None
    h = torch.cat([hidden_near_rows(W, B - 192, g, scale=1.0), hidden_near_rows(W, 64, g, scale=0.2),
                   hidden_near_rows(W, 64, g, scale=4.0), torch.randn(64, d, generator=g).to(dtype) * 30])
    h[5, 3] = math.nan
    h[6, 0] = math.inf
    head = CertifiedHead(W, b, config=HeadConfig(screen=screen, budget=0.5, off_switch=False), softcap=softcap,
                         scale=scale)
    seeds = torch.randint(0, 2**31, (B,), generator=g)
    k = torch.tensor([1, 2, 3, 5, 20, 31, 64, 200, V - 1, 40])[torch.arange(B) % 10]
    T = torch.tensor([1e-5, 0.3, 0.8, 1.0, 2.0, 1e4])[torch.arange(B) % 6]
    spy = Spy(monkeypatch)
    bad, cert = run(head, h, T, k, seeds, batch=4)  # (k + 1 <= 128, a row's share of the budget, take the fast path)
    assert bad == 0
    assert cert > 0.8 * B, cert
    # (the int4 screen is the loose one: fewer of its rows' others are certainly dropped)
    assert spy.tried > 0.75 * B and spy.fast > (0.4 if screen == "int4" else 0.9) * spy.tried, \
        (spy.tried, spy.fast, spy.rounds)


def test_only_top_k_rows_take_the_fast_path(monkeypatch):
    """A batch mixing top-k rows, top-k + top-p rows, top-p rows, min-p + top-k rows and plain
    rows: the rows with a top-k go to the fast path, the others through the rounds, and the
    merged result draws as vLLM."""
    V, d, B = 4096, 48, 80  # (32 top-k rows of 84 candidates within the budget)
    head, h, seeds = int8_case(V, d, B, 37, 1.0, budget=0.7)
    kind = torch.arange(B) % 5  # 0: top-k, 1: top-p, 2: top-k and min-p, 3: plain, 4: top-k and top-p
    k = torch.where((kind == 0) | (kind == 2) | (kind == 4), 20, V)
    p = torch.where((kind == 1) | (kind == 4), 0.9, 1.0)
    min_p = torch.where(kind == 2, 0.05, 0.0)
    T = torch.full((B,), 0.8)
    cols = temperature_columns(T)
    seen = []
    orig = rows.certify_top_k
    monkeypatch.setattr(rows, "certify_top_k", lambda *a, **kw: seen.append(a[1].shape[0]) or orig(*a, **kw))
    res = certify_rows(HeadAdapter(head), h, cols, seeds, torch.zeros(B, dtype=torch.bool), elementwise=True,
                       top_k=k, top_p=p, min_p=min_p, columns=cols)
    assert seen == [int(((kind == 0) | (kind == 2) | (kind == 4)).sum())]
    # vLLM's draw: min-p first (dense, by hand: vLLM's fp32 softmax and comparison), then top-k/top-p
    y = vllm_min_p(head.dense_logits(h).float() / T[:, None], min_p)
    want = kernel(apply_top_k_top_p_pytorch(y, k.clone(), p.clone()).contiguous(), seeds)
    got = kernel((res.values.float() / T[:, None]).contiguous(), seeds)
    c = res.certified
    assert c[kind == 0].all() and c[kind == 2].float().mean() > 0.8 and c[kind == 4].float().mean() > 0.8
    assert int(c.sum()) > B // 2
    assert torch.equal(got[c], want[c]) and torch.equal(res.winner[c], want[c])


def test_short_lists_are_tried_again_longer(monkeypatch):
    """With ``k + 1`` candidates a row (too few for most rows' others to be certainly dropped)
    the short rows are tried again on longer lists, and still draw as vLLM."""
    V, d, B = 2048, 48, 160
    head, h, seeds = int8_case(V, d, B, 41, 0.5)
    k, T = torch.full((B,), 20), torch.full((B,), 1.0)
    monkeypatch.setattr(top_k_rows, "TOP_K_GUESS", 1)
    sizes = []
    orig = top_k_rows._try
    monkeypatch.setattr(top_k_rows, "_try", lambda *a: sizes.append((a[1].shape[0], int(a[11].max()))) or orig(*a))
    spy = Spy(monkeypatch)
    bad, cert = run(head, h, T, k, seeds, batch=4)  # (the longer lists within the budget)
    assert bad == 0 and cert > 0.9 * B
    assert any(K > 21 for _, K in sizes), sizes  # some rows tried again, longer
    assert spy.fast > 0.9 * B


def test_dropping_the_others_check_is_caught(monkeypatch):
    """The others' column must be certainly dropped: a fast path that certifies a row whose
    others may be kept (here on ``k + 1`` candidates, no longer tries) gives tokens vLLM does not
    draw (the others are ``-inf`` in the handed row, some of them kept by vLLM)."""
    V, d, B = 2048, 48, 320
    head, h, seeds = int8_case(V, d, B, 43, 0.3)  # broad rows: the others matter
    k, T = torch.full((B,), 64), torch.full((B,), 1.0)
    monkeypatch.setattr(top_k_rows, "TOP_K_GUESS", 1)
    monkeypatch.setattr(top_k_rows, "LONGER_TRIES", 0)
    orig = top_k_rows._try

    def careless(*a):
        out = orig(*a)
        return None if out is None else out._replace(certified=out.certified | out.short)
    monkeypatch.setattr(top_k_rows, "_try", careless)
    spy = Spy(monkeypatch)
    bad, _ = run(head, h, T, k, seeds, batch=8)  # (8 rows of 65 candidates within the budget)
    assert spy.tried == B and bad > 0


def test_over_budget_goes_to_the_rounds(monkeypatch):
    """Rows whose k + 1 exceed their share of the budget: not tried by the fast path, the rounds decide
    (within the budget), and what they certify draws as vLLM."""
    V, d, B = 1024, 32, 32
    head, h, seeds = int8_case(V, d, B, 47, 1.0, budget=0.05)
    k, T = torch.full((B,), 20), torch.full((B,), 0.8)
    spy = Spy(monkeypatch)
    bad, cert = run(head, h, T, k, seeds, batch=B)
    assert bad == 0
    assert spy.fast == 0 and spy.rounds == B  # 32 rows x (k + 1) = 672 > 52 columns: not even tried


@pytest.mark.parametrize("p", [0.5, 0.9, 0.98])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_top_k_then_top_p_rows_draw_as_vllm(p, dtype, monkeypatch):
    """top-k then top-p on the candidates' columns (vLLM's nucleus over what top-k kept): over 480
    rows, k from 2 to 64, ties at the k-th value, temperatures 0.3 to 2, peaked and broad rows,
    every certified token is vLLM's (``apply_top_k_top_p_pytorch`` and the draw on the dense
    logits), most by the fast path; and with top-p left out of the fast path (its top_p_bounds
    made the identity), tokens vLLM's top-p removes are drawn."""
    V, d, B = 2048, 48, 480
    head, h, seeds = tied_case(V, d, B, 53, dtype)
    k = torch.tensor([2, 5, 20, 40, 64])[torch.arange(B) % 5]
    T = torch.tensor([0.3, 0.8, 1.0, 2.0])[torch.arange(B) % 4]
    P = torch.full((B,), p)
    spy = Spy(monkeypatch)
    bad, cert = run(head, h, T, k, seeds, batch=4, p=P)
    assert bad == 0
    assert cert > 0.7 * B and spy.fast > 0.6 * B, (cert, spy.fast, spy.rounds)
    monkeypatch.setattr(top_k_rows, "top_p_bounds", lambda lo, hi, top_p, row_length=None: (lo, hi))
    if p < 0.9:  # (a nucleus of a few tokens: dropped tokens often outdraw the winner)
        bad, _ = run(head, h, T, k, seeds, batch=4, p=P)
        assert bad > 0


@pytest.mark.parametrize("dtype,screen,bias,softcap,scale", HEADS[:4])
def test_min_p_then_top_k_rows_draw_as_vllm(dtype, screen, bias, softcap, scale, monkeypatch):
    """min-p, then top-k (vLLM's order) on the candidates' columns: over 480 rows a head, min-p from
    1e-4 to 0.9, k from 1 to 64, exact ties, temperatures 0.3 to 2, peaked and broad rows, every
    certified token is vLLM's (``MinPLogitsProcessor``'s arithmetic, then top-k and the draw on the
    dense logits), most by the fast path; with min-p left out of the fast path (its min_p_bounds
    made the identity), tokens vLLM's min-p removes are drawn."""
    V, d, B = 2048, 48, 480
    head, h, seeds = tied_case(V, d, B, 59, dtype, screen, bias, softcap, scale)
    k = torch.tensor([1, 5, 20, 40, 64])[torch.arange(B) % 5]
    T = torch.tensor([0.3, 0.8, 1.0, 2.0])[torch.arange(B) % 4]
    mp = torch.tensor([1e-4, 0.01, 0.05, 0.1, 0.3, 0.9])[torch.arange(B) % 6]
    spy = Spy(monkeypatch)
    bad, cert = run(head, h, T, k, seeds, batch=4, min_p=mp)
    assert bad == 0
    assert cert > 0.7 * B and spy.fast > 0.6 * B, (cert, spy.fast, spy.rounds)
    monkeypatch.setattr(top_k_rows, "min_p_bounds", lambda lo, hi, min_p, ops=None: (lo, hi))
    bad, _ = run(head, h, T, k, seeds, batch=4, min_p=mp)
    assert bad > 0


@pytest.mark.parametrize("dtype,screen,bias,softcap,scale", HEADS[:4])
def test_min_p_rows_without_top_k_draw_as_vllm(dtype, screen, bias, softcap, scale, monkeypatch):
    """min-p rows with no top-k (``k = V``), some with a top-p after it, take the same path: their
    other tokens must be dropped by min-p itself. Over 480 rows a head (min-p 1e-3 to 0.9, exact
    ties, temperatures 0.3 to 2, peaked and broad rows) every certified token is vLLM's, most by
    the fast path; a fast path that takes the others' column as dropped without min-p's say-so
    draws tokens vLLM does not."""
    V, d, B = 2048, 48, 480
    head, h, seeds = tied_case(V, d, B, 61, dtype, screen, bias, softcap, scale)
    k = torch.full((B,), V)
    T = torch.tensor([0.3, 0.8, 1.0, 2.0])[torch.arange(B) % 4]
    mp = torch.tensor([1e-3, 0.01, 0.05, 0.1, 0.3, 0.9])[torch.arange(B) % 6]
    for p in (None, torch.tensor([1.0, 0.9, 0.5])[torch.arange(B) % 3]):
        spy = Spy(monkeypatch)
        bad, cert = run(head, h, T, k, seeds, batch=4, p=p, min_p=mp)
        assert bad == 0
        assert spy.tried == B and cert > 0.7 * B and spy.fast > 0.4 * B, (cert, spy.fast, spy.rounds)
    real = top_k_rows.min_p_bounds

    def careless(lo, hi, min_p, ops=None):
        lo, hi = real(lo, hi, min_p, ops=ops)
        return lo, hi.index_fill(1, torch.tensor([hi.shape[1] - 1]), -math.inf)  # the others "dropped"
    monkeypatch.setattr(top_k_rows, "min_p_bounds", careless)
    bad, _ = run(head, h, T, k, seeds, batch=4, min_p=mp)
    assert bad > 0


@pytest.mark.parametrize("p", [0.3, 0.5, 0.8])
@pytest.mark.parametrize("scale", [0.3, 1.0])
def test_top_p_never_drops_the_others_column(p, scale, monkeypatch):
    """The others' column stands for many tokens, and top-p sees it as one (one token's mass): a
    row is certified only where min-p or top-k dropped it, never top-p. Here (short lists, no
    longer tries) top-k often leaves it undecided and top-p then drops it (all 320 rows at
    p = 0.5, scale 1): every certified token must still be vLLM's (before the fix, 2 of 319
    certified rows there were not)."""
    V, d, B = 2048, 48, 320
    head, h, seeds = int8_case(V, d, B, 67, scale)
    k, T = torch.full((B,), 64), torch.full((B,), 1.0)
    monkeypatch.setattr(top_k_rows, "TOP_K_GUESS", 1)
    monkeypatch.setattr(top_k_rows, "LONGER_TRIES", 0)
    bad, cert = run(head, h, T, k, seeds, batch=8, p=torch.full((B,), p))
    assert bad == 0, (bad, cert)
