"""Which rows of the LM head may take the certified path this step: the policy, per request.

``LogitsProcessor.forward`` sees hidden states, not sampling parameters. The model runner knows
both: its wrapped step method (:mod:`.patches`) opens a :class:`~.step.Step` whose plan holds one
entry per request in the order of the logits rows (built by :mod:`.v1.plan` or :mod:`.v2.plan`).
Any logits call outside that method (warm-up, profiling, prompt logprobs, draft heads) or with an
unexpected row count gets no plan, and every row is dense.

``plan_row`` is the whole policy (SPEC, "Per-request features"): ``k > 0`` certifies
the exact top-k in the LM head (greedy is ``k = 1``); :data:`DEFER` certifies the row's
draw inside vLLM's sampler (:mod:`.v1.sampler`: plain temperature sampling, top-p and
min-p sampling, greedy or sampled rows with penalties, ``logit_bias``,
``allowed_token_ids``, bad words or ``min_tokens``, and greedy or sampled rows with structured
output, certified over the tokens the grammar allows; each also with ``top_k``, and plain
``top_k`` sampling above the head's limit, or at any ``k`` where the runner's sampler is the
one the hook certifies: :func:`~.v1.plan.top_k_in_sampler`); ``0`` is the dense path.
:func:`row_mode` names the mode for the metrics.

A row with structured output is never certified in the head, greedy included: the runner
applies the grammar bitmask to the head's output, after the head and before the sampler, and
may remove the head's certified token, leaving the sampler to pick among the other scored
tokens while a better allowed token outside ``S`` sits at ``-inf``. The sampler hook sees the
mask (:mod:`.fill`, where the reason it is sound is written down).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..vocabulary import MODES  # noqa: F401  (row_mode's labels)
from ..vocabulary import SAMPLING_EPS as _SAMPLING_EPS

DEFER = -1  # certify the row in vLLM's sampler, with the seed it draws (v1.sampler, v2.sampler)
TARGET_MODE = "spec_greedy"  # greedy requests' verification and bonus rows (one of vocabulary.MODES)
DRAFT_MODE = "draft"  # a drafter's rows (v1.spec.draft_plan; one of vocabulary.MODES)
SPEC_SAMPLED_MODE = "spec_sampling"  # sampled requests' rows in a V2 speculative step (v2/verify.py)
# the base modes of the sampled requests whose verification the V2 hook certifies: temperature,
# with min-p, vLLM's native processors, or neither (not top-k, top-p or structured output)
SPEC_SAMPLED_FROM = ("sampling", "min_p", "processed")


@dataclass
class Plan:
    """One step's rows: the per-row entries, and what the head derives from them (computed at
    most once per plan: :func:`.v1.plan.build_plan` and :func:`.v2.plan.build_plan` hand the same
    plan to every step whose batch holds the same requests, so a decode run builds it once per
    change of the batch)."""

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

    def over_mask(self, greedy_in_head: bool, defer_ok: bool = True) -> Plan:
        """This plan for a model that sets fixed tokens to ``-inf`` after the head
        (:attr:`~.step.StepChannel.suppressed`), kept per arguments. With ``greedy_in_head`` (the
        head leaves tokens out of its certificate: ``can_exclude``), a greedy or draft row stays
        ``k = 1`` and the layer certifies it over the other tokens (its token is then the best the
        model leaves, proven above every other one; :func:`~.step.over_mask_tokens` checks the
        model's ``-inf``). Every other row the plan certifies (and a greedy one the head cannot
        take) is deferred to the sampler with its mode kept, where the runner's sampler hook
        certifies rows over such masks (``defer_ok``: V1's, as it does structured output's), else
        dense; a speculative step's target rows are dense (V1's verification reads the head's rows)."""
        cache = self.__dict__.setdefault("_over_mask", {})
        key = (greedy_in_head, defer_ok)
        if key in cache:
            return cache[key]
        topk, modes, temps = [], [], []
        for k, mode, t in zip(self.topk, self.row_modes, self.row_temps):
            if k > 0 and mode == TARGET_MODE:
                entry = (0, "", 0.0)
            elif k == 1 and mode in ("greedy", DRAFT_MODE) and greedy_in_head:
                entry = (k, mode, t)
            elif k != 0:
                entry = (DEFER, mode, t) if defer_ok else (0, "", t)
            else:
                entry = (k, mode, t)
            topk.append(entry[0])
            modes.append(entry[1])
            temps.append(entry[2])
        cache[key] = plan = Plan(list(self.req_ids), topk, modes, temps)
        return plan

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
    monotone per token (the sampler hooks run vLLM's own code on the bounds)."""
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


def row_plan(sp, max_topk: int, top_k_in_sampler: bool = False) -> tuple[int, str, float]:
    """A row's plan entry ``(k, mode, temperature)``: :func:`plan_row`'s ``k``, its
    :func:`row_mode` (``""`` for a dense row) and :func:`row_temperature`."""
    k = plan_row(sp, max_topk, top_k_in_sampler)[0]
    return k, row_mode(sp, k) if k else "", row_temperature(sp)


def target_plan(base: Plan, counts: tuple[int, ...], mixed_ok: bool = True, sampled: bool = False) -> Plan:
    """A speculative step's plan from the batch's per-request ``base`` plan, for a runner that lays
    out request ``i``'s ``1 + counts[i]`` rows (its draft tokens' and its bonus row) one request
    after another (V1: :mod:`.v1.spec`; V2: :mod:`.v2.spec`): the request's entry repeated over
    them, ``k = 1`` (mode :data:`TARGET_MODE`) for a greedy request (``base`` planned it ``k = 1``
    with mode ``greedy``; the rejection samplers read its rows through their argmax); with
    ``sampled`` (the V2 runner's verification hook, :mod:`.v2.verify`), :data:`DEFER` (mode
    :data:`SPEC_SAMPLED_MODE`) for a temperature-sampling request with min-p, vLLM's processors
    or neither (``base`` deferred it with a mode of :data:`SPEC_SAMPLED_FROM`, at a temperature
    above 0); dense for every other; every row dense where a batch with a sampled
    request is not certifiable (``mixed_ok`` false: :func:`.v1.spec.mixed_batches_ok`)."""
    all_greedy = all(t == 0.0 for t in base.row_temps)
    req_ids, topk, modes, temps = [], [], [], []
    for rid, k, mode, t, n in zip(base.req_ids, base.topk, base.row_modes, base.row_temps, counts):
        if k == 1 and mode == "greedy" and (mixed_ok or all_greedy):
            entry = (1, TARGET_MODE, 0.0)
        elif sampled and k == DEFER and mode in SPEC_SAMPLED_FROM and t > 0.0 and mixed_ok:
            entry = (DEFER, SPEC_SAMPLED_MODE, t)
        else:
            entry = (0, "", 0.0)
        req_ids += [rid] * (1 + n)
        topk += [entry[0]] * (1 + n)
        modes += [entry[1]] * (1 + n)
        temps += [entry[2]] * (1 + n)
    return Plan(req_ids, topk, modes, temps)


def kept_target_plan(runner, base: Plan, counts: tuple[int, ...], mixed_ok: bool = True,
                     sampled: bool = False) -> Plan:
    """:func:`target_plan`, kept on ``runner`` and handed out again while the batch's plan (the
    same object: the runners keep it while their batch holds) and the draft counts hold (a decode
    run whose drafts keep their lengths builds it once)."""
    cached = getattr(runner, "_csv_spec_plan", None)
    if cached is not None and cached[0] is base and cached[1:3] == (counts, (mixed_ok, sampled)):
        return cached[3]
    plan = target_plan(base, counts, mixed_ok, sampled)
    runner._csv_spec_plan = (base, counts, (mixed_ok, sampled), plan)
    return plan


def plannable(runner, speculative_ok: bool = False) -> bool:
    """No speculative decoding (unless ``speculative_ok``: the V1 runner's plan, :mod:`.v1.spec`),
    and no pipeline-parallel output broadcast (vLLM's external-launcher mode sends the last
    stage's logits to every rank, which then samples them itself: the other ranks would draw
    from the deferred rows' placeholders, whose hidden states only the last rank stashed)."""
    if getattr(runner, "broadcast_pp_output", False):
        return False
    return speculative_ok or (getattr(runner, "speculative_config", None) is None and
                              getattr(getattr(runner, "vllm_config", None), "speculative_config", None) is None)


def sampler_ok(runner, attr: str, certifiable) -> bool:
    """``certifiable(runner.sampler)`` and no tensor parallelism, kept on the runner as ``attr``."""
    cached = getattr(runner, attr, None)
    if cached is None:
        pc = getattr(getattr(runner, "vllm_config", None), "parallel_config", None)
        cached = certifiable(getattr(runner, "sampler", None)) and getattr(pc, "tensor_parallel_size", 1) == 1
        setattr(runner, attr, cached)
    return cached

