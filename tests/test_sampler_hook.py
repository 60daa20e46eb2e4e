"""The wrapped V1 Sampler on certified rows == vLLM's Sampler on dense logits (same seeds),
with temperature, seeded generators, penalties, logit_bias, allowed ids and bad words; the
RNG streams stay in step."""

import math

import pytest
import torch

from vllm_csv.testing.fakes import FakeClock, Tally, csv_layer, hand_off, logit_bias_processor, min_p_processor
from vllm_csv.testing.heads import hidden_near_rows, peaked_head

pytest.importorskip("vllm")
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from vllm_csv import CertifiedHead, HeadConfig  # noqa: E402
from vllm_csv.sampling.head_adapter import HeadAdapter  # noqa: E402
from vllm_csv.vllm_plugin import patches, step as csv_step  # noqa: E402
from vllm_csv.vllm_plugin.plan import DEFER, Plan  # noqa: E402
from vllm_csv.vllm_plugin.v1 import masks as v1_masks, sampler as v1_sampler  # noqa: E402

V, D, B = 1024, 48, 24


def metadata(g, temps, seeded, penalties, bias, allowed, bad, top_p=None, min_p=None, top_k=False, V=V):
    B = len(temps)
    temp = torch.tensor(temps, dtype=torch.float32)
    greedy = temp < 1e-5
    gens = {i: torch.Generator().manual_seed(1000 + i) for i in seeded}
    out_tokens = [torch.randint(0, V, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(B)]
    prompt = torch.randint(0, V, (B, 7), generator=g)
    procs = []
    if bias:
        procs.append(logit_bias_processor({i: {int(t): float(v) for t, v in zip(torch.randint(0, V, (3,), generator=g),
                                                                               torch.randn(3, generator=g) * 4)}
                                           for i in range(0, B, 2)}))
    mask = None
    if allowed:
        mask = torch.rand(B, V, generator=g) < 0.5  # True = not allowed
    bad_words = {i: [[int(torch.randint(0, V, (1,), generator=g))]] for i in range(1, B, 3)} if bad else {}
    pen = torch.zeros(B)
    if min_p is not None:
        procs.append(min_p_processor([0.0 if t < 1e-5 else min_p * (i % 3) / 2 for i, t in enumerate(temps)]))
    return SamplingMetadata(
        temperature=temp, all_greedy=bool(greedy.all()), all_random=bool((~greedy).all()),
        # vLLM's top_k: V where a row has none; ties at the k-th value, k = 1, k above the head's limit
        top_k=torch.tensor([(V, 1, 2, 5, 20, 64, 100, V - 1)[i % 8] for i in range(B)]) if top_k else None,
        top_p=None if top_p is None else torch.tensor([1.0 if t < 1e-5 or i % 3 == 0 else top_p
                                                       for i, t in enumerate(temps)]),
        generators=gens, max_num_logprobs=None, no_penalties=not penalties, prompt_token_ids=prompt,
        frequency_penalties=(torch.rand(B, generator=g) - 0.3) if penalties else pen,
        presence_penalties=(torch.rand(B, generator=g) - 0.3) if penalties else pen,
        repetition_penalties=(torch.rand(B, generator=g) + 0.6) if penalties else pen + 1,
        output_token_ids=out_tokens, allowed_token_ids_mask=mask, bad_words_token_ids=bad_words,
        logitsprocs=LogitsProcessors(procs), spec_token_ids=[[] for _ in range(B)])  # as InputBatch makes it


def run(sampler, logits, md, seed):
    torch.manual_seed(seed)
    for i, gen in md.generators.items():
        gen.manual_seed(1000 + i)
    out = sampler(logits=logits, sampling_metadata=md).sampled_token_ids[:, 0]
    return out, torch.rand(4), {i: gen.initial_seed() and torch.rand(2, generator=gen) for i, gen in md.generators.items()}



def _runner_channel(layer, sampler) -> csv_step.StepChannel:
    """One runner's step channel, bound to its layer and its sampler (as patches.py binds them)."""
    channel = csv_step.StepChannel()
    layer.csv_channel = sampler.csv_channel = channel
    return channel


CASES = {
    "temperature": dict(penalties=False, bias=False, allowed=False, bad=False),
    "penalties": dict(penalties=True, bias=False, allowed=False, bad=False),
    "bias_allowed_bad": dict(penalties=False, bias=True, allowed=True, bad=True),
    "everything": dict(penalties=True, bias=True, allowed=True, bad=True),
    "top_p": dict(penalties=False, bias=False, allowed=False, bad=False, top_p=0.8),
    "min_p": dict(penalties=False, bias=False, allowed=False, bad=False, min_p=0.2),
    "top_p_min_p_penalties": dict(penalties=True, bias=True, allowed=False, bad=False, top_p=0.6, min_p=0.05),
    "top_k": dict(penalties=False, bias=False, allowed=False, bad=False, top_k=True),
    "top_k_top_p": dict(penalties=False, bias=False, allowed=False, bad=False, top_p=0.7, top_k=True),
    "top_k_min_p": dict(penalties=False, bias=False, allowed=False, bad=False, min_p=0.2, top_k=True),
    "top_k_top_p_min_p_penalties": dict(penalties=True, bias=True, allowed=True, bad=False, top_p=0.7, min_p=0.05,
                                        top_k=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("T", [1e-6, 2e-5, 0.8, 1e4])  # vLLM draws greedily below 1e-5
def test_hooked_sampler_equals_dense_sampler(case, T):
    patches.install_samplers()
    g = torch.Generator().manual_seed(4)  # a seed at which certified top-p rows once drew dropped tokens
    W, _ = peaked_head(V, D, seed=17, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    h = hidden_near_rows(W, B, g, scale=1.5)
    temps = [0.0 if i % 4 == 0 else T for i in range(B)]
    md = metadata(g, temps, seeded=range(1, B, 2), **CASES[case])
    sampler = Sampler()
    dense = head.dense_logits(h)
    want = run(sampler, dense.clone(), md, seed=5)
    certified_total = top_p_certified = top_k_certified = 0
    for rows in (torch.arange(B), torch.arange(0, B, 3)):  # all rows deferred; some deferred, others dense
        logits = dense.clone()
        logits[rows] = csv_step.PLACEHOLDER
        seen = []
        modes = ["top_p" if md.top_p is not None and md.top_p[i] < 1 else
                 "top_k" if md.top_k is not None and md.top_k[i] < V else "sampling" for i in rows.tolist()]
        hand_off(sampler, csv_step.Deferred(logits, h[rows].clone(), rows, modes, HeadAdapter(head),
                                                     lambda: head.dense_logits(h), Tally(seen.append).account()))
        top_p_before = None if md.top_p is None else md.top_p.clone()
        got = run(sampler, logits, md, seed=5)
        if top_p_before is not None:
            assert torch.equal(md.top_p, top_p_before)  # the hook restored vLLM's values
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1], want[1])  # the global RNG is where the dense run left it
        assert all(torch.equal(got[2][i], want[2][i]) for i in want[2])  # and every request generator
        certified_total += sum(seen[0].certified.values())
        top_p_certified += seen[0].certified.get("top_p", 0)
        top_k_certified += seen[0].certified.get("top_k", 0)
    assert certified_total > B // 2, certified_total
    if md.top_p is not None and 1e-5 <= T < 100:  # greedy below 1e-5; at 1e4 the nucleus is most of V
        assert top_p_certified > 0
    if md.top_k is not None and md.top_p is None and T >= 1e-5:
        assert top_k_certified > 0


def test_top_k_rows_fail_if_top_k_is_ignored(monkeypatch):
    """Broken-mask check: with vLLM's top-k left out of the certificate, certified top-k rows
    draw tokens vLLM's top-k removes."""
    from vllm_csv.sampling import top_k_rows
    from vllm_csv.sampling.nucleus import chain

    for module in (chain, top_k_rows):  # the rounds' masks, and the top-k rows' fast path
        monkeypatch.setattr(module, "top_k_bounds", lambda lo, hi, k, ops=None: (lo, hi))
    with pytest.raises(AssertionError):
        test_hooked_sampler_equals_dense_sampler("top_k", 0.8)


def test_sampler_refuses_a_mismatched_batch():
    patches.install_samplers()
    W, g = peaked_head(V, D, seed=1, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", off_switch=False))
    h = hidden_near_rows(W, 4, g)
    sampler = Sampler()
    hand_off(sampler, csv_step.Deferred(torch.zeros(4, V), h, torch.arange(4), ["sampling"] * 4,
                                                 HeadAdapter(head), lambda: head.dense_logits(h),
                                                 Tally().account()))
    md = metadata(g, [1.0] * B, [], False, False, False, False)
    with pytest.raises(RuntimeError, match="refusing to sample from placeholders"):
        sampler(logits=torch.zeros(B, V), sampling_metadata=md)


def _spy_masks(monkeypatch, which: str):
    """Record the ``k`` or ``p`` (``which``) vLLM's CPU sampler hands to apply_top_k_top_p, per draw."""
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    seen, orig = [], tts.apply_top_k_top_p

    def spy(logits, k, p):
        x = k if which == "k" else p
        seen.append(None if x is None else x.clone())
        return orig(logits, k, p)
    monkeypatch.setattr(tts, "apply_top_k_top_p", spy)
    return seen


def _hooked(head, h, dense, md, rows, seed=5, full=False, sampler=None):
    """vLLM's sampler with the hook on ``rows``: (tokens, stats); ``full``: ``run``'s whole
    result (tokens, the global RNG's next draw, each generator's) for the tokens."""
    logits = dense.clone()
    logits[rows] = csv_step.PLACEHOLDER
    seen = []
    modes = ["top_p" if md.top_p is not None and md.top_p[i] < 1 else "sampling" for i in rows.tolist()]
    sampler = sampler or Sampler()
    hand_off(sampler, csv_step.Deferred(logits, h[rows].clone(), rows, modes, HeadAdapter(head),
                                                 lambda: head.dense_logits(h), Tally(seen.append).account()))
    out = run(sampler, logits, md, seed)
    return (out if full else out[0]), seen[0]


@pytest.mark.parametrize("case", ["drawn", "skipped", "kept"])
def test_vllm_top_p_is_skipped_only_when_every_top_p_row_is_certified(case, monkeypatch):
    """Every top-p row certified: vLLM's draw runs without top-p (no full-vocabulary sort) and
    draws what the dense sampler draws (``skipped``: a row without top-p left dense); a top-p row
    left dense (here: not deferred) keeps it (``kept``); every row certified, the hook's tokens
    are the draw and vLLM's sampler does not run (``drawn``: no mask pass at all)."""
    patches.install_samplers()
    g = torch.Generator().manual_seed(8)
    W, _ = peaked_head(V, D, seed=19, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    h = hidden_near_rows(W, B, g, scale=3.0)  # confident rows: every one certifies
    md = metadata(g, [0.8] * B, seeded=range(0, B, 2), penalties=False, bias=False, allowed=False, bad=False,
                  top_p=0.7)
    dense = head.dense_logits(h)
    want = run(Sampler(), dense.clone(), md, seed=5)
    seen_p = _spy_masks(monkeypatch, "p")
    assert md.top_p[0] == 1.0
    rows = {"drawn": torch.arange(B), "skipped": torch.arange(1, B),  # row 0: no top-p, dense
            "kept": torch.arange(B)[md.top_p == 1.0]}[case]  # the top-p rows dense
    got, st = _hooked(head, h, dense, md, rows, full=True)
    assert all(torch.equal(a, b) for a, b in zip(got[:2], want[:2]))  # the tokens, the global RNG
    assert all(torch.equal(got[2][i], want[2][i]) for i in want[2])  # every request generator
    assert sum(st.certified.values()) == rows.numel()
    if case == "drawn":
        assert not seen_p
    else:
        assert (seen_p[-1] is None) == (case == "skipped")


def _top_k_batch(seed: int, k: int, T: float, scale: float):
    g = torch.Generator().manual_seed(seed)
    W, _ = peaked_head(V, D, seed=seed + 1, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    h = hidden_near_rows(W, B, g, scale=scale)
    md = metadata(g, [T] * B, seeded=range(0, B, 2), penalties=False, bias=False, allowed=False, bad=False)
    md.top_k = torch.full((B,), k)
    return head, h, md


@pytest.mark.parametrize("case", ["drawn", "skipped", "kept"])
def test_vllm_top_k_is_skipped_only_when_every_top_k_row_is_certified(case, monkeypatch):
    """Every top-k row certified: vLLM's draw runs without its top-k pass and draws what the dense
    sampler draws (``skipped``: a row without top-k left dense); a top-k row left dense (``kept``)
    keeps vLLM's top-k for the batch, with ``V`` (no top-k) on the certified rows; vLLM's values
    are restored after the draw. Every row certified (``drawn``): vLLM's sampler does not run."""
    patches.install_samplers()
    head, h, md = _top_k_batch(12, 20, 0.8, 3.0)  # confident rows: every one certifies
    if case == "skipped":
        md.top_k[0] = V
    top_k = md.top_k.clone()
    dense = head.dense_logits(h)
    want = run(Sampler(), dense.clone(), md, seed=5)
    seen_k = _spy_masks(monkeypatch, "k")
    rows = torch.arange(B) if case == "drawn" else torch.arange(1, B)  # row 0: dense, with its top-k or none
    got, st = _hooked(head, h, dense, md, rows, full=True)
    assert all(torch.equal(a, b) for a, b in zip(got[:2], want[:2]))
    assert all(torch.equal(got[2][i], want[2][i]) for i in want[2])
    assert sum(st.certified.values()) == rows.numel()
    assert torch.equal(md.top_k, top_k)
    if case == "drawn":
        assert not seen_k
    elif case == "skipped":
        assert seen_k[-1] is None
    else:
        assert seen_k[-1] is not None and seen_k[-1][0] == 20 and bool((seen_k[-1][1:] == V).all())


def _spy_min_p(monkeypatch):
    """Count vLLM's min-p passes (its processor applied with some row's min-p set)."""
    seen, orig = [], MinPLogitsProcessor.apply

    def spy(self, logits):
        if self.min_p_count:
            seen.append(True)
        return orig(self, logits)
    monkeypatch.setattr(MinPLogitsProcessor, "apply", spy)
    return seen


def _min_p_batch(seed: int, min_p: float, T: float, scale: float):
    g = torch.Generator().manual_seed(seed)
    W, _ = peaked_head(V, D, seed=seed + 1, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    h = hidden_near_rows(W, B, g, scale=scale)
    md = metadata(g, [T] * B, seeded=range(0, B, 2), penalties=False, bias=False, allowed=False, bad=False,
                  min_p=min_p)
    return head, h, md


@pytest.mark.parametrize("case", ["drawn", "skipped", "kept"])
def test_vllm_min_p_is_skipped_only_when_every_min_p_row_is_certified(case, monkeypatch):
    """Every sampled min-p row certified: vLLM's draw runs without its min-p pass (a softmax and a
    mask over [B, V]) and draws what the dense sampler draws (``skipped``: row 0, without min-p,
    left dense); a min-p row left dense keeps it (``kept``); every row certified (``drawn``):
    vLLM's sampler does not run."""
    patches.install_samplers()
    head, h, md = _min_p_batch(14, 0.2, 0.8, 3.0)
    dense = head.dense_logits(h)
    want = run(Sampler(), dense.clone(), md, seed=5)
    seen = _spy_min_p(monkeypatch)
    assert md.logitsprocs.argmax_invariant[0].get_min_p_by_index(0) == 0.0
    rows = {"drawn": torch.arange(B), "skipped": torch.arange(1, B), "kept": torch.arange(2, B)}[case]
    got, st = _hooked(head, h, dense, md, rows, full=True)
    assert all(torch.equal(a, b) for a, b in zip(got[:2], want[:2]))
    assert all(torch.equal(got[2][i], want[2][i]) for i in want[2])
    assert sum(st.certified.values()) == rows.numel()
    assert bool(seen) == (case == "kept")


@pytest.mark.parametrize("mask", ["top_k", "min_p"])
def test_a_drop_left_on_a_certified_row_is_caught(mask, monkeypatch):
    """Broken-output check: a certified row that keeps the tokens its certificate dropped (upper
    bound -inf after top-k / min-p) finite on the partial row draws them once vLLM's top-k / min-p
    is skipped (k = 2 or min-p 0.6, hot rows: dropped tokens often outdraw the winner)."""
    from vllm_csv.sampling import rounds, top_k_rows

    patches.install_samplers()
    real, real_fast = rounds._finish_rows, top_k_rows._handed_rows
    monkeypatch.setattr(rounds, "_finish_rows",
                        lambda out, r, s, v, m, up: real(out, r, s, v, m, torch.zeros_like(up)))
    # (top-k rows: the fast path's output too, top_k_rows.certify_top_k)
    monkeypatch.setattr(top_k_rows, "_handed_rows", lambda V, c, z, up: real_fast(V, c, z, torch.zeros_like(up)))
    wrong = 0
    for seed in range(6):
        batch = _top_k_batch(30 + seed, 2, 2.0, 0.7) if mask == "top_k" else _min_p_batch(50 + seed, 0.6, 2.0, 0.7)
        head, h, md = batch
        dense = head.dense_logits(h)
        want = run(Sampler(), dense.clone(), md, seed=5)[0]
        # (row 0 left dense: with every row certified the hook's tokens are the draw, no output is read)
        got, _ = _hooked(head, h, dense, md, torch.arange(1, B))
        wrong += int((got != want).sum())
    assert wrong > 0


def test_rows_with_top_p_of_one_draw_like_vllm(monkeypatch):
    """top_p = 1.0 (vLLM's "no top-p") on deferred rows, beside a dense row with top_p < 1, so that
    vLLM applies its top-p to the whole batch: plain-sampling certificate, same draw as vLLM."""
    patches.install_samplers()
    g = torch.Generator().manual_seed(9)
    W, _ = peaked_head(V, D, seed=23, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    h = hidden_near_rows(W, B, g, scale=1.5)
    md = metadata(g, [0.8] * B, seeded=range(0, B, 3), penalties=False, bias=False, allowed=False, bad=False)
    md.top_p = torch.ones(B)
    md.top_p[0] = 0.5  # row 0: dense, with top-p
    dense = head.dense_logits(h)
    want = run(Sampler(), dense.clone(), md, seed=5)[0]
    seen_p = _spy_masks(monkeypatch, "p")
    got, st = _hooked(head, h, dense, md, torch.arange(1, B))
    assert torch.equal(got, want)
    assert set(st.certified) == {"sampling"} and sum(st.certified.values()) > B // 2
    assert seen_p[-1] is not None and torch.equal(seen_p[-1], md.top_p)  # vLLM's top-p, as without CSV


# --- structured output: the grammar bitmask, applied by vLLM's own code between the head and the sampler


def pack_bitmask(allowed: torch.Tensor):
    """``[n, V]`` bool (True = the grammar allows it) -> xgrammar's ``[n, ceil(V / 32)]`` int32
    bitmask (bit ``j % 32`` of word ``j // 32`` is token ``j``), as the scheduler sends it."""
    import numpy as np

    n, v = allowed.shape
    words = -(-v // 32)
    bits = torch.zeros(n, words * 32, dtype=torch.bool)
    bits[:, :v] = allowed
    packed = (bits.view(n, words, 32).numpy().astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(2)
    return packed.astype(np.uint32).view(np.int32)


def apply_grammar(logits: torch.Tensor, allowed: dict[int, torch.Tensor], order: list[int]) -> None:
    """vLLM's ``apply_grammar_bitmask`` (what ``sample_tokens`` runs on the head's logits before the
    sampler) for the structured rows ``allowed`` (batch row -> ``[V]`` bool), sent in ``order``."""
    from types import SimpleNamespace

    from vllm.v1.structured_output.utils import apply_grammar_bitmask

    B = logits.shape[0]
    ids = [r for r in order if r in allowed]
    apply_grammar_bitmask(SimpleNamespace(scheduled_spec_decode_tokens={}),
                          SimpleNamespace(structured_output_request_ids=[f"r{r}" for r in ids],
                                          grammar_bitmask=pack_bitmask(torch.stack([allowed[r] for r in ids]))),
                          SimpleNamespace(req_ids=[f"r{i}" for i in range(B)]), logits)


def grammar(kind: str, dense: torch.Tensor, rows: list[int], g) -> dict[int, torch.Tensor]:
    """Adversarial grammars, one ``[V]`` allowed-mask per structured row, from the dense logits."""
    V = dense.shape[1]
    order = dense.float().sort(dim=1, descending=True, stable=True).indices
    out = {}
    for n, r in enumerate(rows):
        a = torch.ones(V, dtype=torch.bool)
        if kind == "argmax_removed":  # the unmasked winner (and up to 7 runners-up) forbidden
            a[order[r, :1 + n % 8]] = False
        elif kind == "most_removed":  # 2% of the vocabulary left, the argmax not among them
            a = torch.rand(V, generator=g) < 0.02
            a[order[r, 0]] = False
        elif kind == "one_left":  # a single token, anywhere in the row's order
            a = torch.zeros(V, dtype=torch.bool)
            a[order[r, int(torch.randint(0, V, (1,), generator=g))]] = True
        elif kind == "outside_scored":  # only the lower half of the row: tokens no screen scores
            a = torch.zeros(V, dtype=torch.bool)
            a[order[r, V // 2:]] = torch.rand(V - V // 2, generator=g) < 0.3
        elif kind == "ties":  # the head's twin tokens (exact ties): the winner's pair removed
            a[order[r, :2]] = False
        elif kind == "nothing_left":  # every token forbidden (a grammar never sends this; stays dense)
            a[:] = False
        elif kind == "reasoning":  # the full mask (reasoning phase / terminated grammar): nothing removed
            pass
        out[r] = a
    return out


GRAMMARS = ("argmax_removed", "most_removed", "one_left", "outside_scored", "ties", "nothing_left", "reasoning")
STRUCTURED_SAMPLING = {
    "greedy_and_temperature": dict(penalties=False, bias=False, allowed=False, bad=False),
    "top_p_min_p_penalties": dict(penalties=True, bias=True, allowed=False, bad=True, top_p=0.8, min_p=0.1),
    "top_k": dict(penalties=False, bias=False, allowed=False, bad=False, top_k=True),
    "top_k_top_p": dict(penalties=False, bias=False, allowed=False, bad=False, top_p=0.7, top_k=True),
}


def structured_head(kind: str, seed: int):
    W, _ = peaked_head(V, D, seed=seed, dtype=torch.bfloat16)
    if kind == "ties":
        W[1::2] = W[0::2]  # token 2t+1 is token 2t's twin: every dense logit is tied
    return W, CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))


def hooked_structured(head, h, dense, md, allowed, order, rows, seed):
    """The CSV step: placeholders for ``rows``, vLLM's bitmask on the head's output, the wrapped sampler."""
    logits = dense.clone()
    logits[rows] = csv_step.PLACEHOLDER
    apply_grammar(logits, allowed, order)
    seen = []
    modes = ["structured" if int(i) in allowed else "sampling" for i in rows]
    sampler = Sampler()
    hand_off(sampler, csv_step.Deferred(logits, h[rows].clone(), rows, modes, HeadAdapter(head),
                                                 lambda: head.dense_logits(h), Tally(seen.append).account()))
    return run(sampler, logits, md, seed), seen[0]


@pytest.mark.parametrize("sampling", sorted(STRUCTURED_SAMPLING))
@pytest.mark.parametrize("kind", GRAMMARS)
def test_structured_rows_draw_what_vllm_draws_under_the_grammar(kind, sampling):
    """Rows with a grammar, certified in the sampler after vLLM's own ``apply_grammar_bitmask`` ran on
    the head's placeholders: the same tokens (and RNG states) as vLLM's sampler on the dense logits
    with the same bitmask and seeds, over several batches of random and adversarial rows (greedy and
    sampled, seeded and not; structured rows beside unconstrained ones, sent out of batch order;
    every row deferred, or some deferred and others dense)."""
    patches.install_samplers()
    certified = structured_certified = 0
    for trial in range(3):
        g = torch.Generator().manual_seed(100 * trial + len(kind))
        W, head = structured_head(kind, seed=31 + trial)
        h = hidden_near_rows(W, B, g, scale=(1.0, 1.5, 3.0)[trial])
        temps = [0.0 if i % 3 == 0 else (0.7, 1.0, 0.3)[trial] for i in range(B)]
        md = metadata(g, temps, seeded=range(1, B, 2), **STRUCTURED_SAMPLING[sampling])
        dense = head.dense_logits(h)
        structured = [i for i in range(B) if i % 4 != 3]  # every fourth row has no grammar
        allowed = grammar(kind, dense, structured, g)
        order = torch.randperm(B, generator=g).tolist()  # the scheduler's order, not the batch's
        want_logits = dense.clone()
        apply_grammar(want_logits, allowed, order)
        if kind != "reasoning":
            assert bool((want_logits == -float("inf")).any())  # vLLM's function did apply the mask
        want = run(Sampler(), want_logits, md, seed=5)
        for rows in (torch.arange(B), torch.arange(0, B, 2)):
            got, st = hooked_structured(head, h, dense, md, allowed, order, rows, seed=5)
            assert torch.equal(got[0], want[0]), (kind, sampling, trial, got[0] - want[0])
            assert torch.equal(got[1], want[1])  # the global RNG is where the dense run left it
            assert all(torch.equal(got[2][i], want[2][i]) for i in want[2])  # and every request generator
            for r in rows.tolist():  # never a token the grammar forbids
                if r in allowed and bool(allowed[r].any()):
                    assert bool(allowed[r][got[0][r]])
            certified += sum(st.certified.values())
            structured_certified += st.certified.get("structured", 0)
    if kind == "nothing_left":
        assert structured_certified == 0  # no token to certify: dense, and vLLM's draw on it
    else:  # the path was taken: most structured rows certified
        assert structured_certified > 0.5 * 3 * (len(structured) + len([i for i in structured if i % 2 == 0]))


def test_structured_rows_fail_if_the_mask_is_ignored(monkeypatch):
    """Broken-mask check: a certificate that does not see the bitmask (``masked`` dropped) draws
    forbidden tokens, and the comparison above catches it."""
    patches.install_samplers()
    real = v1_sampler.certify_rows
    monkeypatch.setattr(v1_sampler, "certify_rows", lambda *a, **k: real(*a[:5]))  # no ``masked``
    g = torch.Generator().manual_seed(3)
    W, head = structured_head("argmax_removed", seed=31)
    h = hidden_near_rows(W, B, g, scale=3.0)
    md = metadata(g, [0.0 if i % 2 else 0.7 for i in range(B)], seeded=range(0, B, 3), penalties=False,
                  bias=False, allowed=False, bad=False)
    dense = head.dense_logits(h)
    allowed = grammar("argmax_removed", dense, list(range(B)), g)
    want_logits = dense.clone()
    apply_grammar(want_logits, allowed, list(range(B)))
    want = run(Sampler(), want_logits, md, seed=5)[0]
    got = hooked_structured(head, h, dense, md, allowed, list(range(B)), torch.arange(B), seed=5)[0][0]
    assert not torch.equal(got, want)


def test_a_greedy_row_certified_in_the_head_is_wrong_once_the_grammar_masks_it():
    """Why the plan never certifies a structured row in the head (greedy included): the head's
    top-1 certificate does not know the mask that follows it; with the winner forbidden, the
    sampler's argmax over the partial row is not the dense row's."""
    g = torch.Generator().manual_seed(6)
    W, head = structured_head("argmax_removed", seed=33)
    h = hidden_near_rows(W, B, g, scale=3.0)
    dense = head.dense_logits(h)
    allowed = grammar("argmax_removed", dense, list(range(B)), g)
    partial, stats = head.sampler_logits(h, torch.ones(B, dtype=torch.long))
    assert stats.certified == B
    want = dense.clone()
    for x in (partial, want):
        apply_grammar(x, allowed, list(range(B)))
    assert not torch.equal(partial.float().argmax(1), want.float().argmax(1))


def min_tokens_processor(rows: dict[int, bool], stop: list[int]):
    """vLLM's MinTokensLogitsProcessor in the state update_state leaves it in: ``rows`` maps a
    batch row to whether its request has a grammar (its stop tokens are restored when the
    grammar leaves it nothing else)."""
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    p = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
    p.min_toks = {r: (5, [], set(stop), s) for r, s in rows.items()}
    ids = lambda which: torch.tensor([r for r in rows if which(r) for _ in stop], dtype=torch.int32)  # noqa: E731
    toks = lambda which: torch.tensor([t for r in rows if which(r) for t in stop], dtype=torch.int32)  # noqa: E731
    p.logits_slice = (ids(lambda r: True), toks(lambda r: True))
    p.restore_logits_slice = (ids(lambda r: rows[r]), toks(lambda r: rows[r]))
    return p


@pytest.mark.parametrize("restore_row_deferred", [False, True])
def test_min_tokens_with_a_grammar_stays_dense_and_leaves_other_rows_certified(restore_row_deferred):
    """Row 0 has min_tokens and a grammar that allows only its stop tokens: vLLM's min_tokens
    processor masks them and then restores them (the row had nothing else), which is not a per-token
    step. The plan leaves such a row dense; the other deferred rows (one of them with min_tokens
    and no grammar) are still certified and draw what vLLM draws. Were row 0 deferred, every
    deferred row goes dense, and still draws what vLLM draws."""
    import dataclasses

    from vllm.v1.sample.logits_processor import LogitsProcessors

    patches.install_samplers()
    g = torch.Generator().manual_seed(12)
    W, head = structured_head("argmax_removed", seed=35)
    h = hidden_near_rows(W, B, g, scale=3.0)
    md = metadata(g, [0.0 if i % 2 else 0.9 for i in range(B)], seeded=range(0, B, 3), penalties=False,
                  bias=False, allowed=False, bad=False)
    stop = [5, 7]
    md = dataclasses.replace(md, logitsprocs=LogitsProcessors([min_tokens_processor({0: True, 2: False}, stop)]))
    dense = head.dense_logits(h)
    allowed = grammar("argmax_removed", dense, list(range(0, B, 2)), g)
    allowed[0] = torch.zeros(V, dtype=torch.bool)
    allowed[0][stop] = True
    want_logits = dense.clone()
    apply_grammar(want_logits, allowed, list(range(B)))
    want = run(Sampler(), want_logits, md, seed=5)
    rows = torch.arange(0 if restore_row_deferred else 1, B)
    got, st = hooked_structured(head, h, dense, md, allowed, list(range(B)), rows, seed=5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert int(want[0][0]) in stop  # vLLM restored the stop tokens of row 0
    if restore_row_deferred:
        assert sum(st.certified.values()) == 0 and st.fallbacks == {"unsupported": B}
    else:
        assert sum(st.certified.values()) > (B - 1) // 2 and "unsupported" not in st.fallbacks


@pytest.mark.parametrize("all_random", [True, False])
def test_temperature_copy_is_vllms_division_bit_for_bit(all_random):
    """The bounds' map divides out of place (``temperature_copy``): the same quotients as vLLM's
    in-place ``apply_temperature`` on every value class (subnormal, huge, inf, NaN, -0) and every
    temperature class (greedy 0 and below _SAMPLING_EPS, tiny, huge), and ``x`` left unchanged;
    a sampler whose ``apply_temperature`` is not vLLM's keeps the copy-and-call path."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 700, generator=g) * torch.logspace(-40, 38, 700)
    x[:, :6] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 1e-45, 3.4e38])
    temp = torch.tensor([0.0, 1e-6, 1e-5, 1e-4, 0.3, 0.8, 1.0, 7.0, 1e4])
    if all_random:
        temp[:3] = torch.tensor([2e-5, 0.5, 3.0])
    before = x.clone()
    got = v1_sampler.temperature_copy(x, temp, all_random)
    want = Sampler.apply_temperature(x.clone(), temp, all_random)
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.view(torch.int32)[~got.isnan()], want.view(torch.int32)[~want.isnan()])  # -0 too
    assert torch.equal(x.nan_to_num(), before.nan_to_num())
    assert v1_sampler._stock_temperature(Sampler())

    class Other(Sampler):
        @staticmethod
        def apply_temperature(logits, temp, all_random):
            return logits.mul_(2.0)

    assert not v1_sampler._stock_temperature(Other())


@pytest.mark.parametrize("case", ["temperature", "penalties", "bias", "allowed", "bad", "empty_processors"])
def test_rows_are_mapped_by_column_only_when_no_processor_acts(case, monkeypatch):
    """The later rounds map only the contenders' columns (``certify_rows(columns=)``) where vLLM's
    logits processors leave every row alone this step (``_processors_idle``: then the map is the
    temperature, per row); with penalties, a logit bias, allowed ids or bad words they map the
    full rows. Either way the hooked sampler draws vLLM's tokens."""
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    patches.install_samplers()
    g = torch.Generator().manual_seed(8)
    W, _ = peaked_head(V, D, seed=19, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    h = hidden_near_rows(W, B, g, scale=1.0)
    temps = [0.0 if i % 4 == 0 else 0.7 for i in range(B)]
    kw = dict(penalties=case == "penalties", bias=case == "bias", allowed=case == "allowed", bad=case == "bad")
    md = metadata(g, temps, seeded=range(1, B, 2), **kw)
    if case == "empty_processors":  # vLLM's logit-bias and min_tokens processors with no request using them
        lb = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
        mt = MinTokensLogitsProcessor.__new__(MinTokensLogitsProcessor)
        mt.min_toks = {}
        md.logitsprocs = LogitsProcessors([lb, mt])
    idle = case in ("temperature", "empty_processors")
    assert v1_sampler._processors_idle(md) == idle
    seen_columns = []
    real = v1_sampler.certify_rows
    monkeypatch.setattr(v1_sampler, "certify_rows",
                        lambda *a, **k: seen_columns.append(k.get("columns")) or real(*a, **k))
    sampler = Sampler()
    dense = head.dense_logits(h)
    want = run(sampler, dense.clone(), md, seed=3)
    logits = dense.clone()
    rows = torch.arange(B)
    logits[rows] = csv_step.PLACEHOLDER
    seen = []
    hand_off(sampler, csv_step.Deferred(logits, h.clone(), rows, ["sampling"] * B, HeadAdapter(head),
                                                 lambda: head.dense_logits(h), Tally(seen.append).account()))
    got = run(sampler, logits, md, seed=3)
    assert torch.equal(got[0], want[0])
    assert (seen_columns[0] is not None) == idle
    assert sum(seen[0].certified.values()) > B // 2


def _switched_run(monkeypatch, certificate_cost: float, steps: int = 160, builds: list | None = None):
    """Drive the plugin's layer and the hooked sampler over ``steps`` steps of 8 deferred top-k
    rows with the off-switch on, on a fake clock: vLLM's dense head costs 1.0, vLLM's top-k pass
    in its sampler 1.0 (dense steps run it; a CSV step whose rows are all certified skips it),
    the certificate in the sampler ``certificate_cost``. Returns (steps that tried CSV, the switch);
    every step's draw is checked against vLLM's on the dense logits. With ``builds`` each step's
    plan is a lazy one with a batch identity, as V1's runner opens its steps (the fast lane then
    takes steps before their plan is built), and each plan built appends to ``builds``."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    from vllm_csv.metrics import CSVMetrics

    patches.install_samplers()
    clock = FakeClock()
    clock.install(monkeypatch)
    Bs = 8
    g = torch.Generator().manual_seed(8)
    W, _ = peaked_head(V, D, seed=19, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5))  # off-switch on
    h = hidden_near_rows(W, Bs, g, scale=3.0)  # confident rows: every one certifies
    md = metadata(g, [0.8] * Bs, seeded=range(0, Bs, 2), penalties=False, bias=False, allowed=False, bad=False,
                  top_k=True)
    dense = head.dense_logits(h)

    def dense_forward(self, lm_head, hidden, bias=None, skip_gather=False):
        clock.now += 1.0
        return head.dense_logits(hidden)

    real_mask, real_certify, tried = tts.apply_top_k_top_p, v1_sampler.certify_rows, []

    def mask(logits, k, p):
        clock.now += 0.0 if k is None else 1.0
        return real_mask(logits, k, p)

    def certify(*a, **k):
        clock.now += certificate_cost
        tried[-1] = True
        return real_certify(*a, **k)

    monkeypatch.setattr(LogitsProcessor, "forward", dense_forward)
    monkeypatch.setattr(tts, "apply_top_k_top_p", mask)
    monkeypatch.setattr(v1_sampler, "certify_rows", certify)
    layer = csv_layer(head, CSVMetrics(f"switched-{certificate_cost}-{builds is None}", {"vocab_size": V}))
    plan = Plan([str(i) for i in range(Bs)], [DEFER] * Bs, ["top_k"] * Bs, [0.8] * Bs)
    batch = object()  # (the runner's batch identity: one batch throughout)
    sampler = Sampler()
    channel = _runner_channel(layer, sampler)
    for step in range(steps):
        want = run(sampler, dense.clone(), md, seed=step)[0]
        tried.append(False)
        channel.open(plan if builds is None else
                     csv_step.LazyPlan(None, lambda runner, k: builds.append(1) or plan, 64, batch=lambda runner: batch))
        logits = layer.forward(None, h)
        channel.close_plan()
        assert torch.equal(run(sampler, logits, md, seed=step)[0], want), step
    return sum(tried), head.off_switch


def test_the_sampler_steps_lane_before_the_plan_is_built(monkeypatch):
    """The fast lane of steps with rows for the sampler (two in eight timed with vLLM's sampler
    call, a hand-off for those only) taken before the step's plan is built, by the runner's batch
    identity (V1's), is the lane taken by plan: the same steps try CSV, with the same draws, the
    same ledger and the same estimates, and a fraction of the plans is built."""
    builds = []
    fast = _switched_run(monkeypatch, 2.6, builds=builds)
    monkeypatch.undo()
    slow = _switched_run(monkeypatch, 2.6)
    assert fast[0] == slow[0] and fast[0] < 30
    a, b = fast[1], slow[1]
    assert a.dense_seconds == b.dense_seconds and a.dense_seconds[(8, "sampler")] == pytest.approx(2.0)
    assert a.excess == pytest.approx(b.excess) and a.dense_total == pytest.approx(b.dense_total)
    assert len(builds) < 160 / 3, len(builds)


def test_off_switch_counts_the_sampler_passes_csv_skips(monkeypatch):
    """Steps with rows for the sampler are compared with vLLM's sampler call on both sides (key
    ``(B, "sampler")``): a certificate dearer than the dense head but cheaper than the head plus
    the vLLM top-k pass it saves stays on; one dearer than both turns off. With the head's time
    alone on both sides (the switch without in-place samples of that key) the first case turned
    off; the time around the head (issue 45: ``OffSwitch.observe_outside``, the sampler's pass
    falls outside the head's span) now shows the saving there too, and it stays on; without that
    charge it turns off as before. The draws are vLLM's in every step."""
    from vllm_csv.off_switch import WARMUP_STEPS, OffSwitch

    n = 160
    tried, sw = _switched_run(monkeypatch, 1.3)  # CSV 1.3 a step against dense 1.0 + 1.0
    assert sw.dense_seconds[(8, "sampler")] == pytest.approx(2.0)
    assert tried >= 0.9 * n and sw.times_tripped == 0, tried
    monkeypatch.undo()
    tried, sw = _switched_run(monkeypatch, 2.6)  # dearer than the head and the pass together
    assert tried <= 0.1 * n + WARMUP_STEPS and sw.times_tripped >= 1, tried  # (the kind's warm-up uncharged)
    # the switched-off steps (the fast lane's among them) were timed with the sampler call too
    assert sw.dense_seconds[(8, "sampler")] == pytest.approx(2.0)
    monkeypatch.undo()
    monkeypatch.setattr(OffSwitch, "samples_in_place", False)  # the head's time alone on both sides
    tried, sw = _switched_run(monkeypatch, 1.3)
    # (on after the first outside samples of each side: the dense ones come from the probes)
    assert (8, "sampler") not in sw.dense_seconds and tried >= 0.75 * n, tried
    assert sw.outside_excess(8) == pytest.approx(-1.0)  # the top-k pass CSV skips, seen around the head
    monkeypatch.undo()
    monkeypatch.setattr(OffSwitch, "samples_in_place", False)
    monkeypatch.setattr(OffSwitch, "outside_excess", lambda self, batch: 0.0)  # the switch before issue 45
    tried, sw = _switched_run(monkeypatch, 1.3)
    assert tried <= 0.1 * n + WARMUP_STEPS, tried


def _mask_rows(g, B, V, kind):
    """``[B, V]`` fp32 rows for vLLM's masks: random, tied, far tails, -inf, NaN, huge."""
    x = torch.randn(B, V, generator=g) * 3
    if kind == "ties":
        x = (x * 2).round() / 2  # many exact ties, at every level
    elif kind == "tails":
        x[:, ::3] -= 200.0  # tokens of fp32 probability 0
    elif kind == "special":
        x[0] = -math.inf
        x[1, 5] = math.nan
        x[2, :7] = math.inf
        x[3] *= 1e30
        x[4] = 1.0
    return x


@pytest.mark.parametrize("kind", ["random", "ties", "tails", "special"])
@pytest.mark.parametrize("masks", ["top_p", "top_k", "both"])
def test_masks_on_rows_equal_vllm_on_every_row(kind, masks):
    """vLLM's top-k / top-p run on the rows that have one only (``_masks_on_rows``): those rows
    bit for bit as vLLM's call on the whole batch; the rows left out (top-p 1, top-k V) unchanged,
    where vLLM's call drops only tokens far below the row's maximum (fp32 probability 0)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    def vllm(x, k, p):
        return apply_top_k_top_p_pytorch(x, k, p, allow_cpu_sync=True)

    g = torch.Generator().manual_seed(3)
    Bm, Vm = 24, 4099
    on_rows = v1_masks.masks_on_rows(vllm)
    for trial in range(4):
        x = _mask_rows(g, Bm, Vm, kind)
        need = torch.rand(Bm, generator=g) < (0.1, 0.4, 0.8, 1.0)[trial]
        p = torch.where(need, torch.rand(Bm, generator=g) * 0.98 + 0.01, 1.0) if masks != "top_k" else None
        k = torch.where(need, torch.randint(1, 60, (Bm,), generator=g), Vm) if masks != "top_p" else None
        if masks == "both":  # some rows with a top-k alone, some with a top-p alone
            p = torch.where(torch.arange(Bm) % 3 == 0, 1.0, p)
            k = torch.where(torch.arange(Bm) % 3 == 1, Vm, k)
            need = (p < 1.0) | (k < Vm)
        want = vllm(x.clone(), k, p)
        token = v1_masks._rows_only.set(True)  # (as inside v1_masks.draw_with_masks)
        try:
            got = on_rows(x.clone(), k, p)
        finally:
            v1_masks._rows_only.reset(token)
        assert torch.equal(got[need].nan_to_num(), want[need].nan_to_num()), (kind, masks, trial)
        assert torch.equal(got[need].isnan(), want[need].isnan())
        rest = ~need
        assert torch.equal(got[rest].nan_to_num(), x[rest].nan_to_num())  # left as they were
        dropped = (want[rest] == -math.inf) & (x[rest] > -math.inf)
        top = x[rest].nan_to_num(nan=-math.inf).amax(1, keepdim=True)
        assert bool((x[rest][dropped] < (top.expand_as(dropped)[dropped] - 87)).all())


def test_uncertified_top_p_row_is_masked_alone(monkeypatch):
    """A batch whose top-p rows are all certified but one: vLLM's sort runs on that row alone
    (not the batch), and the draw is vLLM's."""
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    patches.install_samplers()
    g = torch.Generator().manual_seed(8)
    W, _ = peaked_head(V, D, seed=19, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    h = hidden_near_rows(W, B, g, scale=3.0)
    md = metadata(g, [0.8] * B, seeded=range(0, B, 2), penalties=False, bias=False, allowed=False, bad=False,
                  top_p=0.7)
    dense = head.dense_logits(h)
    want = run(Sampler(), dense.clone(), md, seed=5)[0]
    sorted_rows = []
    real = tts.apply_top_k_top_p_pytorch
    monkeypatch.setattr(tts, "apply_top_k_top_p_pytorch",
                        lambda x, k, p, **kw: sorted_rows.append(x.shape[0]) or real(x, k, p, **kw))
    top_p_rows = torch.arange(B)[md.top_p < 1.0]
    rows = torch.arange(B)[torch.arange(B) != top_p_rows[3]]  # one top-p row not deferred: dense
    got, st = _hooked(head, h, dense, md, rows)
    assert torch.equal(got, want)
    assert sum(st.certified.values()) == rows.numel()
    assert sorted_rows == [1]


def test_a_slot_no_sampler_took_does_not_reach_the_next_step(monkeypatch):
    """A head call that deferred rows but whose sampler call never came: the next head call
    (here one vLLM's runner makes with no plan) clears the slot, so the next sampler call draws
    from its own logits, not with the earlier step's rows written into them."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    patches.install_samplers()
    g = torch.Generator().manual_seed(8)
    W, _ = peaked_head(V, D, seed=19, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    monkeypatch.setattr(LogitsProcessor, "forward", lambda self, lm, x, bias=None, skip_gather=False:
                        head.dense_logits(x))
    layer = csv_layer(head)
    h = hidden_near_rows(W, 4, g, scale=3.0)
    plan = Plan([str(i) for i in range(4)], [DEFER] * 4, ["sampling"] * 4, [0.8] * 4)
    channel = _runner_channel(layer, Sampler())
    channel.open(plan)
    layer.forward(None, h)  # rows deferred: a hand-off for this step's sampler
    channel.close_plan()
    assert isinstance(channel.step.handoff, csv_step.Deferred)
    layer.forward(None, h)  # the next head call, no plan: vLLM's own logits
    assert channel.step.handoff is None  # its sampler call takes nothing from the earlier step


@pytest.mark.parametrize("bad_row", [1, 4])  # a row certified in the head's call / one deferred to the sampler
def test_a_nonfinite_row_anywhere_in_the_step_sends_every_row_dense(bad_row, monkeypatch):
    """An ``inf`` in one hidden row of the step: the rows certified apart from it (in the head's
    call when it is deferred, in the sampler when it is in the head's call) are not certified
    either, since the dense GEMM of the whole batch may write NaN over finite rows (as torch's
    bf16 GEMM did on an Intel Xeon with AMX; CertifiedHead.prepare): emulated here by a dense
    head that does so. The draws are the dense ones, every row counted ``nonfinite``."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from vllm_csv.metrics import CSVMetrics

    patches.install_samplers()
    g = torch.Generator().manual_seed(9)
    W, _ = peaked_head(V, D, seed=19, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))

    def dense_forward(self, lm_head, x, bias=None, skip_gather=False):  # NaN over every row of a poisoned batch
        out = head.dense_logits(x)
        return out.masked_fill(~torch.isfinite(x).all(), math.nan)

    monkeypatch.setattr(LogitsProcessor, "forward", dense_forward)
    h = hidden_near_rows(W, 6, g, scale=3.0)
    h[bad_row, 3] = math.inf
    temps = [0.0, 0.0, 0.0, 0.8, 0.8, 0.8]
    md = metadata(g, temps, seeded=[3, 5], penalties=False, bias=False, allowed=False, bad=False)
    seen = []
    metrics = CSVMetrics(f"nonfinite-{bad_row}", {"vocab_size": V})
    monkeypatch.setattr(metrics, "record", lambda stats, *a, **k: seen.append(stats))
    layer = csv_layer(head, metrics)
    plan = Plan([str(i) for i in range(6)], [1, 1, 1] + [DEFER] * 3,
                          ["greedy"] * 3 + ["sampling"] * 3, temps)
    sampler = Sampler()
    want = run(sampler, dense_forward(None, None, h), md, seed=2)[0]
    channel = _runner_channel(layer, sampler)
    channel.open(plan)
    logits = layer.forward(None, h)
    channel.close_plan()
    assert torch.equal(run(sampler, logits, md, seed=2)[0], want)
    assert sum(s.certified for s in seen) == 0 and sum(s.fallbacks.get("nonfinite", 0) for s in seen) == 6, seen


@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "processed_logprobs"])
def test_a_batch_asking_for_logprobs_is_drawn_by_vllm(logprobs_mode):
    """Every row certified but logprobs asked for: vLLM's own sampler runs on the filled logits
    (its logprobs read them), and the tokens and random streams are the dense run's; without
    logprobs the hook's tokens are the draw (no vLLM sampler call)."""
    patches.install_samplers()
    g = torch.Generator().manual_seed(8)
    W, _ = peaked_head(V, D, seed=19, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    h = hidden_near_rows(W, B, g, scale=3.0)
    md = metadata(g, [0.8] * B, seeded=range(0, B, 2), penalties=False, bias=False, allowed=False, bad=False)
    dense = head.dense_logits(h)
    calls = []
    real = v1_sampler.draw_with_masks
    for num_logprobs in (None, 2):
        md.max_num_logprobs = num_logprobs
        sampler = Sampler(logprobs_mode=logprobs_mode)
        want = run(sampler, dense.clone(), md, seed=5)
        v1_sampler.draw_with_masks = lambda *a, **k: calls.append(num_logprobs) or real(*a, **k)
        try:
            got, st = _hooked(head, h, dense, md, torch.arange(B), full=True, sampler=sampler)
        finally:
            v1_sampler.draw_with_masks = real
        assert sum(st.certified.values()) == B
        assert all(torch.equal(a, b) for a, b in zip(got[:2], want[:2]))
        assert all(torch.equal(got[2][i], want[2][i]) for i in want[2])
    assert calls == [2]


@pytest.mark.parametrize("case", ["greedy", "greedy_biased", "greedy_penalised", "sampled"])
def test_certified_rows_beside_greedy_rows_are_drawn_by_the_hook(case, monkeypatch):
    """A batch whose deferred rows all certify and whose other rows are greedy rows no processor
    touches (``greedy``: certified in the head or dense, here dense) is drawn by the hook: vLLM's
    ``Sampler.sample`` does not run; tokens, global RNG and generators are the dense run's. A
    greedy row with a logit bias or penalties, or a sampled row, not deferred: vLLM draws the
    batch. A hook that takes the greedy rows' raw argmax anyway is caught."""
    patches.install_samplers()
    g = torch.Generator().manual_seed(21)
    W, _ = peaked_head(V, D, seed=22, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    h = hidden_near_rows(W, B, g, scale=3.0)  # confident rows: every one certifies
    temps = [0.0 if i % 3 == 0 else 0.8 for i in range(B)]
    if case == "sampled":
        temps[0] = 0.8
    md = metadata(g, temps, seeded=range(1, B, 2), penalties=case == "greedy_penalised", bias=False,
                  allowed=False, bad=False)
    dense = head.dense_logits(h)
    if case == "greedy_biased":  # row 0 (greedy, not deferred): its top token pushed down
        md.logitsprocs = LogitsProcessors([logit_bias_processor({0: {int(dense[0].argmax()): -100.0}})])
    if case == "greedy_penalised":  # row 0: its top token already output, penalised
        md.output_token_ids[0] = [int(dense[0].argmax())] * 3
        md.frequency_penalties[0] = 50.0
    rows = torch.arange(1, B)  # row 0 is not deferred
    want = run(Sampler(), dense.clone(), md, seed=5)
    calls = []
    orig = Sampler.sample
    monkeypatch.setattr(Sampler, "sample", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    got, st = _hooked(head, h, dense, md, rows, full=True)
    assert all(torch.equal(a, b) for a, b in zip(got[:2], want[:2]))  # the tokens, the global RNG
    assert all(torch.equal(got[2][i], want[2][i]) for i in want[2])  # every request generator
    assert sum(st.certified.values()) == rows.numel()
    assert bool(calls) == (case != "greedy")
    if case != "sampled":  # the greedy row's own processors ignored: caught
        def raw(sampler, logits, md, dev_rows, winner):
            tokens = logits.float().argmax(1)
            tokens[dev_rows] = winner
            return tokens
        monkeypatch.setattr(v1_sampler, "_with_greedy_rows", raw)
        wrong, _ = _hooked(head, h, dense, md, rows, full=True)
        assert torch.equal(wrong[0], want[0]) == (case == "greedy")


def _exact_k(logits, k, p):
    """A stand-in for vLLM's Triton top-k (Qrita, ``apply_top_k_top_p_triton``), in torch: exactly
    ``k`` tokens kept a row, ties at the k-th value broken by position (the later ones dropped)."""
    assert p is None
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(logits.shape[1]).expand_as(order).contiguous())
    return logits.masked_fill(rank >= k.long().unsqueeze(1), -math.inf)


def _tied_top_k(monkeypatch, triton: bool):
    """16 top-k 2 rows whose 2nd and 3rd tokens tie exactly, deferred, through the hooked
    sampler and vLLM's dense sampler, with vLLM's Triton masks (``triton``: vLLM-CPU with a
    Triton CPU backend, ``HAS_TRITON``; emulated by :func:`_exact_k`) or torch's."""
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    monkeypatch.setattr(tts, "HAS_TRITON", triton)
    monkeypatch.setattr(tts, "apply_top_k_top_p_triton", _exact_k, raising=False)
    patches.install_samplers()
    n, Vt, Dt = 16, 64, 16
    g = torch.Generator().manual_seed(0)
    W = torch.randn(Vt, Dt, generator=g) * 0.05
    W[:, 0] = -6.0 + 0.1 * torch.randn(Vt, generator=g)
    W[0, 0], W[2, 0] = 2.0, 1.5
    W[1] = W[2]  # tokens 1 and 2: the same row
    W = W.to(torch.bfloat16)
    h = torch.zeros(n, Dt, dtype=torch.bfloat16)
    h[:, 0] = 1.0
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    md = metadata(g, [1.0] * n, seeded=range(n), penalties=False, bias=False, allowed=False, bad=False, V=Vt)
    md.top_k = torch.full((n,), 2)
    dense = head.dense_logits(h)
    want = run(Sampler(), dense.clone(), md, seed=1)
    rows = torch.arange(n)
    logits = dense.clone()
    logits[rows] = csv_step.PLACEHOLDER
    seen = []
    hand_off(sampler := Sampler(), csv_step.Deferred(logits, h.clone(), rows, ["top_k"] * n, HeadAdapter(head),
                                                     lambda: head.dense_logits(h), Tally(seen.append).account()))
    got = run(sampler, logits, md, seed=1)
    return got[0], want[0], seen[0]


@pytest.mark.parametrize("triton", [False, True])
def test_top_k_rows_under_vllms_triton_masks_are_dense(triton, monkeypatch):
    """vLLM-CPU with a Triton CPU backend masks top-k with its Triton kernel, which keeps exactly
    ``k`` among tied values; the certificate models torch's mask (every tie kept). There the
    hook certifies no top-k or top-p batch (``v1.sampler.torch_masks``) and the plans keep top-k
    rows out of the head and the sampler; tokens are vLLM's either way."""
    got, want, st = _tied_top_k(monkeypatch, triton)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    assert sum(st.certified.values()) == (0 if triton else 16)
    runner = type("Runner", (), {})()
    runner.sampler = Sampler()
    from vllm_csv.vllm_plugin.v1 import plan as v1_plan

    assert v1_plan.top_k_in_sampler(runner) is v1_plan.top_k_in_head(runner) is (not triton)


def test_top_k_rows_under_vllms_triton_masks_fail_if_certified(monkeypatch):
    """Broken-check check: certified under the Triton masks, some tied rows draw the token vLLM
    drops."""
    monkeypatch.setattr(v1_sampler, "torch_masks", lambda: True)
    got, want, st = _tied_top_k(monkeypatch, True)
    assert sum(st.certified.values()) == 16 and not torch.equal(got, want)
