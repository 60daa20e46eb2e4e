"""Certified draws == vLLM's draw on the dense head's logits (same seeds), adversarial rows included."""

import math

import pytest
import torch

from vllm_csv import CertifiedHead, HeadConfig, build_index
from vllm_csv.sampling import certificate
from vllm_csv.sampling.certificate import certify_draw
from vllm_csv.sampling.head_adapter import HeadAdapter
from vllm_csv.sampling.rows import certify_rows
from vllm_csv.testing.heads import hidden_near_rows, peaked_head

pytest.importorskip("vllm")
import vllm._custom_ops  # noqa: E402,F401

kernel = torch.ops._C.fused_gumbel_argmax


def make_head(W, b=None, screen="fp16", **kw):
    idx = build_index(W.float(), None if b is None else b.float(), progress=False) if screen == "ball" else None
    return CertifiedHead(W, b, config=HeadConfig(screen=screen, budget=kw.pop("budget", 0.5), off_switch=False),
                         index=idx, **kw)


def temperature_process(T, greedy):
    """vLLM's Sampler.apply_temperature on fp32 rows (greedy rows divided by 1)."""
    t = torch.where(greedy, torch.ones_like(T), T)

    def process(lo, hi, rows=None):
        tr = t if rows is None else t[rows]
        return lo.float() / tr[:, None], hi.float() / tr[:, None]
    return process


def draw(x, T, greedy, seeds):
    """vLLM's CPU draw: greedy_argmax on greedy rows, Gumbel kernel on x / T otherwise."""
    x = x.float()
    tg = torch.ops._C.greedy_argmax(x) if x.shape[0] > 1 else x.argmax(1)
    t = torch.where(greedy, torch.ones_like(T), T)
    ts = kernel((x / t[:, None]).contiguous(), seeds)
    return torch.where(greedy, tg, ts)


def check(head, h, T, greedy, seeds, masked=None, adapter=None, elementwise=True, columns=False, out=None,
          process=None):
    """(mismatches, certified share) of certify_rows against vLLM's draw on the dense logits.
    ``elementwise``: rounds after the first on the first round's contenders (the temperature
    map is per token), else every round over the whole vocabulary; ``columns``: those rounds
    map the contenders' columns only (the temperature is per row). ``out``: a list the
    ``RowsResult`` is appended to; ``process``: in place of :func:`temperature_process`."""
    adapter = adapter or HeadAdapter(head)
    process = process or temperature_process(T, greedy)
    res = certify_rows(adapter, h, process, seeds, greedy, masked, elementwise=elementwise,
                       columns=process if columns else None)
    if out is not None:
        out.append(res)
    dense = head.dense_logits(h).float()
    if masked is not None:
        dense = dense.masked_fill(masked, -math.inf)
    want = draw(dense, T, greedy, seeds)
    got = draw(res.values.float(), T, greedy, seeds)
    c = res.certified
    mismatches = int((want[c] != got[c]).sum() + (want[c] != res.winner[c]).sum())
    return mismatches, float(c.float().mean())


CASES = [(s, dt, T) for s in ("fp16", "int8", "ball") for dt in (torch.float32, torch.bfloat16)
         for T in (1e-6, 0.3, 1.0, 1e4)]


@pytest.mark.parametrize("elementwise", [True, False])
@pytest.mark.parametrize("screen,dtype,T", CASES)
def test_certified_draw_equals_dense_draw(screen, dtype, T, elementwise):
    V, d, B = 2048, 64, 96
    W, g = peaked_head(V, d, seed=11, dtype=dtype)
    h = torch.cat([hidden_near_rows(W, B - 16, g, scale=2.0), torch.randn(16, d, generator=g).to(dtype)])
    head = make_head(W, screen=screen)
    seeds = torch.randint(0, 2**31, (B,), generator=g)
    greedy = torch.arange(B) % 5 == 0
    mism, rate = check(head, h, torch.full((B,), T), greedy, seeds, elementwise=elementwise)
    assert mism == 0
    if screen != "ball":
        assert rate > 0.5, rate


