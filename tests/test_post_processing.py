"""A model whose ``compute_logits`` changes the head's logits after the head (vLLM 0.32: Gemma 4's
``suppress_tokens`` by ``index_fill_``, Moondream 3's ``logits[:, answer_id] = -inf``, a logit
multiplier or soft-cap outside the layer, EAGLE-3's draft-to-target vocabulary map) gets the
dense head: the runner's first call runs dense and shows it (another tensor, or other bits than
the layer returned), the later steps open no plan, one warning; a call that returns another
tensor later is made again, dense (``patches.watch_logits``, ``step.Returned``). Before this, a
row certified ``k = 1`` came out as the suppressed token (the Top1 hand-off) or token 0 (its
other entries ``-inf``), and deferred rows were drawn from the head's logits without the
model's change.

Each case runs the model's ``compute_logits`` as vLLM's runners call it (the model bound by
``patches.bind``, in inference mode as vLLM's steps run), then vLLM's own ``Sampler``, against
the same model and sampler on the dense head (same seeds)."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from vllm_csv.testing import audit
from vllm_csv.testing.fakes import csv_layer

pytest.importorskip("vllm")
from vllm.model_executor.layers.logits_processor import LogitsProcessor  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from vllm_csv.vllm_plugin import patches, step as csv_step  # noqa: E402
from vllm_csv.vllm_plugin.plan import DEFER, Plan  # noqa: E402

B = 6


def _suppress(logits, ids):  # gemma4_mm.py: logits.index_fill_(1, suppress_idx, -inf)
    return logits.index_fill_(1, ids, -float("inf"))


def _set_inf(logits, ids):  # moondream3.py: logits[:, self._answer_id] = -inf
    logits[:, ids] = -float("inf")
    return logits


def _vocab_map(logits, ids):  # llama_eagle3.py: draft ids mapped into a larger target vocabulary
    V = logits.shape[1]
    out = logits.new_full((logits.shape[0], V + 5), -float("inf"))
    out[:, torch.arange(V) + 5] = logits
    return out


POST = {
    "suppress": _suppress,
    "set_inf": _set_inf,
    "scale": lambda logits, ids: logits * 0.5,  # muse_glimmer.py: logits * output_multiplier
    "soft_cap": lambda logits, ids: 3.0 * torch.tanh(logits / 3.0),  # diffusion_gemma.py, outside the layer
    "vocab_map": _vocab_map,
}


class Model(torch.nn.Module):
    """A model: its LM head is the plugin's layer; ``post`` runs after it in ``compute_logits``
    from its ``after``-th call on (0: every call)."""

    def __init__(self, layer, post=None, ids=None, after=0):
        super().__init__()
        self.logits_processor, self.post, self.ids, self.after, self.calls = layer, post, ids, after, 0

    def compute_logits(self, hidden_states):
        logits = self.logits_processor(None, hidden_states)
        self.calls += 1
        return logits if self.post is None or self.calls <= self.after else self.post(logits, self.ids)


@pytest.fixture
def head_case(monkeypatch):
    """A confident head (every greedy row certifies), vLLM's layer computing its dense logits."""
    g = torch.Generator().manual_seed(3)
    case = audit.FAMILIES["peaked"](g, torch.bfloat16)
    head = audit.make_head(case, "int8", budget=0.5)

    def dense(x):
        return audit.dense_reference(dataclasses.replace(case, hidden=x))

    monkeypatch.setattr(LogitsProcessor, "forward", lambda self, lm, x, bias=None, skip_gather=False: dense(x))
    patches.install_samplers()
    return SimpleNamespace(head=head, h=case.hidden[:B], dense=dense)


def _ids(case) -> torch.Tensor:
    """The ids the model changes: rows 0's and 3's dense argmax (the vocabulary map shifts all)."""
    d = case.dense(case.h).float()
    return torch.tensor(sorted({int(d[0].argmax()), int(d[3].argmax())}))


def _bound(case, post, after=0):
    """A runner holding ``Model(layer, post, after)`` and vLLM's ``Sampler``, bound as the plugin
    binds them (``patches.bind``), and its channel."""
    runner = SimpleNamespace(model=Model(csv_layer(case.head), POST[post] if post else None, _ids(case), after),
                             sampler=Sampler())
    return runner, patches.bind(runner)


