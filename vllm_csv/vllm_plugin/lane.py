"""The fast lane: steps the off-switch would surely send dense, run as vLLM's call and one append.

After the off-switch refuses a step because its kind is off, it can say how many more steps of
the same batch it will surely refuse (:meth:`~vllm_csv.off_switch.OffSwitch.refusals_ahead`).
The layer (:mod:`.logits_processor`) then opens a :class:`Lane` over those steps: each is vLLM's
own layer call plus one append, with no step plan, ledger, step stats or metrics call. They are
accounted when the lane closes (:meth:`Lane.close`): the ledger as that many refusals
(:meth:`~vllm_csv.off_switch.OffSwitch.skip`), the times as in-place dense samples, the metrics
as a series of one step's stats (counted at every flush meanwhile:
:meth:`~vllm_csv.metrics.CSVMetrics.open_series`).

A lane times two consecutive steps in every :data:`STRIDE` (:meth:`Lane.times_next`): the
second and third, the tenth and eleventh, and so on; the others read no clock, keep no span and
append None. (Not the first: the time around the head recorded there, from the end of the step
that opened the lane, would hold the rest of that step, a refusal that does more than a lane
step, or a prefill.) A reading of the plugin's clock is a system call (:mod:`vllm_csv.clock`),
which costs 5 to 8 us in the serving loop (cold caches, after the model's kernels), and the
dense estimate needs only the last :data:`~vllm_csv.off_switch.WINDOW` samples; a timed pair
also gives one sample of the time around the head (the first step's, recorded at the second).
A lane step's time starts after its plan is known (on either path below), and a refusal's or a
probe's dense sample leaves its plan's lookup out too: vLLM's own step looks up none (a CSV step
is charged its own). The metrics count
every step and put the timed ones' times in the head-time histogram.

A step is the lane's while the runner's batch is the one the lane opened on, known two ways:

* before the step's plan is built (:meth:`Lane.takes`), by the runner's batch identity
  (:meth:`~.step.LazyPlan.batch_key`: on the V1 runner vLLM's ``InputBatch.sampling_metadata``,
  :func:`~.v1.plan.batch_key`), so the plan is never built: an untimed step costs the check and
  one append around vLLM's call;
* after, by the plan object (the plan builders hand out the same object while the batch holds:
  the V2 runner, whose plan is built before the step opens, speculative steps and harnesses);
  such a step also renews the lane's batch identity (a batch that changed and came back to the
  same plan, a preempted request re-added to its row, say, keeps the lane on the first way).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..metrics import Series
from ..off_switch import WINDOW
from .step import LazyPlan, Step

STRIDE = 8  # a lane times two of every STRIDE steps it takes (module docstring)


@dataclass
class Lane:
    plan: object  # the step plan the lane opened on
    key: object  # the steps' key in the off-switch: the batch size, or (B, "sampler")
    kind: str  # the off-switch's ledger
    left: int  # steps the lane may still take
    series: Series  # each lane step's time (open in the metrics when they are on)
    timed: bool  # the times are in-place dense samples (not on CUDA: no sync to time it)
    with_sampler: bool = False  # each time includes vLLM's sampler call (a StepAccount of kind "lane")
    batch: object = None  # the runner's batch identity when the lane opened (None: unknown)
    rows: int = 0  # the plan's rows
    taken: int = 0  # steps taken

    @classmethod
    def open(cls, metrics, plan, step: Step, key, kind: str, steps: int, stats, timed: bool,
             with_sampler: bool = False) -> Lane:
        """A lane over the next ``steps`` steps of ``plan``, opened during ``step`` (the step the
        off-switch refused, whose batch identity it keeps); ``stats`` the series' step stats."""
        series = metrics.open_series(stats) if metrics is not None else Series(stats)
        batch = step.lazy.batch_key() if step.lazy is not None else None
        return cls(plan, key, kind, steps, series, timed, with_sampler, batch, len(plan.topk))

    def takes(self, step: Step, rows: int) -> bool:
        """Whether ``step``, a layer call of ``rows`` rows whose plan is not built yet, is this
        lane's (module docstring; the caller then takes the step's plan itself)."""
        plan = step.plan
        return self.left > 0 and self.batch is not None and rows == self.rows and type(plan) is LazyPlan and \
            plan.batch_key() is self.batch

    def times_next(self) -> bool:
        """Whether the lane's next step is timed (module docstring)."""
        return 0 < self.taken % STRIDE < 3

    def take(self, step: Step) -> None:
        """``step`` taken (its batch identity, where it has one, is the lane's from now on)."""
        self.left -= 1
        self.taken += 1
        if step.lazy is not None:
            self.batch = step.lazy.batch_key()

    def close(self, sw, metrics) -> None:
        """Account the lane's steps (module docstring)."""
        seconds = self.series.seconds
        # (a timed lane step with the sampler whose sampler call never came appended nothing:
        # the ledger counts the steps that appended)
        sw.skip(self.key, self.kind, len(seconds))
        if self.timed:  # (the estimate is the median of the last WINDOW)
            for s in [s for s in seconds if s is not None][-WINDOW:]:
                sw.observe_dense(self.key, s, self.kind)
        if metrics is not None:
            metrics.close_series(self.series)
