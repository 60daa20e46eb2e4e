"""Which rows of the LM head may take the certified path this step.

``LogitsProcessor.forward`` sees hidden states, not sampling parameters. The model
runner knows both: we wrap the runner method that computes the sampling logits
(V1 ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model``, also used on CPU; V2
``vllm.v1.worker.gpu.model_runner.GPUModelRunner.sample``)
so that, while it runs, :func:`current_plan` returns one entry per request in the
order of the logits rows. Any call outside those methods (warm-up, profiling,
prompt logprobs, draft heads) or with an unexpected row count gets no plan, and
every row is dense.

``plan_row`` is the whole policy (SPEC, "Per-request features"): ``k > 0`` certifies
the exact top-k in the LM head (greedy is ``k = 1``); :data:`DEFER` certifies the row's
draw inside vLLM's sampler (:mod:`.sampler_hook`: plain temperature sampling, top-p and
min-p sampling, greedy or sampled rows with penalties, ``logit_bias``,
``allowed_token_ids``, bad words or ``min_tokens``, and greedy or sampled rows with structured
output, certified over the tokens the grammar allows; each also with ``top_k``, and plain
``top_k`` sampling above the head's limit, or at any ``k`` where the runner's sampler is the
one the hook certifies: :func:`top_k_in_sampler`); ``0`` is the dense path. :func:`row_mode`
names the mode for the metrics.

A row with structured output is never certified in the head, greedy included: the runner
applies the grammar bitmask to the head's output, after the head and before the sampler, and
may remove the head's certified token, leaving the sampler to pick among the other scored
tokens while a better allowed token outside ``S`` sits at ``-inf``. The sampler hook sees the
mask (:mod:`.sampler_hook`, where the reason it is sound is written down).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass

import torch

from ..vocabulary import MODES  # noqa: F401  (row_mode's labels)
from ..vocabulary import SAMPLING_EPS as _SAMPLING_EPS

DEFER = -1  # certify the row in vLLM's sampler, with the seed it draws (sampler_hook)
_local = threading.local()


@dataclass
class Plan:
    """One step's rows: the per-row entries, and what the head derives from them (computed at
    most once per plan: :func:`_v1_plan` and :func:`_v2_plan` hand the same plan to every step
    whose batch holds the same requests, so a decode run builds it once per change of the batch)."""

    req_ids: list[str]
    topk: list[int]  # per row: k > 0, DEFER or 0 (dense)
    modes: list[str] | None = None  # per row, row_mode (None: greedy for k == 1, else top_k)
    temps: list[float] | None = None  # per row: temperature of a sampled row, 0.0 greedy (None: all greedy)

    @functools.cached_property
    def deferred(self) -> list[int]:
        """Rows certified in the sampler (:data:`DEFER`)."""
        return [i for i, k in enumerate(self.topk) if k == DEFER]

    @functools.cached_property
    def in_head(self) -> list[int]:
        """Rows the head decides (certified there, or dense)."""
        return [i for i, k in enumerate(self.topk) if k != DEFER]

    @functools.cached_property
    def row_modes(self) -> list[str]:
        return list(self.modes or ["greedy" if k == 1 else "top_k" for k in self.topk])

    @functools.cached_property
    def row_temps(self) -> list[float]:
        return list(self.temps) if self.temps is not None else [0.0] * len(self.topk)

    @functools.cached_property
    def topk_tensor(self) -> torch.Tensor:
        """``topk`` as the head's ``[B]`` int64 host tensor (read, never written)."""
        return torch.tensor(self.topk, dtype=torch.long)

    def split(self, max_certified_k: int):
        """The head's :func:`~vllm_csv.head.row_split` of the rows it decides (deferred rows
        count as dense there), kept per ``max_certified_k``."""
        cache = self.__dict__.setdefault("_splits", {})
        if max_certified_k not in cache:
            from ..head import row_split

            cache[max_certified_k] = row_split([max(k, 0) for k in self.topk], max_certified_k)
        return cache[max_certified_k]

    @functools.cached_property
    def csv_rows(self) -> int:
        """Rows asking for CSV, in the head or in the sampler."""
        return sum(k != 0 for k in self.topk)

    @functools.cached_property
    def temperature(self) -> torch.Tensor | None:
        """The head's ``temperature`` argument: None when every row is greedy (``0``), which the
        head reads as the same thing and certifies with its plain comparisons (fused on the CPU)."""
        t = self.row_temps
        return torch.tensor(t, dtype=torch.float32) if any(x > 0 for x in t) else None


