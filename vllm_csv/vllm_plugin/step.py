"""One engine step's CSV state, passed explicitly from the model runner to its head and sampler.

A step of vLLM's model runner computes the logits (``model.compute_logits``: our layer,
:class:`~.logits_processor.CSVLogitsProcessor`) and then samples them (vLLM's ``Sampler``,
wrapped: :mod:`.v1.sampler`, :mod:`.v2.sampler`). The layer sees hidden states, the sampler
sees logits and the sampling metadata; what one learns the other needs. So each runner owns one
:class:`StepChannel`, bound once to its own CSV layers and its own sampler (:func:`~.patches.bind`), and:

1. the runner's wrapped step method (:mod:`.patches`) opens a :class:`Step` with the step's
   plan (:class:`~.plan.Plan`, built lazily from the runner's batch at the head), and closes the
   plan when the method returns (a logits call outside a step gets no plan: dense);
2. the layer takes the plan (:meth:`Step.take_plan`, once, for the expected row count) and
   leaves the step's :class:`Handoff` for the sampler: the rows it deferred
   (:class:`Deferred`) or, on a dense step the off-switch times with vLLM's sampler call, an
   account alone;
3. the sampler takes the hand-off (:func:`take_handoff`: once, shape-checked), certifies
   or fills the deferred rows, and settles the step's :class:`StepAccount` (metrics and the
   off-switch's ledger) with what it did.

Nothing here is process-global: two runners in a process (a drafter beside a target) have two
channels, and a layer or sampler no runner bound (warm-up outside a step, a drafter's head)
gets no step and stays dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch

from ..fp import other_bits

if TYPE_CHECKING:
    from ..head import StepStats
    from ..metrics import Series
    from .plan import Plan

PLACEHOLDER = 0.0  # the value of a deferred row's logits until the sampler fills them
# the value the layer leaves at a suppressing model's tokens on rows it certified over them
# (step.over_mask_tokens): finite, so a token the model does not set to -inf shows
SUPPRESSED_PROBE = -1.0


@dataclass
class DeferredStats:
    """What the sampler did with a step's deferred rows."""

    rows: int = 0
    certified: dict[str, int] = field(default_factory=dict)  # by mode
    fallbacks: dict[str, int] = field(default_factory=dict)
    scored: int = 0
    seconds: float = 0.0

    def added_to(self, stats: StepStats) -> StepStats:
        """The step's head-time ``stats`` plus these deferred rows (a new account)."""
        n = sum(self.certified.values())
        fallbacks = dict(stats.fallbacks)
        for r, k in self.fallbacks.items():
            fallbacks[r] = fallbacks.get(r, 0) + k
        return replace(stats, rows=stats.rows + self.rows, csv_rows=stats.csv_rows + self.rows,
                       certified=stats.certified + n, fallbacks=fallbacks,
                       scored=list(stats.scored) + [self.scored] * n, seconds=stats.seconds + self.seconds)


class Ledger(Protocol):
    """Who keeps a step's account (the layer: its metrics and off-switch)."""

    def settle(self, account: StepAccount, deferred: DeferredStats | None, sampler_seconds: float) -> None: ...


@dataclass
class StepAccount:
    """A step's account the layer leaves open until vLLM's sampler call has run.

    ``kind``:

    * ``"deferred"``: rows certified in the sampler; the head's ``stats`` and certified
      ``modes`` merge with the sampler's :class:`DeferredStats`;
    * ``"dense"``: a step the off-switch sent dense, timed with the sampler call;
    * ``"lane"``: a fast-lane step (:mod:`.lane`):
      its head time plus the sampler call's appended to ``series``.

    ``key`` is the step's key in the off-switch (None: not timed); ``with_sampler``: the sampler
    call's own time counts (the off-switch compares head plus sampler on both sides)."""

    ledger: Ledger
    kind: str
    head: object = None  # CertifiedHead or ShardedHead
    stats: StepStats | None = None
    modes: dict[str, int] = field(default_factory=dict)
    key: object = None
    with_sampler: bool = False
    series: Series | None = None
    head_seconds: float = 0.0

    def settle(self, deferred: DeferredStats | None = None, sampler_seconds: float = 0.0) -> None:
        self.ledger.settle(self, deferred, sampler_seconds)


