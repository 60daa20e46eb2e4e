"""The replacement for vLLM's ``LogitsProcessor``: certified rows on the CSV path.

Registered with ``LogitsProcessor.register_oot``. At construction it reads
``additional_config["csv_decode"]``; when CSV is off it turns itself back into
vLLM's own class, so the layer is exactly what vLLM would have built. When on, the
first ``forward`` builds a :class:`~vllm_csv.head.CertifiedHead` from the layer's
weights (:mod:`.head_builder`), and each step's rows take the certified path or vLLM's dense code
(``super()._get_logits`` + soft-cap + scale, unchanged) as the runner's plan says. The
off-switch decides once per step, here (a step it sends dense is vLLM's own call and a few
counters, :mod:`vllm_csv.off_switch`; while it surely would again, the step is vLLM's call and
one append: the fast lane, :mod:`.lane`).
With tensor parallelism the head is a :class:`~vllm_csv.sharded.ShardedHead` over this
rank's shard: every rank reaches the same decision, and dense rows take vLLM's all-gather.
Rows planned ``DEFER`` (certified with the seed the sampler draws) are left as placeholders
and handed to the sampler on the runner's :class:`~.step.Step` (:mod:`.v1.sampler`,
:mod:`.v2.sampler` fill them before vLLM's sampler reads them; under tensor parallelism through
a :class:`~vllm_csv.sampling.sharded_rows.ShardedAdapter`: the same decision on every rank),
with the step's :class:`~.step.StepAccount`, which the sampler settles here (:meth:`settle`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.logits_processor import LogitsProcessor

from .. import clock
from .. import head as csv_head
from ..errors import CSVError
from ..off_switch import UNASKED
from .config import CSVDecodeConfig, from_additional_config
from .head_builder import build_head, unsupported_config, unsupported_head
from .lane import Lane
from .step import (PLACEHOLDER, SUPPRESSED_PROBE, Deferred, DeferredStats, DenseBatch, Returned, StepAccount, Top1,
                   step_of)

logger = init_logger("vllm.csv_decode")
TRIPS_LOGGED = 3  # the off-switch's first trips (CSV on -> off) explained at INFO
OFF = "CSV-Decode is off for this LM head: %s; using the dense head."  # (at construction, or later: _switch_off)


class CSVLogitsProcessor(LogitsProcessor):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from vllm.config import get_current_vllm_config

        vc = get_current_vllm_config()
        cfg = from_additional_config(getattr(vc, "additional_config", None))
        reason = unsupported_config(vc, self) if cfg.enabled else None
        if not cfg.enabled or reason:
            if reason:
                logger.warning(OFF, reason)
            self.__class__ = LogitsProcessor  # exactly vLLM's layer
            return
        self.csv_config: CSVDecodeConfig = cfg
        self.csv_model_name = getattr(getattr(vc, "model_config", None), "served_model_name", None) or \
            getattr(getattr(vc, "model_config", None), "model", "")
        self.csv_head = None  # CertifiedHead, or ShardedHead under tensor parallelism
        self.csv_metrics = None
        self._csv_logged = False
        self._csv_lane: Lane | None = None  # switched-off steps that skip the ledger (lane.py)
        self._csv_span: _Span | None = None  # the current step, for the time around the head (_outside)
        self._csv_for = None  # (lm_head, its weight, embedding_bias) the head was built for (_head_for)
        self._csv_off: str | None = None  # why this layer runs vLLM's code for good (_switch_off)
        self._csv_stale = False  # the weights changed since the head was built (csv_invalidate)
        self._csv_warned_other = False  # (one warning for calls with another head: _head_for)

    @classmethod
    def around(cls, head, metrics=None) -> CSVLogitsProcessor:
        """The layer around a built ``head`` (a :class:`~vllm_csv.head.CertifiedHead`), without
        vLLM's constructor (no vLLM config), as its first ``forward`` leaves it: for harnesses
        (tests, benchmarks) that drive the layer without a server."""
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.csv_head, layer.csv_metrics, layer._csv_logged = head, metrics, True
        layer._csv_lane = layer._csv_span = layer._csv_for = layer._csv_off = None
        layer._csv_stale = layer._csv_warned_other = False
        return layer

    def dense_logits(self, lm_head, hidden: torch.Tensor, embedding_bias) -> torch.Tensor:
        """vLLM's own logits of ``hidden`` (``[B, d]`` -> ``[B, V]``): its layer's forward."""
        return super().forward(lm_head, hidden, embedding_bias)

    def forward(self, lm_head, hidden_states: torch.Tensor, embedding_bias: torch.Tensor | None = None,
                skip_gather: bool = False):
        if not isinstance(self, CSVLogitsProcessor):
            # vLLM's LoRA wrapper of an LM head an adapter targets (``LogitsProcessorWithLoRA``)
            # calls ``type(base_layer).forward(wrapper, ...)``: its logits carry the adapter's delta,
            # which no screen bounds, so vLLM's own layer code runs on the wrapper (dense, exact).
            return LogitsProcessor.forward(self, lm_head, hidden_states, embedding_bias, skip_gather)
        lane = self._csv_lane
        if lane is not None and not skip_gather:  # the fast lane, before the step's plan is built (lane.py)
            step = step_of(self)
            if step is not None and lane.takes(step, hidden_states.shape[0]) and self._built_for(lm_head, embedding_bias):
                step.plan = step.handoff = None  # (the plan taken unbuilt: Step.take_plan's contract)
                return self._lane_step(lane, step, lm_head, hidden_states, embedding_bias)
        logits, csv = self._forward(lm_head, hidden_states, embedding_bias, skip_gather)
        step = step_of(self)
        if step is not None and logits is not None:  # (for the model's compute_logits: step.Returned)
            csv = csv or (step.returned is not None and step.returned.csv)  # (any call's: Returned.csv)
            step.returned = Returned(logits, logits.clone() if step.snapshot else None, csv)
        return logits

    def _forward(self, lm_head, hidden_states: torch.Tensor, embedding_bias: torch.Tensor | None,
                 skip_gather: bool) -> tuple[torch.Tensor | None, bool]:
        """The logits, and whether they hold rows the head certified or deferred."""
        # The head (and its index) is built at the first call, which vLLM makes during
        # start-up (profiling / warm-up): a bad index stops the server there.
        t0, w0 = clock.now(), clock.wall()  # the off-switch charges a CSV step the whole layer, plan included
        # The runner's step (step.py; None: a call outside a runner's step, e.g. warm-up). A
        # hand-off left by an earlier head call whose sampler call never came (none expected: each
        # step's sampler follows its head) must not reach this step's sampler: it would fill this
        # step's logits with another step's rows where the shapes agree (Step.take_handoff).
        step = step_of(self)
        if step is not None:
            step.handoff = None
        head = self._head_for(lm_head, embedding_bias)
        plan = None if step is None else step.take_plan(hidden_states.shape[0],
                                                        head is not None and head.can_exclude)
        if head is None or plan is None or skip_gather or hidden_states.dim() != 2:
            self._csv_span = None
            return super().forward(lm_head, hidden_states, embedding_bias, skip_gather), False
        lane = self._csv_lane
        if lane is not None:
            if lane.plan is plan and lane.left:  # a step the switch surely refuses, known by its plan (lane.py)
                return self._lane_step(lane, step, lm_head, hidden_states, embedding_bias), False
            self._close_lane(head.off_switch)
        self._outside(head.off_switch, plan, t0, clock.wall() - w0)
        if not any(plan.topk):  # every row dense by its sampling parameters: count the rows
            out = super().forward(lm_head, hidden_states, embedding_bias, skip_gather)
            if head.off_switch is not None and not hidden_states.is_cuda:  # (CUDA: no sync to time it)
                self._observe(head.off_switch, hidden_states.shape[0], clock.now() - t0, kind=UNASKED)
            if self.csv_metrics is not None:
                self.csv_metrics.record(csv_head.StepStats(rows=hidden_states.shape[0]))
            return out, False
        B = hidden_states.shape[0]
        dense_full = DenseBatch(self, lm_head, hidden_states, embedding_bias)  # computed at most once
        ks, modes, deferred, in_head = plan.topk, plan.row_modes, plan.deferred, plan.in_head
        # The off-switch decides for the whole step here, once (the head's rows and the
        # sampler's are charged together against the dense time of all B rows; its ledger is
        # per kind of step), and the head is called with use_switch=False. A step it sends
        # dense is vLLM's own call and a few counters (40 to 60 us a step more than vLLM's layer on
        # this repo's 2-core CI machine: benchmarks/off_switch_cost.py), and the steps it will
        # surely send dense next take the fast lane (lane.py).
        sw = head.off_switch
        split = plan.split(head.max_certified_k)
        asked = sw is not None and bool(deferred or split.rows)
        kind = "sampler" if deferred else split.kind  # the off-switch's ledger
        # A step with rows for the sampler is timed with vLLM's sampler call on both sides, under
        # its own dense estimate (key (B, "sampler")): CSV's draw skips vLLM's top-k, top-p and
        # min-p passes on certified rows, which the head's time alone does not see (it kept 77%
        # of eight top-k rows dense where CSV paid end to end). Where the switch has no in-place
        # dense samples (tensor parallelism) or cannot time (CUDA), the head's time alone, as before.
        # (Also without the switch: the step's metrics count the same time.)
        with_sampler = bool(deferred) and not hidden_states.is_cuda and (sw is None or sw.samples_in_place)
        key = (B, kind) if with_sampler else B
        trips = sw.times_tripped if asked else 0
        if asked and not sw.allow(key, lambda: csv_head.time_call(dense_full, hidden_states), kind):
            logits = dense_full().to(head.dtype)  # vLLM's own output: one GEMM, no copies
            seconds = clock.now() - t0
            if sw.times_tripped > trips and trips < TRIPS_LOGGED and sw.explains:  # (the first few; after the timing)
                logger.info("CSV-Decode: the off-switch sends %r steps dense: %s", kind, sw.explain(kind))
            stats = csv_head.StepStats(rows=B, csv_rows=plan.csv_rows, seconds=seconds, screen=head.screen_name)
            stats.fallbacks["unsupported"] = split.csv_rows - len(split.rows)
            stats.fallbacks["off_switch"] = plan.csv_rows - stats.fallbacks["unsupported"]
            if with_sampler:  # accounted once vLLM's sampler call is timed
                step.handoff = StepAccount(self, "dense", head=head, stats=stats, key=key, with_sampler=True)
            else:
                self._dense_step(head, stats, key if not hidden_states.is_cuda else None)  # (CUDA: no sync to time it)
            steps = sw.refusals_ahead(key, kind)
            if steps:
                self._csv_lane = Lane.open(self.csv_metrics, plan, step, key, kind, steps, stats,
                                           timed=not hidden_states.is_cuda, with_sampler=with_sampler)
            return logits, False
        # a model that sets tokens to -inf after the head: the head's rows (greedy) over the others
        exclude = step.suppressed_ids if head.can_exclude else None
        if not deferred:
            logits, stats = head.sampler_logits(hidden_states, plan.topk_tensor, lambda h: dense_full(), t0=t0,
                                                temperature=plan.temperature, use_switch=False, exclude=exclude)
            if sw is not None and not asked and not hidden_states.is_cuda:  # every row dense: a sample
                self._observe(sw, B, stats.seconds, kind=UNASKED)
            if head.last_top1 is not None and stats.certified == B:  # (set only where every row is k = 1)
                step.handoff = Top1(logits, head.last_top1)  # for the readers of argmaxes alone (step.Top1)
            if exclude is not None and stats.certified:
                self._over_mask(step, logits, head, None)
        else:
            own_switch = asked
            sub = torch.tensor(in_head, dtype=torch.long, device=hidden_states.device)
            part = None
            if any(ks[i] > 0 for i in in_head):
                part, stats = head.sampler_logits(csv_head.hidden_rows(hidden_states, sub),
                                                  torch.tensor([ks[i] for i in in_head]),
                                                  lambda h: dense_full()[sub], t0=t0,
                                                  temperature=_rows(plan.temperature, in_head),
                                                  use_switch=False, exclude=exclude)
            else:
                stats = csv_head.StepStats(rows=len(in_head), screen=head.screen_name)
            rows = torch.tensor(deferred, dtype=torch.long)
            logits = torch.empty((B, head.vocab_size), dtype=head.dtype, device=hidden_states.device)
            if part is not None:
                logits[sub] = part
                if exclude is not None and stats.certified:
                    self._over_mask(step, logits, head, sub)
            elif in_head:
                logits[sub] = dense_full()[sub].to(head.dtype)
            logits[rows.to(logits.device)] = PLACEHOLDER
            account = StepAccount(self, "deferred", head=head, stats=stats,
                                  modes=self._head_modes(head, stats, ks, modes, in_head),
                                  key=key if own_switch else None, with_sampler=with_sampler)
            step.handoff = Deferred(
                logits, csv_head.hidden_rows(hidden_states, rows.to(hidden_states.device)), rows,
                [modes[i] for i in deferred], self._adapter(head), dense_full, account,
                seconds=clock.now() - t0 - stats.seconds, suppressed=step.suppressed)
            self._log_first(head, stats)
            return logits, True
        self._log_first(head, stats)
        self._record(head, stats, self._head_modes(head, stats, ks, modes, range(B)), B if asked else None)
        return logits, True

    @staticmethod
    def _over_mask(step, logits: torch.Tensor, head, sub: torch.Tensor | None) -> None:
        """The rows of ``logits`` the ``head``'s last call certified over the model's suppressed
        tokens (its rows: ``sub`` of ``logits``'s, None every row), for the model's
        ``compute_logits`` wrapper to check (:func:`~.step.over_mask_tokens`, with the rows' tokens
        where the call certified argmaxes alone): the finite probe written at those tokens on
        those rows, where the model's ``-inf`` must show."""
        got = head.last_certified.to(logits.device)
        rows = got.nonzero().squeeze(1) if sub is None else sub.to(logits.device)[got]
        tokens = None if head.last_top1 is None else head.last_top1[got.to(head.last_top1.device)]
        ids = step.suppressed_ids
        logits[rows[:, None], ids[None]] = SUPPRESSED_PROBE
        step.over_mask = (rows, tokens)

    def settle(self, account: StepAccount, deferred: DeferredStats | None, sampler_seconds: float) -> None:
        """Close a step's account once its sampler call has run (:class:`~.step.Ledger`):
        ``deferred`` what the sampler did with the step's deferred rows, ``sampler_seconds`` the
        time of vLLM's sampler call where the account counts it (``with_sampler``)."""
        if account.kind == "lane":
            account.series.seconds.append(account.head_seconds + sampler_seconds)
            self._span_done(account.key, False, account.head_seconds + sampler_seconds)
        elif account.kind == "dense":
            self._dense_step(account.head, account.stats, account.key, sampler_seconds)
        else:
            deferred.seconds += sampler_seconds
            hm = account.modes
            self._record(account.head, deferred.added_to(account.stats),
                         {k: hm.get(k, 0) + deferred.certified.get(k, 0) for k in set(hm) | set(deferred.certified)},
                         account.key)

    def _dense_step(self, head, stats, key, sampler_seconds: float = 0.0) -> None:
        """The account of a step the off-switch sent dense: its time (plus vLLM's sampler call's,
        ``sampler_seconds``, for a key with the sampler) as an in-place dense sample of ``key``
        (None: not timed), and its metrics."""
        stats.seconds += sampler_seconds
        if key is not None:
            self._observe(head.off_switch, key, stats.seconds)
        self._record(head, stats, {}, None)

    def _outside(self, sw, plan, t0: float, planning: float = 0.0) -> None:
        """The time the last step spent outside its timed span, up to this step (``t0``), to the
        off-switch (:meth:`~vllm_csv.off_switch.OffSwitch.observe_outside`: CSV is charged what it
        costs around the head too) where both steps are of the same batch (the same ``plan``: no
        request came or went, so the model's work between them is alike) and the last one was
        timed; this step's span starts here (``planning`` of it: the plan's lookup, :meth:`_observe`)."""
        prev = self._csv_span
        self.__dict__["_csv_span"] = _Span(t0, plan, planning=planning)  # (not nn.Module.__setattr__: 1.4 us)
        if sw is not None and prev is not None and prev.plan is plan and prev.key is not None:
            sw.observe_outside(prev.key, prev.csv, t0 - prev.t0 - prev.seconds)

    def _observe(self, sw, key, seconds: float, csv: bool = False, kind: str | None = None) -> None:
        """A step timed in place, to the off-switch: a CSV step's ``seconds`` to its ledger
        (``observe``), a dense one's to the dense estimate of ``key`` (``observe_dense``, as a
        step of ``kind``: default the one ``allow`` named) less its plan's lookup, which vLLM's own
        step does without (14-20 us cold on the test model, 9% of its head); and the step's span."""
        if csv:
            sw.observe(key, seconds)
        else:
            span = self._csv_span
            sw.observe_dense(key, max(0.0, seconds - (span.planning if span is not None else 0.0)), kind)
        self._span_done(key, csv, seconds)

    def _span_done(self, key, csv: bool, seconds: float) -> None:
        """The current step was timed: ``seconds`` under the off-switch's ``key``, CSV or dense."""
        span = self._csv_span
        if span is not None:
            span.key, span.csv, span.seconds = key, csv, seconds

    def _lane_step(self, lane: Lane, step, lm_head, hidden_states: torch.Tensor, embedding_bias) -> torch.Tensor:
        """A step of the open ``lane`` (:mod:`.lane`): vLLM's call and one append; where the lane
        times it (:meth:`~.lane.Lane.times_next`), its span from here and the time around the
        head up to here, else no clock reading and no span."""
        if lane.times_next():
            t0 = clock.now()
            self._outside(self.csv_head.off_switch, lane.plan, t0)
        else:
            t0 = self.__dict__["_csv_span"] = None
        lane.take(step)
        logits = super().forward(lm_head, hidden_states, embedding_bias)
        if logits.dtype != self.csv_head.dtype:  # (Tensor.to costs a microsecond even where it returns self)
            logits = logits.to(self.csv_head.dtype)
        if t0 is None:
            lane.series.seconds.append(None)
        elif lane.with_sampler:  # (the append comes with the sampler call's time)
            step.handoff = StepAccount(self, "lane", series=lane.series, with_sampler=True, key=lane.key,
                                       head_seconds=clock.now() - t0)
        else:
            seconds = clock.now() - t0
            lane.series.seconds.append(seconds)
            if lane.timed:
                self._span_done(lane.key, False, seconds)
        return logits

    def _close_lane(self, sw) -> None:
        lane, self._csv_lane = self._csv_lane, None
        lane.close(sw, self.csv_metrics)

    def _adapter(self, head):
        from ..sampling.head_adapter import HeadAdapter
        from ..sampling.sharded_rows import ShardedAdapter

        if getattr(self, "_csv_adapter", None) is None or self._csv_adapter.head is not head:
            sharded = not isinstance(head, csv_head.CertifiedHead)
            self._csv_adapter = ShardedAdapter(head) if sharded else HeadAdapter(head)
        return self._csv_adapter

    @staticmethod
    def _head_modes(head, stats, ks: list[int], modes: list[str], rows) -> dict[str, int]:
        """Certified head-time rows by mode: ``rows`` are the rows the head's last
        ``sampler_logits`` call saw, in order (its ``last_certified``, a host tensor: no pass
        over the ``[B, V]`` logits)."""
        if not stats.certified:
            return {}
        out: dict[str, int] = {}
        for i, c in zip(rows, head.last_certified.tolist()):
            if c and ks[i] > 0:
                out[modes[i]] = out.get(modes[i], 0) + 1
        return out

    def _log_first(self, head, stats) -> None:
        if not self._csv_logged:
            backend = head.screen_backend  # e.g. int8 on x86: vnni or fbgemm
            logger.info("CSV-Decode active: screen=%s V=%d d=%d%s, first step %d/%d rows certified in the head",
                        stats.screen, head.vocab_size, head.hidden_size, f" backend={backend}" if backend else "",
                        stats.certified, stats.rows)
            self._csv_logged = True

    def _record(self, head, stats, modes: dict[str, int], switch_key=None) -> None:
        """Metrics of a step, and the off-switch's account of a step it let try CSV
        (``switch_key``: the step's key in the switch, its batch size or ``(B, "sampler")``;
        ``stats.seconds`` includes the work of rows certified in the sampler, and for the second
        key vLLM's sampler call)."""
        if switch_key is not None:
            self._observe(head.off_switch, switch_key, stats.seconds, csv=True)
        if self.csv_metrics is not None:  # under TP: the global decision (rank 0) and per-rank counts
            sw = head.off_switch
            key = stats.rows if switch_key is None else switch_key
            self.csv_metrics.record(stats, None if sw is None else sw.dense_seconds.get(key), modes)

    def csv_invalidate(self) -> None:
        """The served weights changed in place (vLLM's ``reload_weights``, ``update_weights``,
        ``wake_up``: :func:`~.patches.watch_weights`): the head, its screen and its index describe
        the old ones, so the next call builds them again from the weights as they are now."""
        if self.csv_head is not None:
            if self._csv_lane is not None:  # (its steps counted, to the old head's switch and the metrics)
                self._close_lane(self.csv_head.off_switch)
            self.csv_head, self._csv_for, self._csv_stale = None, None, True
            # (the adapter holds the old head: dropped too, so its screen's memory is free before
            # the new one is built)
            self._csv_span = self._csv_adapter = None

    def _switch_off(self, reason: str) -> None:
        self._csv_off = reason
        logger.warning(OFF, reason)

    def _head_for(self, lm_head, embedding_bias):
        """The certified head for a call with this ``lm_head`` and ``embedding_bias``, built at the
        first call (vLLM makes it during start-up: a bad index stops the server there), or None
        where the call must be vLLM's own: a quantized head (its logits are not the float GEMM
        the screens bound); another head or bias object than the one the screen was built for
        (one layer called with several heads: DeepSeek and Bailing MTP drafters, Medusa; or a
        replaced weight); a rebuild after the weights changed that the index file refuses."""
        if self._csv_off is not None:
            return None
        built_for = self._csv_for
        if self.csv_head is not None and built_for is None:  # (a harness's layer: CSVLogitsProcessor.around)
            return self.csv_head
        if self.csv_head is None:
            reason = unsupported_head(lm_head)
            if reason:
                self._switch_off(reason)
                return None
            drafter = getattr(getattr(self, "csv_channel", None), "drafter", False)
            try:
                self._get_head(lm_head, embedding_bias, drafter)
            except CSVError as e:
                # a drafter's head is built at its first proposal, mid-serving (vLLM never calls it
                # at start-up): its failure keeps the drafter dense instead of stopping the engine
                if not (self._csv_stale or drafter):
                    raise
                self._switch_off(f"the weights changed and the head could not be built again ({e})" if self._csv_stale
                                 else f"the drafter's head could not be built ({e})")
                return None
            self._csv_for = built_for = (lm_head, lm_head.weight, embedding_bias)
        if not self._built_for(lm_head, embedding_bias):
            if not self._csv_warned_other:
                self._csv_warned_other = True
                logger.warning("CSV-Decode: this LM-head layer was called with another head or bias than the one "
                               "its screen was built for (several heads on one layer, or a replaced weight); "
                               "such calls use the dense head.")
            return None
        return self.csv_head

    def _built_for(self, lm_head, embedding_bias) -> bool:
        """Whether the head serves calls with this ``lm_head`` and ``embedding_bias`` (the
        objects it was built for; a harness's layer: any) and CSV is not off for good."""
        built_for = self._csv_for
        return self._csv_off is None and (built_for is None or (
            lm_head is built_for[0] and lm_head.weight is built_for[1] and embedding_bias is built_for[2]))

    def _get_head(self, lm_head, embedding_bias, drafter: bool = False):
        """Build the head (:meth:`_head_for`; :func:`.head_builder.build_head`)."""
        if self.csv_head is None:
            self.csv_head, metrics = build_head(self, lm_head, embedding_bias, drafter)
            if self.csv_metrics is None:  # (a rebuild keeps the metrics: csv_invalidate)
                self.csv_metrics = metrics()
        return self.csv_head


@dataclass
class _Span:
    """A step from its layer call's start (``t0``) to the next step's (:meth:`CSVLogitsProcessor._outside`)."""

    t0: float
    plan: object
    key: object = None  # the off-switch's key, once the step is timed (None: not timed)
    csv: bool = False
    seconds: float = 0.0  # its timed span
    planning: float = 0.0  # the part of it the plan's lookup took (wall time; 0: a lane step's)


def _rows(temperature: torch.Tensor | None, rows: list[int]) -> torch.Tensor | None:
    """The plan's ``temperature`` argument for the head's rows ``rows`` (None: all greedy)."""
    if temperature is None:
        return None
    t = temperature[rows]
    return t if bool((t > 0).any()) else None