def _processed(sp) -> bool:
    """Features applied by vLLM's logits processors / penalties before the draw, each
    monotone per token (sampler_hook runs vLLM's own code on the bounds)."""
    return bool(sp.logit_bias or sp.allowed_token_ids or sp.bad_words or getattr(sp, "bad_words_token_ids", None)
                or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0
                or sp.min_tokens)


def _structured(sp) -> bool:
    """Structured output (JSON schema, regex, choice, grammar): a bitmask on the logits."""
    return getattr(sp, "structured_outputs", None) is not None


def plan_row(sp, max_topk: int, top_k_in_sampler: bool = False) -> tuple[int, str]:
    """(k, reason): k > 0 to certify the exact top-k of this request's row in the head,
    :data:`DEFER` to certify its draw in the sampler, else 0 and why. ``top_k_in_sampler``
    (:func:`top_k_in_sampler`): sampled top-k rows are certified in the sampler, at any ``k``."""
    if sp is None:
        return 0, "unsupported"
    dense_if = (
        sp.logprobs is not None or sp.prompt_logprobs is not None
        or getattr(sp, "logprob_token_ids", None)
        or getattr(sp, "logits_processors", None)
        or getattr(sp, "thinking_token_budget", None) is not None
        or getattr(sp, "watermarking", None) or getattr(sp, "repetition_detection", None) is not None
    )
    if dense_if:
        return 0, "unsupported"
    if _structured(sp):
        if sp.min_tokens:  # vLLM's min_tokens restores stop tokens when the grammar masked all else: not per token
            return 0, "unsupported"
        # never the head's certificate (greedy included): the grammar bitmask follows the head
        return DEFER, ""
    if sp.top_p < 1.0 or sp.min_p > 0.0 or _processed(sp):  # (vLLM resets top-p / min-p for greedy requests)
        return DEFER, ""
    if sp.temperature < _SAMPLING_EPS:
        return 1, ""
    if 1 <= sp.top_k <= max_topk and not top_k_in_sampler:  # the exact top-k in the head: no sampler work
        return sp.top_k, ""
    return DEFER, ""  # plain sampling, or top_k above the head's limit


def row_temperature(sp) -> float:
    """What vLLM divides a sampled row's logits by before its top-k mask; ``0.0`` for a
    greedy row (argmax, no division) or no parameters."""
    t = 0.0 if sp is None else float(sp.temperature)
    return t if t >= _SAMPLING_EPS else 0.0


def row_mode(sp, k: int) -> str:
    """The metric label of a row planned ``k`` (one of :data:`MODES`)."""
    if k == DEFER:
        if _structured(sp):
            return "structured"
        if sp.top_p < 1.0:
            return "top_p"
        if sp.min_p > 0.0:
            return "min_p"
        if _processed(sp):
            return "processed"
        return "top_k" if sp.top_k > 0 and sp.temperature >= _SAMPLING_EPS else "sampling"
    return "greedy" if k == 1 and sp.temperature < _SAMPLING_EPS else "top_k"


def current_plan() -> Plan | None:
    return getattr(_local, "plan", None)


@contextlib.contextmanager
def active_plan(plan: Plan | None):
    prev = getattr(_local, "plan", None)
    _local.plan = plan
    try:
        yield
    finally:
        _local.plan = prev


def take_plan(num_rows: int) -> Plan | None:
    """The plan for a logits call of ``num_rows`` rows; consumed by the first call so a
    second call in the same step (never expected) is dense."""
    plan = current_plan()
    if isinstance(plan, _LazyPlan):
        plan = plan.resolve()
    if plan is None or len(plan.topk) != num_rows:
        return None
    _local.plan = None
    return plan


def _plannable(runner) -> bool:
    """No speculative decoding, and no pipeline-parallel output broadcast (vLLM's external-launcher
    mode sends the last stage's logits to every rank, which then samples them itself: the other
    ranks would draw from the deferred rows' placeholders, whose hidden states only the last
    rank stashed)."""
    return getattr(runner, "speculative_config", None) is None and \
        getattr(getattr(runner, "vllm_config", None), "speculative_config", None) is None and \
        not getattr(runner, "broadcast_pp_output", False)