def _metadata(temps, seeds=()):
    temp = torch.tensor(temps, dtype=torch.float32)
    greedy = temp < 1e-5
    return SamplingMetadata(
        temperature=None if bool(greedy.all()) else temp, all_greedy=bool(greedy.all()),
        all_random=bool((~greedy).all()), top_p=None, top_k=None,
        generators={i: torch.Generator().manual_seed(100 + i) for i in seeds}, max_num_logprobs=None,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(len(temps)),
        presence_penalties=torch.zeros(len(temps)), repetition_penalties=torch.ones(len(temps)),
        output_token_ids=[[] for _ in temps], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors([]), spec_token_ids=[[] for _ in temps])


def _draw(sampler, logits, md, seed=5):
    torch.manual_seed(seed)
    for i, gen in md.generators.items():
        gen.manual_seed(100 + i)
    return sampler(logits=logits, sampling_metadata=md).sampled_token_ids[:, 0]


def _step(runner, channel, plan, h, md):
    """One step as the V1 runner runs it: the plan opened, the model's logits, the sampler; the
    tokens and the step's hand-off as the layer left it."""
    with torch.inference_mode():  # (as vLLM's steps and sampler calls run: no version counters)
        channel.open(plan)
        logits = runner.model.compute_logits(h)
        channel.close_plan()
        handoff = channel.step.handoff
        return _draw(runner.sampler, logits, md), handoff


def _want(case, post, md):
    """The same model's logits on the dense head, through vLLM's sampler."""
    logits = case.dense(case.h)
    return _draw(Sampler(), POST[post](logits, _ids(case)) if post else logits, md)


GREEDY = Plan([str(i) for i in range(B)], [1] * B, ["greedy"] * B, [0.0] * B)
SAMPLED = Plan([str(i) for i in range(B)], [1, DEFER, 1, DEFER, DEFER, 1],
               ["greedy", "sampling", "greedy", "sampling", "sampling", "greedy"], [0.0, 0.9, 0.0, 0.9, 0.9, 0.0])
PLANS = {"greedy": (GREEDY, [0.0] * B), "sampled": (SAMPLED, SAMPLED.temps)}


def _md(rows):
    plan, temps = PLANS[rows]
    return plan, _metadata(temps, seeds=[i for i, t in enumerate(temps) if t > 0])


@pytest.mark.parametrize("rows", sorted(PLANS))
@pytest.mark.parametrize("post", sorted(POST))
def test_a_model_that_changes_the_heads_logits_gets_vllms_tokens(post, rows, head_case, caplog):
    plan, md = _md(rows)
    runner, channel = _bound(head_case, post)
    want = _want(head_case, post, md)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # the first call shows it (dense), then the steps open no plan
            got, handoff = _step(runner, channel, dataclasses.replace(plan), head_case.h, md)
            assert torch.equal(got, want), (post, rows, got.tolist(), want.tolist())
            assert handoff is None
    assert channel.post_processing == "Model"
    warnings = [r for r in caplog.records if "changes the head's logits after the head" in r.getMessage()]
    assert len(warnings) == 1, caplog.text


@pytest.mark.parametrize("rows", sorted(PLANS))
@pytest.mark.parametrize("post", ["scale", "vocab_map"])
def test_a_call_that_returns_another_tensor_later_is_made_again_dense(post, rows, head_case):
    """A model whose change starts after the first call (none in vLLM 0.32 does): the call whose
    certified or deferred rows it would have changed is made again, dense."""
    plan, md = _md(rows)
    runner, channel = _bound(head_case, post, after=2)
    plain, changed = _want(head_case, None, md), _want(head_case, post, md)
    handed = []
    for i in range(4):
        got, handoff = _step(runner, channel, dataclasses.replace(plan), head_case.h, md)
        handed.append(type(handoff).__name__)
        assert torch.equal(got, plain if i < 2 else changed), (i, got.tolist())
    assert handed == ["NoneType", "Top1" if rows == "greedy" else "Deferred", "NoneType", "NoneType"]
    assert channel.post_processing == "Model"


