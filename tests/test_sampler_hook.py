"""The wrapped V1 Sampler on certified rows == vLLM's Sampler on dense logits (same seeds),
with temperature, seeded generators, penalties, logit_bias, allowed ids and bad words; the
RNG streams stay in step."""

import pytest
import torch

from conftest import hidden_near_rows, peaked_head

pytest.importorskip("vllm")
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from vllm_csv import CertifiedHead, HeadConfig  # noqa: E402
from vllm_csv.sampling.head_adapter import HeadAdapter  # noqa: E402
from vllm_csv.vllm_plugin import sampler_hook  # noqa: E402

V, D, B = 1024, 48, 24


def min_p_processor(values):
    """vLLM's MinPLogitsProcessor in the state update_state leaves it in (CPU)."""
    p = MinPLogitsProcessor.__new__(MinPLogitsProcessor)
    p.min_p_cpu_tensor = torch.tensor(values, dtype=torch.float32)
    p.min_p_cpu = p.min_p_cpu_tensor.numpy()
    p.min_p_count = int((p.min_p_cpu_tensor > 0).sum())
    p.use_double_tensor = False
    p.min_p_device = p.min_p_cpu_tensor
    p.min_p = p.min_p_device[:len(values)].unsqueeze(1)
    return p


def metadata(g, temps, seeded, penalties, bias, allowed, bad, top_p=None, min_p=None, V=V):
    B = len(temps)
    temp = torch.tensor(temps, dtype=torch.float32)
    greedy = temp < 1e-5
    gens = {i: torch.Generator().manual_seed(1000 + i) for i in seeded}
    out_tokens = [torch.randint(0, V, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(B)]
    prompt = torch.randint(0, V, (B, 7), generator=g)
    procs = []
    if bias:
        lb = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
        lb.biases = {i: {int(t): float(v) for t, v in zip(torch.randint(0, V, (3,), generator=g),
                                                          torch.randn(3, generator=g) * 4)}
                     for i in range(0, B, 2)}
        reqs = [r for r, d in lb.biases.items() for _ in d]
        toks = [t for d in lb.biases.values() for t in d]
        lb.bias_tensor = torch.tensor([v for d in lb.biases.values() for v in d.values()])
        lb.logits_slice = (torch.tensor(reqs, dtype=torch.int32), torch.tensor(toks, dtype=torch.int32))
        procs.append(lb)
    mask = None
    if allowed:
        mask = torch.rand(B, V, generator=g) < 0.5  # True = not allowed
    bad_words = {i: [[int(torch.randint(0, V, (1,), generator=g))]] for i in range(1, B, 3)} if bad else {}
    pen = torch.zeros(B)
    if min_p is not None:
        procs.append(min_p_processor([0.0 if t < 1e-5 else min_p * (i % 3) / 2 for i, t in enumerate(temps)]))
    return SamplingMetadata(
        temperature=temp, all_greedy=bool(greedy.all()), all_random=bool((~greedy).all()), top_k=None,
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


CASES = {
    "temperature": dict(penalties=False, bias=False, allowed=False, bad=False),
    "penalties": dict(penalties=True, bias=False, allowed=False, bad=False),
    "bias_allowed_bad": dict(penalties=False, bias=True, allowed=True, bad=True),
    "everything": dict(penalties=True, bias=True, allowed=True, bad=True),
    "top_p": dict(penalties=False, bias=False, allowed=False, bad=False, top_p=0.8),
    "min_p": dict(penalties=False, bias=False, allowed=False, bad=False, min_p=0.2),
    "top_p_min_p_penalties": dict(penalties=True, bias=True, allowed=False, bad=False, top_p=0.6, min_p=0.05),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("T", [1e-6, 2e-5, 0.8, 1e4])  # vLLM draws greedily below 1e-5
def test_hooked_sampler_equals_dense_sampler(case, T):
    sampler_hook.install()
    g = torch.Generator().manual_seed(4)  # a seed at which certified top-p rows once drew dropped tokens
    W, _ = peaked_head(V, D, seed=17, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    h = hidden_near_rows(W, B, g, scale=1.5)
    temps = [0.0 if i % 4 == 0 else T for i in range(B)]
    md = metadata(g, temps, seeded=range(1, B, 2), **CASES[case])
    sampler = Sampler()
    dense = head.dense_logits(h)
    want = run(sampler, dense.clone(), md, seed=5)
    certified_total = top_p_certified = 0
    for rows in (torch.arange(B), torch.arange(0, B, 3)):  # all rows deferred; some deferred, others dense
        logits = dense.clone()
        logits[rows] = sampler_hook.PLACEHOLDER
        seen = []
        modes = ["top_p" if md.top_p is not None and md.top_p[i] < 1 else "sampling" for i in rows.tolist()]
        sampler_hook.defer(sampler_hook.Deferred(logits, h[rows].clone(), rows, modes,
                                                 HeadAdapter(head), lambda: head.dense_logits(h), seen.append))
        top_p_before = None if md.top_p is None else md.top_p.clone()
        got = run(sampler, logits, md, seed=5)
        if top_p_before is not None:
            assert torch.equal(md.top_p, top_p_before)  # the hook restored vLLM's values
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1], want[1])  # the global RNG is where the dense run left it
        assert all(torch.equal(got[2][i], want[2][i]) for i in want[2])  # and every request generator
        certified_total += sum(seen[0].certified.values())
        top_p_certified += seen[0].certified.get("top_p", 0)
    assert certified_total > B // 2, certified_total
    if md.top_p is not None and 1e-5 <= T < 100:  # greedy below 1e-5; at 1e4 the nucleus is most of V
        assert top_p_certified > 0


def test_sampler_refuses_a_mismatched_batch():
    sampler_hook.install()
    W, g = peaked_head(V, D, seed=1, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", off_switch=False))
    h = hidden_near_rows(W, 4, g)
    sampler_hook.defer(sampler_hook.Deferred(torch.zeros(4, V), h, torch.arange(4), ["sampling"] * 4,
                                             HeadAdapter(head), lambda: head.dense_logits(h), lambda st: None))
    md = metadata(g, [1.0] * B, [], False, False, False, False)
    with pytest.raises(RuntimeError, match="refusing to sample from placeholders"):
        Sampler()(logits=torch.zeros(B, V), sampling_metadata=md)


def _spy_top_p(monkeypatch):
    """Record the ``p`` vLLM's CPU sampler hands to apply_top_k_top_p, per draw."""
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    seen, orig = [], tts.apply_top_k_top_p

    def spy(logits, k, p):
        seen.append(None if p is None else p.clone())
        return orig(logits, k, p)
    monkeypatch.setattr(tts, "apply_top_k_top_p", spy)
    return seen


def _hooked(head, h, dense, md, rows, seed=5):
    logits = dense.clone()
    logits[rows] = sampler_hook.PLACEHOLDER
    seen = []
    modes = ["top_p" if md.top_p is not None and md.top_p[i] < 1 else "sampling" for i in rows.tolist()]
    sampler_hook.defer(sampler_hook.Deferred(logits, h[rows].clone(), rows, modes, HeadAdapter(head),
                                             lambda: head.dense_logits(h), seen.append))
    return run(Sampler(), logits, md, seed)[0], seen[0]


@pytest.mark.parametrize("all_top_p_deferred", [True, False])
def test_vllm_top_p_is_skipped_only_when_every_top_p_row_is_certified(all_top_p_deferred, monkeypatch):
    """Every top-p row certified: vLLM's draw runs without top-p (no full-vocabulary sort) and
    draws what the dense sampler draws. A top-p row left dense (here: not deferred) keeps it."""
    sampler_hook.install()
    g = torch.Generator().manual_seed(8)
    W, _ = peaked_head(V, D, seed=19, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    h = hidden_near_rows(W, B, g, scale=3.0)  # confident rows: every one certifies
    md = metadata(g, [0.8] * B, seeded=range(0, B, 2), penalties=False, bias=False, allowed=False, bad=False,
                  top_p=0.7)
    dense = head.dense_logits(h)
    want = run(Sampler(), dense.clone(), md, seed=5)[0]
    seen_p = _spy_top_p(monkeypatch)
    rows = torch.arange(B) if all_top_p_deferred else torch.arange(B)[md.top_p == 1.0]  # top-p rows dense
    got, st = _hooked(head, h, dense, md, rows)
    assert torch.equal(got, want)
    assert sum(st.certified.values()) == rows.numel()
    assert (seen_p[-1] is None) == all_top_p_deferred


def test_rows_with_top_p_of_one_draw_like_vllm(monkeypatch):
    """top_p = 1.0 (vLLM's "no top-p") on deferred rows, beside a dense row with top_p < 1, so that
    vLLM applies its top-p to the whole batch: plain-sampling certificate, same draw as vLLM."""
    sampler_hook.install()
    g = torch.Generator().manual_seed(9)
    W, _ = peaked_head(V, D, seed=23, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    h = hidden_near_rows(W, B, g, scale=1.5)
    md = metadata(g, [0.8] * B, seeded=range(0, B, 3), penalties=False, bias=False, allowed=False, bad=False)
    md.top_p = torch.ones(B)
    md.top_p[0] = 0.5  # row 0: dense, with top-p
    dense = head.dense_logits(h)
    want = run(Sampler(), dense.clone(), md, seed=5)[0]
    seen_p = _spy_top_p(monkeypatch)
    got, st = _hooked(head, h, dense, md, torch.arange(1, B))
    assert torch.equal(got, want)
    assert set(st.certified) == {"sampling"} and sum(st.certified.values()) > B // 2
    assert seen_p[-1] is not None and torch.equal(seen_p[-1], md.top_p)  # vLLM's top-p, as without CSV