def row_plan(sp, max_topk: int, top_k_in_sampler: bool = False) -> tuple[int, str, float]:
    """A row's plan entry ``(k, mode, temperature)``: :func:`plan_row`'s ``k``, its
    :func:`row_mode` (``""`` for a dense row) and :func:`row_temperature`."""
    k = plan_row(sp, max_topk, top_k_in_sampler)[0]
    return k, row_mode(sp, k) if k else "", row_temperature(sp)


def top_k_in_sampler(runner) -> bool:
    """Whether the V1 ``runner``'s sampled top-k rows are certified in its sampler rather than
    in the head: its sampler is the one :mod:`.sampler_hook` certifies (vLLM-CPU's Gumbel
    sampler) and there is no tensor parallelism (the sharded certificate does not decide top-k).
    The sampler's certificate needs the drawn token only; the head's needs the ``k`` kept
    values bit for bit, which a bf16 row deep in its top-k often does not give (the demo
    model's ``top_k = 20`` rows: 29% certified in the head, 100% in the sampler). Read once per
    runner."""
    from .sampler_hook import certifiable_sampler

    return _sampler_ok(runner, "_csv_top_k_in_sampler", certifiable_sampler)


def _sampler_ok(runner, attr: str, certifiable) -> bool:
    """``certifiable(runner.sampler)`` and no tensor parallelism, kept on the runner as ``attr``."""
    cached = getattr(runner, attr, None)
    if cached is None:
        pc = getattr(getattr(runner, "vllm_config", None), "parallel_config", None)
        cached = certifiable(getattr(runner, "sampler", None)) and getattr(pc, "tensor_parallel_size", 1) == 1
        setattr(runner, attr, cached)
    return cached


