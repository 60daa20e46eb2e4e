"""The V2 runner's plan (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``, CUDA): one
:class:`~..plan.Plan` entry per request, in the batch's row order, from the sampling parameters
the runner's wrapped ``execute_model`` keeps per request (:mod:`..patches`)."""

from __future__ import annotations

from ..plan import DEFER, Plan, plannable, row_plan, sampler_ok
from . import spec
from .sampler import certifiable_sampler


def sampler_certifiable(runner) -> bool:
    """Whether the V2 ``runner``'s plain temperature-sampling rows are certified in its sampler
    (:func:`~.sampler.resolve`): the sampler is the one the hook certifies and there is
    no tensor parallelism. Read once per runner."""
    return sampler_ok(runner, "_csv_v2_sampler", certifiable_sampler)


# the rows the V2 sampler hook certifies (sampler.resolve)
MODES = ("sampling", "min_p", "processed", "structured", "top_k", "top_p")


def row_entry(row: tuple[int, str, float], in_sampler: bool) -> tuple[int, str]:
    """A V2 row's ``(k, mode)``: greedy rows in the head (``k = 1``); of the rows to certify in
    the sampler, temperature sampling with min-p, vLLM's native processors, structured output, a
    top-k or a top-p, or none of these, and greedy rows with processors or structured output
    (modes :data:`MODES`) where the V2 sampler is certified (``in_sampler``); the others dense.
    A sampled top-k row is deferred at any ``k`` (:func:`request_plan`): the head's kept-set
    certificate is V1's draw, not V2's. V2 masks a top-k or top-p row with vLLM's Triton kernels
    (Qrita: a pivot searched at most 18 times, values within ``1e-9`` taken as duplicates and
    dropped by position) before its Gumbel draw, or draws the batch with FlashInfer's fused
    sampler (no greedy request, no explicit seed, no processed logprobs in it), whose random
    numbers are not replayed; the hook certifies the first where the masks certainly keep the
    winner (the row's certain maximum, or under a top-k alone the draw among the tokens it surely
    keeps), and leaves the second dense
    (``sampler.resolve``)."""
    k, mode, t = row
    if k > 0 and (t == 0.0 or k == 1 and mode == "greedy"):
        return k, mode
    if k == DEFER and mode in MODES and in_sampler:
        return k, mode
    return 0, ""


def build_plan(runner, max_topk: int, req_ids=None, input_batch=None) -> Plan | None:
    """The plan of the V2 ``runner``'s ``sample`` call on ``input_batch`` (:mod:`..patches`), or
    None (every row dense): :func:`request_plan` of its requests without speculative decoding
    (a step with draft tokens there: none); with it, where the rejection sampler verifies greedy
    requests by their argmax (:func:`.spec.verification_ok`), the greedy requests' rows in the
    head, their target rows included (:func:`.spec.spec_plan`, in steps with and without
    drafts); none where the batch is sharded over ranks for sampling (``batch_sharder``), the
    last stage's logits are broadcast (:func:`..plan.plannable`), or the sampler returns each
    row's sampling mask (``return_sampling_mask``: the finite tokens of the processed logits,
    which a certified row, ``-inf`` outside its scored tokens, would narrow; vLLM 0.32/0.33 then
    refuse greedy requests, but the sampler and the rejection sampler return it for every row).
    Without ``input_batch``: :func:`request_plan` of ``req_ids``."""
    if input_batch is None:
        return request_plan(runner, max_topk, req_ids)
    if getattr(runner, "batch_sharder", None) is not None:
        return None
    if getattr(getattr(runner, "sampler", None), "return_sampling_mask", False):
        return None
    if plannable(runner):
        if getattr(input_batch, "num_draft_tokens", 0):
            return None
        return request_plan(runner, max_topk, input_batch.req_ids)
    if plannable(runner, speculative_ok=True) and spec.verification_ok(getattr(runner, "rejection_sampler", None)):
        return spec.spec_plan(runner, request_plan(runner, max_topk, input_batch.req_ids), input_batch)
    return None


def request_plan(runner, max_topk: int, req_ids) -> Plan:
    """The V2 runner's plan, one row a request, in the batch's row order, from the sampling parameters its
    ``execute_model`` kept per request (``_csv_sampling_params``; a row whose request is unknown
    is dense). As :func:`..v1.plan.build_plan`: while the batch holds the same requests (ids and their
    parameter objects, by identity) the last plan is handed out again, and each request's row is
    computed once. Rows to certify in the sampler: :func:`row_entry`."""
    params = runner.__dict__.get("_csv_sampling_params", {})
    ps = tuple(map(params.get, req_ids))
    cached = runner.__dict__.get("_csv_plan")
    if cached is not None and cached[1] == max_topk and cached[2].req_ids == list(req_ids) and \
            all(a is b for a, b in zip(cached[0], ps)):
        return cached[2]
    # req id -> (params, max_topk, row); execute_model drops a finished request's entry
    memo = runner.__dict__.setdefault("_csv_rows", {})
    rows = []
    for rid, p in zip(req_ids, ps):
        hit = memo.get(rid)
        if hit is None or hit[0] is not p or hit[1] != max_topk:
            hit = memo[rid] = (p, max_topk, row_plan(p, max_topk, top_k_in_sampler=True))
        rows.append(hit[2])
    in_sampler = sampler_certifiable(runner)
    entries = [row_entry(r, in_sampler) for r in rows]
    plan = Plan(list(req_ids), [k for k, _ in entries], [mode for _, mode in entries], [t for _, _, t in rows])
    runner._csv_plan = (ps, max_topk, plan)
    return plan