class DenseBatch:
    """vLLM's dense logits of the step's whole batch, computed at most once (the rescue of any
    row not certified: bit for bit what vLLM computes without CSV; under tensor parallelism a
    collective every rank calls)."""

    def __init__(self, layer, lm_head, hidden: torch.Tensor, embedding_bias: torch.Tensor | None):
        self._args = (layer, lm_head, hidden, embedding_bias)
        self._logits: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        """``[B, V]`` in vLLM's logits dtype."""
        if self._logits is None:
            layer, lm_head, hidden, bias = self._args
            self._logits = layer.dense_logits(lm_head, hidden, bias)
        return self._logits


@dataclass
class Deferred:
    """The rows the layer left for the sampler (placeholders in ``logits``)."""

    logits: torch.Tensor  # [B, V] what the head returned (placeholder rows at ``rows``)
    hidden: torch.Tensor  # [R, d] the deferred rows' hidden states (a copy)
    rows: torch.Tensor  # [R] int64, CPU
    modes: list[str]  # per deferred row
    adapter: object  # sampling.head_adapter.HeadAdapter or sampling.sharded_rows.ShardedAdapter
    dense: DenseBatch  # the dense head on the whole batch: [B, V]
    account: StepAccount  # kind "deferred"
    seconds: float = 0.0  # head time spent on them
    # [V] bool on the logits' device: the tokens the model sets to -inf after the head
    # (StepChannel.suppressed), which every placeholder row must show at sampler time
    suppressed: torch.Tensor | None = None


@dataclass
class Top1:
    """Every row of the step certified ``k = 1`` in the head, and each row's token: for the
    readers of the logits that need only each row's argmax (V1's ``Sampler`` on an all-greedy
    batch and V1's greedy verification, :mod:`.v1.sampler` and :mod:`.v1.spec`; a drafter's
    ``_greedy_sample``), which then skip their passes over ``[B, V]`` (an fp32 cast, copies of the
    rows, and torch's argmax, which alone took longer than the certified head on 32 rows of the
    demo's head on a CPU). Sound because a row certified ``k = 1`` holds the dense value on its
    token and ``-inf`` elsewhere (ties are never certified), so its argmax, before or after an fp32
    cast, is that token, the dense row's argmax. A reader takes it only for the very ``logits``
    the head returned (not a copy or a slice, which another step might have changed; a model that
    writes into them after the head gets no plan: :class:`Returned`)."""

    logits: torch.Tensor  # [B, V] what the head returned
    tokens: torch.Tensor  # [B] int64 on the logits' device: each row's token (Selection.top1)


Handoff = Deferred | StepAccount | Top1  # what the layer leaves for the sampler


@dataclass
class Returned:
    """What the CSV layer returned in the current ``model.compute_logits`` call. vLLM's runners
    read the model's ``compute_logits``, not the layer's output: most models return the layer's
    tensor as it is, but some change it after the head (vLLM 0.32: Gemma 4's ``suppress_tokens``
    by an in-place ``index_fill_``, Moondream 3's answer token set to ``-inf``, a logit multiplier
    or soft-cap applied outside the layer, EAGLE-3's draft-to-target vocabulary map). The head's
    certificate covers the layer's output only, so a model whose ``compute_logits`` does not
    return the layer's tensor with the layer's bits gets the dense head
    (:func:`~.patches.watch_logits`: the bits are compared at the channel's first call, made
    dense; vLLM runs its steps in inference mode, where tensors keep no version counter)."""

    logits: torch.Tensor
    copy: torch.Tensor | None  # a copy of ``logits`` as returned, where the step asked for one
    # whether it holds rows the head certified or deferred (else vLLM's own logits), or an earlier
    # call in this compute_logits did: a later call drops that one's hand-off, so a model that
    # returns the earlier call's logits has its step made again dense (patches.watch_logits)
    csv: bool