@pytest.mark.parametrize("first", ["plain", "nan_row"])
@pytest.mark.parametrize("rows", sorted(PLANS))
def test_a_model_that_returns_the_heads_logits_keeps_csv(rows, first, head_case):
    """The plain ``compute_logits`` (most models): after the first call (dense, compared bit for
    bit: a NaN row compares equal to itself), CSV certifies, greedy steps hand their tokens to the
    sampler, and the tokens are the dense run's."""
    plan, md = _md(rows)
    runner, channel = _bound(head_case, None)
    want = _want(head_case, None, md)
    h0 = head_case.h.clone()
    if first == "nan_row":
        h0[2] = float("nan")
    handed = []
    for i in range(3):
        got, handoff = _step(runner, channel, dataclasses.replace(plan), h0 if i == 0 else head_case.h, md)
        handed.append(type(handoff).__name__)
        if i > 0 or first == "plain":
            assert torch.equal(got, want)
    assert channel.post_processing is None
    assert handed == ["NoneType"] + ["Top1" if rows == "greedy" else "Deferred"] * 2
    assert int(head_case.head.last_certified.sum()) > 0


@pytest.mark.parametrize("post", ["suppress", "vocab_map", None])
def test_a_drafter_that_changes_its_heads_logits_drafts_vllms_tokens(post, head_case):
    """Gemma 4's MTP drafter suppresses tokens after its head, EAGLE-3 maps its vocabulary: the
    wrapped ``_greedy_sample`` drafts what vLLM drafts (and a plain drafter keeps CSV)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    patches.install_runners(lambda runner: 64)
    proposer = SpecDecodeBaseProposer.__new__(SpecDecodeBaseProposer)
    ids = _ids(head_case)
    proposer.model = Model(csv_layer(head_case.head), POST[post] if post else None, ids)
    proposer.use_local_argmax_reduction = proposer.use_heterogeneous_vocab = False
    logits = head_case.dense(head_case.h)
    want = (POST[post](logits, ids) if post else logits).argmax(-1)
    for _ in range(2):  # (the first call dense, the second certified where the drafter is plain)
        with torch.inference_mode():
            assert torch.equal(proposer._greedy_sample(head_case.h), want)
    assert proposer._csv_channel.post_processing == ("Model" if post else None)
    if post is None:
        assert bool(head_case.head.last_certified.all())


def test_an_lm_head_lora_wrapper_gets_vllms_own_layer(head_case, monkeypatch):
    """With an adapter on ``lm_head`` vLLM wraps the layer in ``LogitsProcessorWithLoRA``, whose
    ``forward`` is ``type(base_layer).forward(wrapper, ...)``: the CSV layer's code with the wrapper
    as ``self``. It runs vLLM's own layer code on the wrapper (its ``_get_logits`` adds the
    adapter's delta), whatever the step's plan; before, it stopped on the wrapper's missing
    attributes."""
    from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA

    # vLLM's layer as it is (forward reads _get_logits), its head the dense reference
    monkeypatch.setattr(LogitsProcessor, "forward", lambda self, lm, x, bias=None, skip_gather=False:
                        self._get_logits(x, lm, bias, skip_gather))
    monkeypatch.setattr(LogitsProcessor, "_get_logits", lambda self, x, lm, bias=None, skip_gather=False:
                        head_case.dense(x))
    base = csv_layer(head_case.head)
    base.logits_as_input, base.scale, base.soft_cap = False, 1.0, None  # (vLLM's constructor's)
    wrapper = LogitsProcessorWithLoRA.__new__(LogitsProcessorWithLoRA)
    torch.nn.Module.__init__(wrapper)
    wrapper.base_layer = base
    delta = torch.zeros(head_case.head.vocab_size, dtype=torch.bfloat16)
    delta[_ids(head_case)] = 64.0  # the adapter moves most rows' argmax
    wrapper._get_logits = lambda h, lm, bias=None, skip_gather=False: head_case.dense(h) + delta
    runner, channel = _bound(head_case, None)
    runner.model.logits_processor = wrapper
    plan, md = _md("greedy")
    want = _draw(Sampler(), head_case.dense(head_case.h) + delta, md)
    for _ in range(3):
        got, handoff = _step(runner, channel, dataclasses.replace(plan), head_case.h, md)
        assert torch.equal(got, want) and handoff is None