def test_many_seeds_one_row_each():
    """The same hidden state under 2000 seeds: every certified draw matches."""
    V, d = 1024, 32
    W, g = peaked_head(V, d, seed=3, dtype=torch.bfloat16)
    h = hidden_near_rows(W, 4, g, scale=1.0).repeat(500, 1)
    seeds = torch.randint(0, 2**31, (2000,), generator=g)
    mism, rate = check(make_head(W), h, torch.full((2000,), 0.7), torch.zeros(2000, dtype=torch.bool), seeds)
    assert mism == 0 and rate > 0.9, rate


@pytest.mark.parametrize("elementwise", [True, False])
def test_adversarial_ties_bias_softcap_masks(elementwise):
    V, d, B = 1500, 48, 64
    W, g = peaked_head(V, d, seed=5, dtype=torch.bfloat16)
    W[100:120] = W[7]  # duplicate rows: exact ties in the logits, the noise decides
    b = (torch.randn(V, generator=g) * 0.1).to(torch.bfloat16)
    h = torch.cat([hidden_near_rows(W, B - 8, g, scale=1.5), torch.zeros(4, d, dtype=torch.bfloat16),
                   (W[7:8].float() * 50).repeat(4, 1).to(torch.bfloat16)])
    masked = torch.rand(B, V, generator=g) < 0.3
    masked[:, 7] = True  # the favourite is masked
    seeds = torch.randint(0, 2**31, (B,), generator=g)
    for head in (make_head(W, b), make_head(W, b, softcap=2.0, scale=0.5)):
        for T in (1e-6, 0.9, 1e4):
            greedy = torch.arange(B) % 3 == 0
            mism, _ = check(head, h, torch.full((B,), T), greedy, seeds, masked, elementwise=elementwise)
            assert mism == 0


def test_nonfinite_rows_are_not_certified():
    V, d = 512, 16
    W, g = peaked_head(V, d, seed=7)
    h = torch.randn(4, d, generator=g)
    h[1, 3] = math.nan
    h[2, 0] = math.inf
    res = certify_rows(HeadAdapter(make_head(W)), h, temperature_process(torch.ones(4), torch.zeros(4, dtype=torch.bool)),
                       torch.arange(4), torch.zeros(4, dtype=torch.bool))
    assert not res.certified[1] and not res.certified[2]
    assert res.reason[1] == res.reason[2] == "nonfinite"


def test_draw_certificate_refuses_overlapping_bounds():
    """Token 1's noisy interval straddles token 0's noisy score: undecided, never certified;
    once its interval lies below, certified for token 0."""
    from vllm_csv.sampling.gumbel import gumbel_noise

    seeds = torch.tensor([123])
    g = gumbel_noise(seeds, torch.arange(2))[0]
    a = float(g[0] - g[1])  # y_1 = a ties token 0's noisy score (y_0 = 0)
    cert = certify_draw(torch.tensor([[0.0, a - 1e-3]]), torch.tensor([[0.0, a + 1e-3]]), seeds,
                        torch.tensor([False]))
    assert not bool(cert.certified[0]) and cert.contenders[0].tolist() == [True, True]
    cert = certify_draw(torch.tensor([[0.0, a - 2e-3]]), torch.tensor([[0.0, a - 1e-3]]), seeds,
                        torch.tensor([False]))
    assert bool(cert.certified[0]) and int(cert.winner[0]) == 0


class _BrokenAdapter(HeadAdapter):
    """Bounds of even tokens lowered by 3: wrong; the comparison with the dense draw must notice."""

    def intervals(self, hidden):
        lo, hi, hnorm, finite = super().intervals(hidden)
        lo[:, ::2] -= 3.0
        hi[:, ::2] -= 3.0
        return lo, hi, hnorm, finite