def suppressed_tokens(returned: torch.Tensor, model: torch.Tensor) -> torch.Tensor | None:
    """``[V]`` bool: the tokens a model's ``compute_logits`` suppressed, where all it did to the
    layer's output ``returned`` (its copy) to give ``model`` was to set some tokens to ``-inf`` on
    every row (Gemma 4's ``suppress_tokens``, Moondream 3's answer token); None where it did
    anything else (another shape, another value anywhere, a token ``-inf`` on some rows only)
    or nothing. A token already ``-inf`` in ``returned`` on every row is not counted (a model
    that suppresses it too is caught at sampler time: :func:`~.fill.upstream_mask`)."""
    if returned.shape != model.shape or returned.dtype != model.dtype or returned.dim() != 2 or returned.shape[0] == 0:
        return None
    changed = other_bits(returned, model)
    neg_inf = model == -math.inf
    if not bool(changed.any()) or bool((changed & ~neg_inf).any()):
        return None
    tokens = changed.any(0)
    return tokens if bool(neg_inf[:, tokens].all()) else None


def over_mask_tokens(logits: torch.Tensor, rows: torch.Tensor, suppressed_ids: torch.Tensor,
                     tokens: torch.Tensor | None = None) -> torch.Tensor | None:
    """``[R]`` int64: the tokens of ``rows`` (batch rows the head certified ``k = 1`` over a model's
    suppressed tokens ``suppressed_ids [n]``: :meth:`~.plan.Plan.over_mask`), read off ``logits``
    as the model returned them (``tokens [R]``: the head's, or None: each row's argmax, one pass),
    where each is the dense row's argmax, else None (the step must be made again dense). The
    layer left a finite value (:data:`SUPPRESSED_PROBE`) on those rows at ``suppressed_ids``, so
    the model's ``-inf`` shows there: the model suppressed at least those tokens (a token it left
    would hold its dense value, which the certificate did not compare) and not the row's token
    (the best of the others, proven above each of them: whichever more it removes, the best left
    is that token). Two gathers (``[R, n]``, ``[R]``) and one host sync on their verdict (the
    step is remade before the sampler where it fails)."""
    if tokens is None:
        tokens = logits[rows].argmax(1)
    kept = logits[rows, tokens] > -math.inf
    gone = logits[rows[:, None], suppressed_ids[None]] == -math.inf
    return tokens if bool(kept.all()) and bool(gone.all()) else None


