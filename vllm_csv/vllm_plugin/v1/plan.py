"""The V1 runner's plan (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, also vLLM-CPU's):
one :class:`~..plan.Plan` entry per request, in the batch's row order, from the runner's
per-request states."""

from __future__ import annotations

from ..plan import Plan, plannable, row_plan, sampler_ok
from . import spec
from .sampler import certifiable_sampler, draws_on_cpu, torch_masks


def top_k_in_sampler(runner) -> bool:
    """Whether the V1 ``runner``'s sampled top-k rows are certified in its sampler rather than
    in the head: its sampler is the one :mod:`.sampler` certifies (vLLM-CPU's Gumbel
    sampler) and there is no tensor parallelism (the sharded certificate does not decide top-k).
    The sampler's certificate needs the drawn token only; the head's needs the ``k`` kept
    values bit for bit, which a bf16 row deep in its top-k often does not give (the demo
    model's ``top_k = 20`` rows: 29% certified in the head, 100% in the sampler). Not with
    vLLM's Triton masks (:func:`~.sampler.torch_masks`). Read once per runner."""
    return sampler_ok(runner, "_csv_top_k_in_sampler", _top_k_certifiable)


def _top_k_certifiable(sampler) -> bool:
    return certifiable_sampler(sampler) and torch_masks()


def top_k_in_head(runner) -> bool:
    """Whether the V1 ``runner``'s sampled top-k rows may be certified in the head: its sampler
    keeps every token at least the k-th value and draws among them, the kept-set certificate's
    model (vLLM-CPU's ``TopKTopPSampler.forward_cpu``, torch's top-k mask). Not on CUDA: there
    ``forward_cuda`` draws a batch without per-request generators with FlashInfer's
    ``top_k_sampling_from_probs`` (rejection sampling over the whole row's probabilities: a row
    holding only the top-k set draws another token from the same random numbers), and its
    native path masks with vLLM's Triton top-k (Qrita: exactly ``k`` kept, values within 1e-9
    taken as duplicates), neither of which the certificate models; nor on a CPU where vLLM found
    a Triton backend, which masks with that Triton top-k too (:func:`~.sampler.torch_masks`).
    Read once per runner."""
    cached = runner.__dict__.get("_csv_top_k_in_head")
    if cached is None:
        cached = runner._csv_top_k_in_head = draws_on_cpu(getattr(runner, "sampler", None)) and torch_masks()
    return cached


def batch_key(runner) -> object:
    """The V1 ``runner``'s batch identity (:meth:`~..step.LazyPlan.batch_key`): vLLM's
    ``InputBatch.sampling_metadata``, which ``InputBatch.refresh_metadata`` (every step, in
    ``_update_states``, before the logits) replaces by a new object whenever a generating
    model's batch changed (a request added, removed or moved; a streaming session's next chunk,
    with new parameters, is removed and added again: ``GPUModelRunner._update_streaming_request``;
    for a pooling model a move does not count, but a pooling model has no logits call), and a new
    ``InputBatch`` has its own. Read in vLLM 0.32.0; 0.33.0's ``gpu_input_batch.py`` is the same
    file and its ``_update_streaming_request`` the same code (``tests/test_plugin_plan.py``
    drives vLLM's own ``InputBatch``). None under speculative decoding (the plan changes with
    each step's draft tokens) and where the runner has none."""
    if spec.spec_config(runner) is not None:
        return None
    return getattr(getattr(runner, "input_batch", None), "sampling_metadata", None)


def build_plan(runner, max_topk: int, req_ids=None, spec_tokens=None) -> Plan | None:
    """The V1 runner's plan, in the batch's row order. While the batch holds the very same
    request states with the very same sampling parameters (identity: a new request, even one
    reusing an id, is a new state; a streaming-input session's next chunk keeps its state and
    brings new parameters, ``GPUModelRunner._update_streaming_request``) the last plan is handed
    out again, derived fields included: a decode step then costs one lookup a row. The cache
    holds the states and parameters it was built from, so their ids cannot be reused meanwhile.
    With speculative decoding, the rows of each request's draft tokens (``spec_tokens``:
    ``scheduler_output.scheduled_spec_decode_tokens``), greedy requests' certified
    (:mod:`.spec`)."""
    batch = runner.input_batch
    cfg = spec.spec_config(runner)
    # (prompt logprobs: the asking request's row is dense (plan_row), and vLLM computes them in
    # sample_tokens, after execute_model closed the step's plan: that logits call finds none)
    if not plannable(runner, speculative_ok=True) or (cfg is not None and not spec.standard_verification(cfg)):
        return None
    states = tuple(map(runner.requests.get, batch.req_ids))
    params = tuple(getattr(st, "sampling_params", None) for st in states)
    cached = getattr(runner, "_csv_plan", None)
    if cached is not None and cached[1] == max_topk and len(cached[0]) == len(states) and \
            all(a is b for a, b in zip(cached[0], states)) and all(a is b for a, b in zip(cached[3], params)):
        plan = cached[2]
    else:
        in_sampler, in_head = top_k_in_sampler(runner), top_k_in_head(runner)
        rows = [_row(st, max_topk, in_sampler, in_head) for st in states]
        plan = Plan(list(batch.req_ids), [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
        runner._csv_plan = (states, max_topk, plan, params)
    if cfg is not None:
        return spec.cached_target_plan(runner, plan, spec.draft_counts(spec_tokens, plan.req_ids))
    return plan


def _row(state, max_topk: int, in_sampler: bool = False, in_head: bool = True) -> tuple[int, str, float]:
    """``(k, mode, temperature)`` of a request's row: a function of its sampling parameters
    alone, so it is computed once per parameters object and kept on vLLM's per-request state
    (which lives as long as the request) instead of every step (about 10 us a row, 0.6 ms a step at 64 rows). A
    sampled top-k row planned in the head is dense unless ``in_head`` (:func:`top_k_in_head`)."""
    sp = getattr(state, "sampling_params", None)
    cached = getattr(state, "_csv_row", None)
    if cached is not None and cached[0] == (max_topk, in_sampler, in_head) and cached[2] is sp:
        return cached[1]
    row = row_plan(sp, max_topk, in_sampler)
    if row[0] > 0 and row[2] > 0.0 and not in_head:
        row = (0, "", row[2])  # (its temperature kept: a speculative step reads whether the batch is all greedy)
    if state is not None:
        state._csv_row = ((max_topk, in_sampler, in_head), row, sp)  # (sp: a streaming chunk's new parameters)
    return row