@pytest.mark.parametrize("elementwise", [True, False])
def test_broken_bound_is_caught(elementwise):
    V, d, B = 2048, 64, 256
    W, g = peaked_head(V, d, seed=13, dtype=torch.bfloat16)
    h = hidden_near_rows(W, B, g, scale=0.7)
    head = make_head(W)
    seeds = torch.randint(0, 2**31, (B,), generator=g)
    mism, _ = check(head, h, torch.full((B,), 1.0), torch.zeros(B, dtype=torch.bool), seeds,
                    adapter=_BrokenAdapter(head), elementwise=elementwise)
    assert mism > 0


def test_a_loose_noise_threshold_is_caught(monkeypatch):
    """Broken bound: tokens whose noise lies within 2 above the certificate's threshold are
    skipped (never turned into noise): some certified draws differ from the dense draw. Broken
    in the torch reference of the certificate's pass (the kernel is held to list exactly the
    tokens a full scan lists: ``test_noise_candidates.test_draw_contenders_kernel_is_the_reference``)."""
    from vllm_csv.ops import noise
    from vllm_csv.ops.noise import bits_below

    V, d, B = 2048, 64, 256
    W, g = peaked_head(V, d, seed=21, dtype=torch.bfloat16)
    h = hidden_near_rows(W, B, g, scale=0.2)  # flat rows: many tokens near the top
    seeds = torch.randint(0, 2**31, (B,), generator=g)
    T = torch.full((B,), 3.0)
    monkeypatch.setattr(noise, "uses_kernels", lambda t: False)
    assert check(make_head(W), h, T, torch.zeros(B, dtype=torch.bool), seeds)[0] == 0  # the real threshold
    monkeypatch.setattr(noise, "bits_below", lambda t: bits_below(t + 2.0))
    mism, _ = check(make_head(W), h, T, torch.zeros(B, dtype=torch.bool), seeds)
    assert mism > 0