@dataclass
class Step:
    """One step of one runner: its plan until the layer takes it, then the layer's hand-off
    until the sampler takes it."""

    plan: Plan | LazyPlan | None = None
    handoff: Handoff | None = None
    returned: Returned | None = None  # the layer's output in the current compute_logits call
    snapshot: bool = False  # the layer keeps a copy of what it returns (Returned.copy)
    suppressed: torch.Tensor | None = None  # StepChannel.suppressed when the step opened
    suppressed_ids: torch.Tensor | None = None  # StepChannel.suppressed_ids
    masks_ok: bool = False  # StepChannel.masks_ok
    # (rows [R] int64, tokens [R] int64 or None) on the logits' device: the rows the head
    # certified over the suppressed tokens (Plan.over_mask), which the model's compute_logits
    # wrapper checks (over_mask_tokens)
    over_mask: tuple[torch.Tensor, torch.Tensor | None] | None = None
    lazy: LazyPlan | None = None  # the lazy plan take_plan built (its batch_key: the fast lane's, lane.Lane.open)

    def take_plan(self, num_rows: int, greedy_over_mask: bool = False) -> Plan | None:
        """The plan for a logits call of ``num_rows`` rows; consumed by the first call, so a
        second call in the same step (never expected) is dense. Where the model suppresses
        tokens after the head (:attr:`suppressed`), its :meth:`~.plan.Plan.over_mask`
        (``greedy_over_mask``: the head leaves tokens out of its certificate; deferred rows where
        the sampler certifies rows over such masks, :attr:`masks_ok`)."""
        plan = self.plan
        if isinstance(plan, LazyPlan):
            self.lazy, plan = plan, plan.resolve()
        if plan is None or len(plan.topk) != num_rows:
            return None
        if self.suppressed is not None:  # (the model suppresses tokens after the head: StepChannel)
            plan = plan.over_mask(greedy_over_mask, self.masks_ok)
        self.plan = None
        return plan

    def take_top1(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The tokens of a :class:`Top1` hand-off for these very ``logits`` (the hand-off taken;
        one for other logits is dropped, None returned); any other hand-off is left in place."""
        d = self.handoff
        if not isinstance(d, Top1):
            return None
        self.handoff = None
        return d.tokens if d.logits is logits else None

    def take_handoff(self, logits: torch.Tensor) -> Handoff | None:
        """The layer's hand-off for the sampler call on ``logits``, consumed. Deferred rows for
        logits of another shape are an error (placeholders would be sampled)."""
        d, self.handoff = self.handoff, None
        if isinstance(d, Deferred) and tuple(logits.shape) != tuple(d.logits.shape):
            raise RuntimeError(f"vllm-csv: the sampler got logits of shape {tuple(logits.shape)} after the head "
                               f"returned {tuple(d.logits.shape)} with rows left to certify; refusing to sample "
                               "from placeholders")
        return d


class LazyPlan:
    """A plan built at its first use (:meth:`Step.take_plan`), from the runner's state at that
    moment (the runner updates its batch inside the wrapped method, before the logits).
    ``batch(runner)``, where given, is the runner's batch identity (:meth:`batch_key`)."""

    def __init__(self, runner, build, max_topk: int, batch=None, **kwargs):
        self._runner, self._build, self._max_topk, self._batch, self._kwargs = runner, build, max_topk, batch, kwargs

    def resolve(self) -> Plan | None:
        return self._build(self._runner, self._max_topk, **self._kwargs)

    def batch_key(self) -> object:
        """The runner's batch identity now: an object that stays the same while the runner's
        batch holds the same requests in the same rows with the same sampling parameters (so
        :meth:`resolve` would give the same plan), and is another one once that changes; None
        where the runner gives none (the fast lane's test, :mod:`.lane`)."""
        return None if self._batch is None else self._batch(self._runner)


class StepChannel:
    """A runner's current :class:`Step`, shared by the runner, its CSV layers and its sampler."""

    def __init__(self):
        self.step = Step()
        self.model = None  # the model whose layers are bound (rebound if the runner reloads it)
        self.logits_checked = False  # whether a call showed what the model does with the head's logits
        self.post_processing: str | None = None  # the model (its class) changes them (Returned)
        # where the model only sets a fixed set of tokens to -inf after the head (suppressed_tokens),
        # those tokens ([V] bool): greedy and draft rows are then certified in the head over them
        # where it can (Plan.over_mask), the others in the sampler where it certifies rows over
        # such masks (V1's: masks_ok), reading the -inf off the placeholders, else dense
        self.suppressed: torch.Tensor | None = None
        self.suppressed_ids: torch.Tensor | None = None  # the same tokens as ids ([n] int64, same device)
        self.masks_ok = False
        self.warned_over_mask = False  # (the model removed a row's certified set: warned once)
        self.drafter = False  # a speculative proposer's (patches.bind_drafter)

    def forget_model(self) -> None:
        """What the model's calls showed (:attr:`logits_checked`, :attr:`post_processing`,
        :attr:`suppressed`), dropped when the runner binds another model object: the next call
        shows it again."""
        self.logits_checked, self.post_processing, self.suppressed, self.suppressed_ids = False, None, None, None

    def open(self, plan: Plan | LazyPlan | None) -> Step:
        """A new step (any hand-off no sampler took is dropped with the old one); without a plan
        once the model is known to change the head's logits after it (other than by
        :attr:`suppressed` tokens)."""
        self.step = Step(None if self.post_processing else plan, suppressed=self.suppressed,
                         suppressed_ids=self.suppressed_ids, masks_ok=self.masks_ok)
        return self.step

    def close_plan(self) -> None:
        """The runner's step method returned: a later logits call (none expected) is dense."""
        self.step.plan = None


def step_of(consumer) -> Step | None:
    """The current step of the runner ``consumer`` (a CSV layer or a sampler) is bound to."""
    channel = getattr(consumer, "csv_channel", None)
    return None if channel is None else channel.step


def take_handoff(consumer, logits: torch.Tensor) -> Handoff | None:
    """The hand-off the current step of ``consumer``'s runner (a sampler) holds for the call on
    ``logits``, consumed (:meth:`Step.take_handoff`); None where no runner bound it or the layer
    left nothing."""
    step = step_of(consumer)
    return None if step is None or step.handoff is None else step.take_handoff(logits)