def _v1_plan(runner, max_topk: int) -> Plan | None:
    """The V1 runner's plan, in the batch's row order. While the batch holds the very same
    request states (identity: a new request, even one reusing an id, is a new state) the last
    plan is handed out again, derived fields included: a decode step then costs one lookup a
    row. The cache holds the states it was built from, so their ids cannot be reused meanwhile."""
    batch = runner.input_batch
    if not _plannable(runner) or getattr(batch, "num_prompt_logprobs", None):
        return None
    states = tuple(map(runner.requests.get, batch.req_ids))
    cached = getattr(runner, "_csv_plan", None)
    if cached is not None and cached[1] == max_topk and len(cached[0]) == len(states) and \
            all(a is b for a, b in zip(cached[0], states)):
        return cached[2]
    in_sampler = top_k_in_sampler(runner)
    rows = [_row(st, max_topk, in_sampler) for st in states]
    plan = Plan(list(batch.req_ids), [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
    runner._csv_plan = (states, max_topk, plan)
    return plan


def _row(state, max_topk: int, in_sampler: bool = False) -> tuple[int, str, float]:
    """``(k, mode, temperature)`` of a request's row: a function of its sampling parameters
    alone, so it is computed once and kept on vLLM's per-request state (which lives as long
    as the request) instead of every step (about 10 us a row, 0.6 ms a step at 64 rows)."""
    cached = getattr(state, "_csv_row", None)
    if cached is not None and cached[0] == (max_topk, in_sampler):
        return cached[1]
    row = row_plan(getattr(state, "sampling_params", None), max_topk, in_sampler)
    if state is not None:
        state._csv_row = ((max_topk, in_sampler), row)
    return row


def sampler_v2_certifiable(runner) -> bool:
    """Whether the V2 ``runner``'s plain temperature-sampling rows are certified in its sampler
    (:func:`~.sampler_hook.resolve_v2`): the sampler is the one the hook certifies and there is
    no tensor parallelism. Read once per runner."""
    from .sampler_hook import certifiable_sampler_v2

    return _sampler_ok(runner, "_csv_v2_sampler", certifiable_sampler_v2)


# the rows the V2 sampler hook certifies (sampler_hook.resolve_v2)
V2_MODES = ("sampling", "min_p", "processed", "structured")


def _v2_entry(row: tuple[int, str, float], in_sampler: bool) -> tuple[int, str]:
    """A V2 row's ``(k, mode)``: the head's top-k rows as planned; of the rows to certify in the
    sampler, temperature sampling with min-p, vLLM's native processors, structured output or
    none of these, and greedy rows with processors or structured output (modes
    :data:`V2_MODES`) where the V2 sampler is certified (``in_sampler``); the others dense (the
    V2 hook replays no top-k or top-p; a structured row with one is labelled ``structured``
    and deferred, and the hook sends its batch dense: ``sampler_hook._unsupported_v2``)."""
    k, mode, _ = row
    if k > 0 or (k == DEFER and mode in V2_MODES and in_sampler):
        return k, mode
    return 0, ""


def _v2_plan(runner, req_ids, max_topk: int) -> Plan:
    """The V2 runner's plan, in the batch's row order, from the sampling parameters its
    ``execute_model`` kept per request (``_csv_sampling_params``; a row whose request is unknown
    is dense). As :func:`_v1_plan`: while the batch holds the same requests (ids and their
    parameter objects, by identity) the last plan is handed out again, and each request's row is
    computed once. Rows to certify in the sampler: :func:`_v2_entry`."""
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
            hit = memo[rid] = (p, max_topk, row_plan(p, max_topk))
        rows.append(hit[2])
    in_sampler = sampler_v2_certifiable(runner)
    entries = [_v2_entry(r, in_sampler) for r in rows]
    plan = Plan(list(req_ids), [k for k, _ in entries], [mode for _, mode in entries], [t for _, _, t in rows])
    runner._csv_plan = (ps, max_topk, plan)
    return plan


def install(max_topk_getter) -> None:
    """Wrap the V1 and V2 runners (idempotent; each import is optional). ``max_topk_getter(runner)``
    gives the runner's ``--csv-max-topk``."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        GPUModelRunner = None
    if GPUModelRunner is not None and not getattr(GPUModelRunner, "_csv_wrapped", False):
        orig = GPUModelRunner.execute_model

        def execute_model(self, scheduler_output, *a, **k):
            # execute_model updates the batch from scheduler_output first; the plan is
            # built lazily (at the logits call) so that it sees the updated batch. (active_plan
            # inlined: this runs every step, and a generator-based context manager costs more.)
            prev = getattr(_local, "plan", None)
            _local.plan = _LazyPlan(self, _v1_plan, max_topk_getter(self))
            try:
                return orig(self, scheduler_output, *a, **k)
            finally:
                _local.plan = prev

        GPUModelRunner.execute_model = execute_model
        GPUModelRunner._csv_wrapped = True
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    except ImportError:
        V2Runner = None
    if V2Runner is not None and not getattr(V2Runner, "_csv_wrapped", False):
        from . import sampler_hook

        orig_exec, orig_sample = V2Runner.execute_model, V2Runner.sample

        def v2_execute_model(self, scheduler_output, *a, **k):
            params = self.__dict__.setdefault("_csv_sampling_params", {})
            for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
                params[new.req_id] = new.sampling_params
            rows = self.__dict__.setdefault("_csv_rows", {})  # (_v2_plan's rows)
            for rid in getattr(scheduler_output, "finished_req_ids", ()) or ():
                params.pop(rid, None)
                rows.pop(rid, None)
            return orig_exec(self, scheduler_output, *a, **k)

        def v2_sample(self, hidden_states, input_batch, grammar_output, *a, **k):
            plan = None
            if (_plannable(self) and getattr(self, "batch_sharder", None) is None
                    and getattr(input_batch, "num_draft_tokens", 0) == 0):
                plan = _v2_plan(self, input_batch.req_ids, max_topk_getter(self))
            try:
                with active_plan(plan):
                    return orig_sample(self, hidden_states, input_batch, grammar_output, *a, **k)
            finally:
                sampler_hook.discard()  # a slot no sampler call took (none expected) must not reach the next step

        V2Runner.execute_model = v2_execute_model
        V2Runner.sample = v2_sample
        V2Runner._csv_wrapped = True


class _LazyPlan:
    """A plan computed at its first use (:func:`take_plan`), from the runner's state at that moment."""

    def __init__(self, runner, build, max_topk):
        self._runner, self._build, self._max_topk = runner, build, max_topk

    def resolve(self) -> Plan | None:
        return self._build(self._runner, self._max_topk)
