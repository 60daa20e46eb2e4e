"""A step whose every row the head certified ``k = 1`` hands each row's token to the readers that
need only argmaxes (``vllm_plugin/step.py``, ``Top1``): the head's tokens are the dense argmax on
every family of rows (adversarial ones included) and screen; V1's ``Sampler`` on an all-greedy
batch draws them without a pass over ``[B, V]``, and only where its draw reads nothing else (no
logprobs, no processor acting, the very logits the head returned); a wrong token there is caught.
The speculative readers (V1's ``RejectionSampler``, a drafter's ``_greedy_sample``) are tested in
``tests/test_spec_decode.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_csv.errors import CSVError
from vllm_csv.head import selection
from vllm_csv.testing import audit

FAMILY_SCREENS = [(f, s) for f in sorted(audit.FAMILIES) for s in ("fp16", "int8", "int4", "ball")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family,screen", FAMILY_SCREENS)
def test_the_heads_tokens_are_the_dense_argmax(family, screen, dtype):
    """``last_top1`` after a step of ``k = 1`` rows: on every certified row the dense row's argmax
    (vLLM's ``argmax`` of its fp32 cast) and the argmax of the head's output row; None where some
    row asks ``k > 1`` or the strategy gives no tokens (the one-sided ball)."""
    g = torch.Generator().manual_seed(len(family) * 31 + len(screen))
    case = audit.FAMILIES[family](g, dtype)
    try:
        head = audit.make_head(case, screen, budget=0.5)
    except CSVError as e:  # (the fp16 screen refuses heads whose rows overflow fp16)
        pytest.skip(str(e))
    B = case.hidden.shape[0]
    dense = audit.dense_reference(case).float().argmax(-1)
    out, stats = head.sampler_logits(case.hidden, torch.ones(B, dtype=torch.long), lambda h: audit.dense_reference(case))
    top1, certified = head.last_top1, head.last_certified
    if screen == "ball":
        assert top1 is None
    elif top1 is None:  # (no candidate column at all: nothing certified)
        assert not bool(certified.any())
    else:
        assert top1.dtype == torch.int64 and top1.shape == (B,)
        assert torch.equal(top1[certified], dense[certified])
        assert torch.equal(top1[certified], out[certified].float().argmax(-1))
    if screen != "ball" and family in ("peaked", "norms"):
        assert stats.certified > 0  # (the comparison is not empty)
    head.sampler_logits(case.hidden, torch.tensor([1] * (B - 1) + [2]), lambda h: audit.dense_reference(case))
    assert head.last_top1 is None


# ---------------------------------------------------------------------------------------------
# V1's Sampler on an all-greedy batch

pytest.importorskip("vllm")
from vllm.model_executor.layers.logits_processor import LogitsProcessor  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from vllm_csv.testing.fakes import csv_layer, logit_bias_processor  # noqa: E402
from vllm_csv.vllm_plugin import patches, step as csv_step  # noqa: E402
from vllm_csv.vllm_plugin.plan import Plan  # noqa: E402


def greedy_metadata(B: int, logprobs: int | None = None, procs=()) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
        max_num_logprobs=logprobs, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(B),
        presence_penalties=torch.zeros(B), repetition_penalties=torch.ones(B),
        output_token_ids=[[] for _ in range(B)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(list(procs)), spec_token_ids=[[] for _ in range(B)])


@pytest.fixture
def greedy_step(monkeypatch):
    """``run(md, copy=False)``: a step of the CSV layer (every row planned greedy) and the wrapped
    ``Sampler.forward`` on its logits (``copy``: on a copy of them); returns the tokens, the dense
    run's tokens, whether the layer handed off tokens, and whether vLLM's ``Sampler.sample`` ran."""
    patches.install_samplers()
    g = torch.Generator().manual_seed(3)
    case = audit.FAMILIES["peaked"](g, torch.bfloat16)
    head = audit.make_head(case, "int8", budget=0.5)

    def dense(x):
        return audit.dense_reference(dataclasses.replace(case, hidden=x))

    monkeypatch.setattr(LogitsProcessor, "forward", lambda self, lm, x, bias=None, skip_gather=False: dense(x))
    layer, sampler = csv_layer(head), Sampler()
    channel = csv_step.StepChannel()
    layer.csv_channel = sampler.csv_channel = channel
    calls = []
    orig = Sampler.sample
    monkeypatch.setattr(Sampler, "sample", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    h = case.hidden[:6]
    B = h.shape[0]

    def run(md, copy=False):
        want = orig(sampler, dense(h).float(), md)[0]
        channel.open(Plan([str(i) for i in range(B)], [1] * B, ["greedy"] * B, [0.0] * B))
        logits = layer.forward(None, h)
        channel.close_plan()
        handed = isinstance(channel.step.handoff, csv_step.Top1)
        calls.clear()
        got = sampler(logits.clone() if copy else logits, md).sampled_token_ids[:, 0].long()
        assert channel.step.handoff is None  # taken, whatever the sampler did with it
        return got, want, handed, bool(calls)

    run.head, run.dense, run.h = head, dense, h
    return run


def test_a_greedy_batch_certified_in_the_head_is_drawn_from_its_tokens(greedy_step):
    got, want, handed, vllm_drew = greedy_step(greedy_metadata(6))
    assert bool(greedy_step.head.last_certified.all())  # (confident rows: every one certifies)
    assert handed and not vllm_drew
    assert torch.equal(got, want)


@pytest.mark.parametrize("case", ["logprobs", "bias", "copy"])
def test_vllm_draws_where_the_tokens_do_not_decide(case, greedy_step):
    """Logprobs asked for (vLLM reads the rows), a processor acting (a logit bias that moves a
    row's argmax), or logits that are not the head's own: vLLM's draw, the dense run's tokens."""
    B = 6
    procs = ()
    if case == "bias":
        top = int(greedy_step.dense(greedy_step.h)[2].float().argmax())
        procs = [logit_bias_processor({2: {top: -100.0}})]
    md = greedy_metadata(B, logprobs=2 if case == "logprobs" else None, procs=procs)
    got, want, handed, vllm_drew = greedy_step(md, copy=case == "copy")
    assert handed and vllm_drew
    assert torch.equal(got, want)


def test_a_wrong_token_handed_off_is_caught(greedy_step, monkeypatch):
    """Mutation: a head whose tokens are off by one; the comparison with vLLM's draw fails (the
    sampler's output is the hand-off's tokens, so the test above reads them)."""
    real = selection.select_two_sided

    def wrong(*a, **k):
        sel = real(*a, **k)
        return dataclasses.replace(sel, top1=(sel.top1 + 1) % sel.exact.shape[1])

    monkeypatch.setattr(selection, "select_two_sided", wrong)
    got, want, handed, vllm_drew = greedy_step(greedy_metadata(6))
    assert handed and not vllm_drew
    assert not torch.equal(got, want)