@pytest.mark.parametrize("screen", ["fp16", "int8"])
def test_later_rounds_on_the_contenders_columns_only(screen):
    """With a per-row map (``columns``), the rounds after the first map the first round's
    contenders only: the same rows certified, the same values handed to the sampler and the same
    draws as mapping all of ``[R, V]`` each round, over 2048 rows of flat and peaked hidden states
    (greedy and sampled, temperatures 0.3 to 3); and the full map runs once, in the first round."""
    V, d, B = 4096, 64, 512
    W, g = peaked_head(V, d, seed=41, dtype=torch.bfloat16)
    head = make_head(W, screen=screen)
    for scale in (0.2, 0.6, 1.0, 3.0):
        h = hidden_near_rows(W, B, g, scale=scale)
        seeds = torch.randint(0, 2**31, (B,), generator=g)
        greedy = torch.rand(B, generator=g) < 0.25
        T = torch.tensor([0.3, 0.8, 1.0, 3.0]).repeat(B // 4)
        res = {}
        for columns in (False, True):
            out, calls = [], []
            base = temperature_process(T, greedy)
            mism, share = check(head, h, T, greedy, seeds, columns=columns, out=out,
                                process=lambda lo, hi, rows=None: calls.append(lo.shape) or base(lo, hi, rows))
            assert mism == 0 and share > 0.9, (scale, columns, mism, share)
            res[columns] = out[0]
            full = [c for c in calls if c[1] == V]
            assert len(full) == (1 if columns else len(calls)) and len(calls) > 1, (columns, calls)  # (narrow rounds ran)
        assert torch.equal(res[True].certified, res[False].certified)
        assert torch.equal(res[True].values, res[False].values)
        assert torch.equal(res[True].winner[res[True].certified], res[False].winner[res[False].certified])


def test_later_rounds_read_the_vocabulary_once(monkeypatch):
    """Elementwise: one certificate over the whole vocabulary (the first round), the others on
    the first round's contenders; same draws as every round over the vocabulary, and about as
    many rows certified (the narrow rounds only lose rows whose bound did not rise at all)."""
    from vllm_csv.sampling import rounds

    V, d, B = 4096, 64, 64
    W, g = peaked_head(V, d, seed=31, dtype=torch.bfloat16)
    h = hidden_near_rows(W, B, g, scale=1.0)
    seeds = torch.randint(0, 2**31, (B,), generator=g)
    greedy = torch.arange(B) % 4 == 0
    head, T = make_head(W, screen="int8"), torch.full((B,), 0.8)
    full = []
    monkeypatch.setattr(rounds, "certify_draw_packed",
                        lambda *a, **k: full.append(1) or certificate.certify_draw_packed(*a, **k))
    share = {}
    for elementwise in (True, False):
        full.clear()
        mism, share[elementwise] = check(head, h, T, greedy, seeds, elementwise=elementwise)
        assert mism == 0
        assert (len(full) == 1) == elementwise, len(full)
    assert share[True] >= share[False] - 2 / B and share[True] > 0.9, share


def test_narrow_rounds_missing_a_contender_are_caught(monkeypatch):
    """Broken narrowing: the later rounds see only the first round's contender of lowest id in
    each row (the others neither scored nor summarised): some certified draws differ."""
    from vllm_csv.sampling import rounds

    V, d, B = 2048, 64, 256
    W, g = peaked_head(V, d, seed=13, dtype=torch.bfloat16)
    h = hidden_near_rows(W, B, g, scale=0.2)  # flat rows: several contenders
    seeds = torch.randint(0, 2**31, (B,), generator=g)
    real = rounds.certify_draw_packed

    def one_contender(ylo, yhi, seeds, greedy, *ops, **summary):  # (ops: the adapter's bound passes)
        cert = real(ylo, yhi, seeds, greedy, *ops, **summary)
        first = cert.contenders.int().argmax(1)
        cert.contenders.zero_()
        cert.contenders[torch.arange(len(first)), first] = True
        return cert

    args = (h, torch.full((B,), 2.0), torch.zeros(B, dtype=torch.bool), seeds)
    assert check(make_head(W, screen="int8"), *args)[0] == 0  # the real narrowing
    monkeypatch.setattr(rounds, "certify_draw_packed", one_contender)
    assert check(make_head(W, screen="int8"), *args)[0] > 0


def test_ruled_out_summaries_hold():
    """Every token the certificate rules out is within its row's summary: greedy rows
    yhi_j < hi; sampled rows yhi_j <= hi and the computed yhi_j + g_j < noisy."""
    from vllm_csv.sampling.certificate import ruled_out
    from vllm_csv.sampling.gumbel import gumbel_noise

    g = torch.Generator().manual_seed(5)
    R, V = 64, 3000
    y = torch.randn(R, V, generator=g) * torch.tensor([0.1, 1.0, 5.0, 40.0]).repeat(R // 4)[:, None]
    w = torch.rand(R, V, generator=g) * 0.05
    ylo, yhi = y - w, y + w
    ylo[::7, :50], yhi[::7, :50] = -math.inf, -math.inf  # masked tokens
    seeds = torch.randint(0, 2**31, (R,), generator=g)
    greedy = torch.arange(R) % 3 == 0
    cert = certify_draw(ylo, yhi, seeds, greedy)
    out = ruled_out(cert, greedy)
    out_of = ~cert.contenders
    assert bool(out_of.any(1)[cert.finite].all())
    nhi = yhi.double() + gumbel_noise(seeds, torch.arange(V))
    for r in range(R):
        j = out_of[r]
        assert bool((yhi[r, j].double() <= out.hi[r, 0]).all())
        if greedy[r]:
            assert bool((yhi[r, j].double() <= out.hi[r, 0]).all()) and out.hi[r, 0] < cert.bar[r]
        else:
            assert bool((nhi[r, j] <= out.noisy[r, 0]).all()) and out.noisy[r, 0] < cert.bar[r]
    assert bool(out.usable()[cert.finite].all())


def test_a_narrow_round_on_unchanged_bounds_decides_as_the_full_round():
    """The rounds after the first certify on the first round's contenders, the others summarised
    (ruled_out). Where nothing rose (the best came from a token already scored before the first
    round, e.g. top-p rows' highest upper bounds), the narrow round must still certify what the
    full round certified: the summaries sit just below the bar they promise (they were the bar,
    and the later round's strict test failed on equality: every such row stayed undecided)."""
    from vllm_csv.sampling.certificate import ruled_out
    from vllm_csv.sampling.certificate import certify_columns

    g = torch.Generator().manual_seed(6)
    R, V = 64, 3000
    y = torch.randn(R, V, generator=g) * torch.tensor([1.0, 5.0, 40.0, 3.0]).repeat(R // 4)[:, None]
    w = torch.rand(R, V, generator=g) * 0.05
    top = y.topk(64, dim=1).indices
    w.scatter_(1, top, 0.0)  # the highest tokens exact (scored), the rest screened
    ylo, yhi = y - w, y + w
    seeds = torch.randint(0, 2**31, (R,), generator=g)
    greedy = torch.arange(R) % 3 == 0
    cert = certify_draw(ylo, yhi, seeds, greedy)
    assert int(cert.certified.sum()) > R // 2
    cols = cert.contenders.any(0).nonzero().squeeze(1)
    again = certify_columns(ylo[:, cols], yhi[:, cols], seeds, greedy, cols, ruled_out(cert, greedy), V)
    assert torch.equal(again.certified, cert.certified)
    assert torch.equal(again.winner[cert.certified], cert.winner[cert.certified])


@pytest.mark.parametrize("focus", [True, False])
@pytest.mark.parametrize("screen", ["fp16", "int8"])
def test_top_k_draws_equal_vllm_top_k_draws(screen, focus, monkeypatch):
    """top-k sampling certified from bounds (``top_k_bounds`` after the temperature): the same token
    as vLLM's top-k mask and draw on the dense logits, over 1600 rows a head, k from 1 to V (ties at
    the k-th value from duplicated rows of ``W``), bf16 and fp32 heads, seeded rows; with and
    without the top-k focus (each row's ``k + 1`` highest upper bounds scored), which certifies
    more rows."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_only

    from vllm_csv.sampling import rounds

    if not focus:
        monkeypatch.setattr(rounds, "_focus_counts", lambda top_k, top_p, stuck, V: torch.zeros_like(stuck))

    V, d, B = 1024, 48, 1600
    certified = 0
    for dtype in (torch.bfloat16, torch.float32):
        W, g = peaked_head(V, d, seed=23, dtype=dtype)
        W[200:230] = W[3]  # exact ties, among them at the k-th place
        h = torch.cat([hidden_near_rows(W, B - 64, g, scale=1.0), hidden_near_rows(W, 64, g, scale=4.0)])
        head = make_head(W, screen=screen)
        seeds = torch.randint(0, 2**31, (B,), generator=g)
        greedy = torch.zeros(B, dtype=torch.bool)
        k = torch.tensor([1, 2, 3, 5, 20, 31, 64, 200, V - 1, V])[torch.arange(B) % 10]
        T = torch.full((B,), 0.8)
        dense = head.dense_logits(h).float() / T[:, None]
        want = kernel(apply_top_k_only(dense.clone(), k.clone()).contiguous(), seeds)
        for s in range(0, B, 80):  # batches of 80 rows (one scored set a batch, within the budget)
            r = slice(s, s + 80)
            temp = temperature_process(T[r], greedy[r])
            res = certify_rows(HeadAdapter(head), h[r], temp, seeds[r], greedy[r], top_k=k[r])
            partial = res.values.float() / T[r, None]  # what vLLM's sampler then does with the certified row
            got = kernel(apply_top_k_only(partial, k[r].clone()).contiguous(), seeds[r])
            c = res.certified
            assert torch.equal(got[c], want[r][c]) and torch.equal(res.winner[c], want[r][c])
            certified += int(c.sum())
    assert certified > 0.8 * 2 * B, certified
    _focus_certified[(screen, focus)] = certified
    if (screen, not focus) in _focus_certified:
        assert _focus_certified[(screen, True)] > _focus_certified[(screen, False)], _focus_certified


_focus_certified: dict = {}


@pytest.mark.parametrize("p", [0.5, 0.9, 0.98])
def test_top_p_draws_with_the_focus_equal_vllm_draws(p):
    """top-p rows certified from wide (int8) screen bounds, with and without the top-p focus
    (``certify_rows(top_p=)``: the highest upper bounds scored, dropped tokens included, for
    their masses): the certified tokens are vLLM's (top-p mask, then the draw, on the dense
    logits), and the focus certifies no fewer rows."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from vllm_csv.sampling import rounds


    V, d, B = 4096, 64, 96
    W, g = peaked_head(V, d, seed=29, dtype=torch.bfloat16)
    h = hidden_near_rows(W, B, g, scale=0.6)  # broad rows: nuclei of many tokens
    head = make_head(W, screen="int8")
    seeds = torch.randint(0, 2**31, (B,), generator=g)
    greedy = torch.zeros(B, dtype=torch.bool)
    T, P = torch.full((B,), 0.8), torch.full((B,), p)
    dense = head.dense_logits(h).float() / T[:, None]
    want = kernel(apply_top_k_top_p_pytorch(dense.clone(), None, P.clone()).contiguous(), seeds)
    counts = {}
    for focus in (False, True):
        n = 0
        for s in range(0, B, 8):
            r = slice(s, s + 8)
            with pytest.MonkeyPatch.context() as mp:
                if not focus:
                    mp.setattr(rounds, "_focus_counts", lambda top_k, top_p, stuck, V: torch.zeros_like(stuck))
                res = certify_rows(HeadAdapter(head), h[r], temperature_process(T[r], greedy[r]), seeds[r],
                                   greedy[r], top_p=P[r])
            c = res.certified
            got = kernel((res.values.float() / T[r, None]).contiguous(), seeds[r])  # top-p decided: drawn at 1
            assert torch.equal(got[c], want[r][c]) and torch.equal(res.winner[c], want[r][c])
            n += int(c.sum())
        counts[focus] = n
    assert counts[True] >= counts[False] and counts[True] > 0.5 * B, counts


def test_top_p_focus_widens_with_the_vocabulary():
    """A top-p row stuck on its masses (every contender scored, still open) has its ``V / 32``
    highest upper bounds scored (within ``TOP_P_FOCUS``), 4x more each such round; top-k rows
    keep ``k + 1``, rows not stuck nothing; all at most ``V``."""
    from vllm_csv.sampling import rounds

    stuck = torch.tensor([0, 1, 2, 3, 1, 0])
    top_p = torch.tensor([0.9, 0.9, 0.9, 0.9, 1.0, 0.9])
    top_k = torch.tensor([0, 0, 0, 0, 0, 20])
    lo, hi = rounds.TOP_P_FOCUS
    for V, f in ((1024, lo), (32768, 1024), (65536, hi), (151936, hi), (1 << 20, hi)):
        got = rounds._focus_counts(top_k, top_p, stuck.clone(), V)
        assert got.tolist() == [0, f, min(4 * f, V), min(16 * f, V), 0, 21], V
    assert rounds._focus_counts(None, top_p, stuck.clone(), 300).tolist() == [0, lo, 300, 300, 0, 0]


def test_packed_draw_certificate_is_the_full_one():
    """``certify_draw_packed`` (each row's live tokens only, when few) decides exactly as
    ``certify_draw`` on the whole rows: the same certified rows, winners and contenders, over rows
    with few live tokens, exact ties, NaN, rows with nothing live, greedy and sampled rows."""
    from vllm_csv.sampling.certificate import certify_draw_packed

    g = torch.Generator().manual_seed(8)
    R, V = 256, 3000
    y = (torch.randn(R, V, generator=g) * 3).round() / 2  # exact ties
    w = torch.rand(R, V, generator=g) * (torch.rand(R, 1, generator=g) < 0.5) * 0.3
    lo, hi = y - w, y + w
    dead = torch.rand(R, V, generator=g) > torch.rand(R, 1, generator=g) * 0.2  # 0 to 20% live
    lo[dead], hi[dead] = -math.inf, -math.inf
    lo[torch.rand(R, V, generator=g) < 0.01] = -math.inf  # undecided tokens (may be dropped)
    lo[3], hi[3] = -math.inf, -math.inf  # nothing live
    lo[5, 7] = math.nan
    hi[6, (~dead[6]).nonzero()[0, 0]] = math.nan
    seeds = torch.randint(0, 2**31, (R,), generator=g)
    greedy = torch.arange(R) % 3 == 0
    full, packed = certify_draw(lo, hi, seeds, greedy), certify_draw_packed(lo, hi, seeds, greedy)
    assert (~dead).sum(1).max() <= 0.25 * V  # the packed path was taken
    assert torch.equal(full.certified, packed.certified) and torch.equal(full.finite, packed.finite)
    assert torch.equal(full.winner[full.certified], packed.winner[full.certified])
    assert torch.equal(full.contenders, packed.contenders)
    assert 0 < int(full.certified.sum()) < R
    # with the summary the rounds ask for: the same certificate, and ruled_out of it in rest
    from vllm_csv.sampling.certificate import ruled_out

    summed = certify_draw_packed(lo, hi, seeds, greedy, summary=True)
    assert packed.rest is None and summed.rest is not None
    want = ruled_out(packed, greedy)
    pairs = [(getattr(summed, n), getattr(packed, n)) for n in ("winner", "certified", "contenders", "finite", "bar",
                                                                "absmax", "hmax")]
    pairs += [(getattr(summed.rest, n), getattr(want, n)) for n in ("hi", "noisy", "lel", "leh", "absmax", "lo")]
    for got, ref in pairs:  # (bit for bit, NaN where NaN)
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)


def test_a_round_that_would_score_nothing_ends_the_rows_over_budget():
    """next_columns: when the room left cannot hold what the open rows ask for and the rows it
    could serve have every contender scored already (they asked for a top-k / top-p focus that
    does not fit), no column is scored and the open rows are over budget (None), rather than
    a next round on unchanged bounds; a row with an unscored contender that fits is served."""
    from vllm_csv.sampling.scoring import next_columns

    V = 16
    scored = torch.zeros(V, dtype=torch.bool)
    scored[:4] = True
    contenders = torch.zeros(2, V, dtype=torch.bool)
    contenders[:, :3] = True  # every contender scored
    need = torch.zeros(V, dtype=torch.bool)
    need[4:12] = True  # a focus of 8 columns, 4 of room left
    open_rows, over = torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool)
    new, over_budget = next_columns(need, contenders, scored, open_rows, over, budget=8)
    assert new is None and bool(over_budget.all())
    contenders[1, 5] = True  # row 1 has an unscored contender: served, row 0 waits
    new, over_budget = next_columns(need, contenders, scored, open_rows, over, budget=8)
    assert new.tolist() == [5] and not bool(over_budget.any())
    new, _ = next_columns(need, contenders, scored, open_rows, over, budget=12)  # all of it fits
    assert new.tolist() == list(range(4, 12))
