"""Adaptive off-switch: CSV may cost at most ``tolerance`` (2%) more time than dense.

A ledger over the whole run, in seconds of LM-head time (plus what CSV costs around the head:
"Around the head" below):

* ``dense_total``: the dense head's time for every step seen, CSV or not (the current
  estimate for that batch size, :attr:`OffSwitch.dense_seconds`);
* ``excess``: over the steps that tried CSV, ``CSV time - dense time`` (negative when CSV
  saved time; savings are banked up to ``credit_steps`` dense steps, so that a model that
  turns slow spends at most that much of them).

A step may try CSV only while ``excess <= tolerance * dense_total``. Each tried step adds
one step's excess at most, so at every moment ``excess <= tolerance * dense_total + x``
with ``x`` the excess of a single step: over any run, CSV is never more than ``tolerance``
slower than the dense head, up to one step, plus, once per kind of step (below), its first
:data:`WARMUP_STEPS` CSV steps, which are a warm-up (first calls of kernels at new shapes,
allocator growth, a server's first requests) and are not charged, and, once per batch size,
the dense-head run that gives the first guess of its dense time
(with probes on, the default, that run is the step's own: a batch size's first step runs
dense).
(The warm-up was once per batch size: a workload whose batch size changes at almost every
step, as requests finish one by one, then ran mostly uncharged CSV steps; on the demo's mixed
workload with default flags that cost 4.6% of dense tokens/s. It was then one step per kind,
but in a server's first request both paths' steps were traced at 2-4x their later times (CSV
steps of 8.8 and 17.6 ms against 2-4.5 ms later; Zen 4, ngram speculation, one sequence), each
charge switching CSV off for a while.) The plugin times every step on
:func:`vllm_csv.clock.now`, which leaves out Python's full garbage collections (0.1 to 0.6 s
each in a serving worker, traced) and the time the worker's thread waits for its core while
another process runs there (tens of ms a slice): the promise is on the steps' time without
them. Either lands in whichever step it hits; steps of 94 and 456 ms (collections) and of 48 to
78 ms (a busy core), each charged to CSV in a server's first request, kept CSV off for the whole
of a short benchmark: 0.93-1.00x where CSV, on, gives 1.35-1.74x. When a kind turns off, the
plugin logs why (:meth:`OffSwitch.explain`). The bound holds for any sequence of
steps (the floor on ``excess`` only ever raises it), workloads that alternate between steps
CSV pays for and steps it does not included (``tests/test_off_switch.py``). A CSV path that
is ``r`` times slower than dense is retried once every ``(r - 1) / tolerance`` steps; a
faster one is never stopped. The ledger is one for all batch sizes: after a costly step of
dense time ``d1``, a batch of dense time ``d2`` waits up to ``(r - 1) d1 / (tolerance d2)``
steps for its retry.

Ledgers by kind of step. The caller may name the kind of each step (:meth:`allow`'s
``kind``: the plugin's are steps whose rows read only an argmax, steps with top-k rows, and
steps with rows certified in the sampler), and each kind keeps its own ``excess`` and
``dense_total``: the promise above holds for each ledger, hence for their sum, and the time a
kind CSV pays for (greedy) is not spent on a kind it does not pay for (top-k rows that rarely
certify), which then turns off on its own. Dense estimates stay per batch size.

Keys. What the methods call ``batch`` is the key of a step's dense estimate: its batch size,
or any other hashable naming steps whose dense time is alike. The plugin times steps with rows
certified in vLLM's sampler together with vLLM's sampler call, on both sides, under the key
``(B, "sampler")`` (:mod:`vllm_csv.vllm_plugin.logits_processor`): CSV's draw skips vLLM's
top-k, top-p and min-p passes on certified rows, a saving the head's time alone does not show.
That needs in-place dense samples of that key (:attr:`OffSwitch.samples_in_place`): a
stand-alone first guess times the dense head only.

Around the head. CSV can cost time outside the span it is timed on: its int8 copy and metadata
may evict the model's weights from the last-level cache, its kernels' thread pool may contend
with the model's, so the next step's forward runs slower (issue 45: on an AVX2 CPU, a head
step timed cheaper than dense while serving got 5-8% slower). So the caller also reports, per
key, the time *outside* the timed span of each timed step, up to the next step of the same
batch (:meth:`observe_outside`: the wall time between the two layer calls, less the timed
span), for CSV steps and dense steps apart (each side's first, a cold step's, left out); once
both have :data:`OUTSIDE_MIN` samples, each
CSV step is charged the difference of their medians on top of its own excess, and the CSV
steps seen before that are charged it at once (:meth:`outside_excess`; its sign kept: an unbiased estimate, where a floor at 0 would charge
CSV the noise of two medians). The ledger then holds whole steps as the user feels them: a
path cheap in the head but dear around it turns off, and the promise above is on the whole
step, up to the estimate of the outside difference. (Not under tensor parallelism: the ranks'
outside times are not gathered; :class:`~vllm_csv.sharded.SharedOffSwitch`.)

The promise is only as good as the dense estimate, so the estimate is measured *in place*:
the median of the last :data:`WINDOW` dense steps of that batch size timed exactly as CSV
steps are (same span of the same layer, in the serving loop, with the caches as the model's
other layers leave them). A dense head timed alone runs on warm caches and a quiet machine
and can be off by 2x either way; that stand-alone time is only the first guess, until a
batch size has in-place samples. Dense steps come for free while CSV is off; while CSV is on
the switch makes a *probe*: the first two steps of a batch size (the first is the shape's
cold first call, not a sample), then one step in every ``probe_every``, run dense and are timed
(:meth:`allow` returns False; the caller times the step and reports it with
:meth:`observe_dense`). A probe costs what CSV would have saved on
that step, at most ``1 / probe_every`` of the savings. A batch size whose probes keep agreeing
with its estimate (each sample within :data:`STABLE` of it) is probed less often: its interval
doubles at each such sample, up to :data:`BACKOFF` times ``probe_every``, and falls back to
``probe_every`` at the first sample that does not agree (the machine's load changed): on a
steady machine a probe then costs a quarter of that, and a stale estimate lasts at most one
interval of the batch size's own steps before a probe finds it out.

Estimates from neighbours. Under speculative decoding a step's row count is the requests'
drafts plus one each, so a run of eight requests meets some ten batch sizes, and two dense
steps for each new one kept a tenth of the rows dense (issue 46: 89.7% of the rows certified at
eight sequences, where the certificate passed 99.86% of those it was asked about). A new batch
size takes its estimate from those measured in place, of the same kind of key (``int`` batch
sizes, or ``(B, tag)`` with the same ``tag``; :meth:`neighbour_estimate`): the line between
the nearest measured below and above it, or, above every one measured but at most
:data:`EXTRAPOLATE` times the largest, the line through the two largest (its slope at least 0),
and tries CSV at once, with no first guess run. It follows them, refreshed at each step, until
its own probes, on the schedule of one step in ``probe_every`` (the first of them is the
shape's cold call, not a sample), give it in-place samples. Any other new batch size (below
every one measured, far above them, or with fewer than two measured) starts as above.
(Borrowing the largest smaller one's estimate, a bound under the dense time, was tried: it
charged CSV for the rows the lender does not have, and in the eight-sequence ngram run the
switch kept 80% of the rows dense. Interpolation alone did little there: that run's batch sizes
first appear in increasing order, 1, 8, 9, 12, 15, 20, 24, 31, 32, each above all before it.)
The promise then holds up to how far the dense time departs from those lines, until the new
batch size has samples of its own.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque
from collections.abc import Callable, Hashable
from functools import partial

WINDOW = 8  # in-place dense samples kept per batch size (their median is the estimate)
OUTSIDE_WINDOW = 16  # outside-the-span samples kept per key and side (observe_outside)
OUTSIDE_MIN = 3  # samples of each side before the outside difference is charged
# The most steps refusals_ahead() promises at once: bounds how long a fast lane (the plugin's
# switched-off steps that skip the ledger) runs on one dense estimate before its samples are
# reported, and the times it keeps.
LANE_MAX = 256
# A kind's first CSV steps, not charged (module docstring): the noise of a server's start-up
# (its first requests), and first calls at the first few shapes
WARMUP_STEPS = 8
STABLE = 0.1  # a probe's sample agrees with the estimate within this fraction of it (module docstring)
BACKOFF = 4  # the longest probe interval, in multiples of probe_every
HISTORY = 12  # the last timed steps kept for a trip's explanation (OffSwitch.explain)
# the history of dense samples from steps no ledger took part in (every row dense by its sampling
# parameters: no allow()), kept apart so that they do not push a kind's own steps out
UNASKED = "unasked"
EXTRAPOLATE = 1.5  # a new batch size at most this times the largest measured takes their line


class OffSwitch:
    samples_in_place = True  # dense steps reported with observe_dense() become the estimate (module docstring)

    def __init__(self, tolerance: float = 0.02, credit_steps: int = 64, probe_every: int = 32,
                 warmup_steps: int = WARMUP_STEPS):
        self.tolerance, self.credit_steps, self.probe_every = tolerance, credit_steps, probe_every
        self.warmup_steps = warmup_steps  # a kind's first CSV steps not charged (module docstring)
        self.dense_seconds: dict[Hashable, float] = {}  # current estimate per batch size (key)
        self._dense_total: dict[str, float] = {}  # per kind of step (module docstring)
        self._excess: dict[str, float] = {}
        self.times_tripped = 0  # transitions from trying CSV to not trying (any kind)
        self.probes = 0  # steps run dense to measure the dense head in place
        self._on: dict[str, bool] = {}
        self._kind = ""  # the kind of the step allow() started (observe() charges it)
        self._warm: dict[str, int] = {}  # kind -> its CSV steps seen, up to warmup_steps
        self._samples: dict[Hashable, deque[float]] = {}
        self._since_probe: dict[Hashable, int] = {}  # CSV steps since the batch size's last probe
        self._probed: set[Hashable] = set()
        self._interval: dict[Hashable, int] = {}  # CSV steps between probes, per batch size (default probe_every)
        self._cold: set[Hashable] = set()  # batch sizes whose first (dense, cold) step is not yet reported
        self._on_neighbours: set[Hashable] = set()  # batch sizes on their neighbours' estimate (module docstring)
        # (key, csv) -> outside times, the window opened by observe_outside's first sample of a side
        self._outside: dict[tuple[Hashable, bool], deque[float]] = {}
        # key -> outside_excess of its current windows, kept until observe_outside changes one
        # (observe reads it every CSV step: two medians of up to OUTSIDE_WINDOW samples)
        self._outside_estimate: dict[Hashable, float] = {}
        self._outside_owed: dict[tuple[Hashable, str], int] = {}  # CSV steps charged before an outside estimate
        # Each kind's last HISTORY timed steps, (whether it ran CSV, key, seconds, dense estimate
        # then, charge or None for a warm-up), for explain(): why a kind turned off, in the
        # server's log (one history a kind: a busy kind does not push out a quiet one's steps).
        self.recent: defaultdict[str, deque[tuple[bool, Hashable, float, float, float | None]]] = \
            defaultdict(partial(deque, maxlen=HISTORY))
        self.explains = True  # whether the plugin logs this switch's trips (SharedOffSwitch: rank 0)

    @property
    def dense_total(self) -> float:
        """The dense head's time over every step seen, all kinds."""
        return sum(self._dense_total.values())

    @property
    def excess(self) -> float:
        """CSV's time minus the dense head's over the steps that tried CSV, all kinds."""
        return sum(self._excess.values())

    def dense_estimate(self, batch: Hashable, measure: Callable[[], float]) -> float:
        """The batch size's estimate; the first guess is one timed call of ``measure``. Once
        only: the plugin's dense function keeps its output for the step (a second call would
        time nothing: that made the first guess about 0 and CSV look slower than it is), and
        the guess only stands until the in-place time of that same step replaces it (with
        probes on, :meth:`allow` sends a batch size's first step dense). Not called for a batch
        size whose neighbours give its estimate (:meth:`neighbour_estimate`)."""
        if batch not in self.dense_seconds:
            self.dense_seconds[batch] = measure()
        return self.dense_seconds[batch]

    def allow(self, batch: Hashable, measure_dense: Callable[[], float], kind: str = "") -> bool:
        """Start a step of ``batch`` rows and of ``kind`` (its ledger): whether it may try CSV
        (else it runs dense, and the caller reports its time with :meth:`observe_dense`)."""
        self._kind = kind
        if self.probe_every and (batch in self._on_neighbours or batch not in self.dense_seconds):
            self._from_neighbours(batch)
        first = batch not in self.dense_seconds
        total = self._dense_total[kind] = self._dense_total.get(kind, 0.0) + self.dense_estimate(batch, measure_dense)
        on = self._excess.get(kind, 0.0) <= self.tolerance * total
        if self._on.get(kind, True) and not on:
            self.times_tripped += 1
        self._on[kind] = on
        if first and self.probe_every:
            # A batch size's first step runs dense: the dense head has just run for the first
            # guess (its output is the step's), so CSV on top would pay for the step twice. That
            # run is the shape's first call, cold: its in-place time is not a sample (it was,
            # and on a model whose head takes 0.13 ms warm it read 0.71 ms and held the median
            # up for dozens of steps, so CSV at twice the dense time looked cheaper and stayed
            # on). The next step is a probe, the estimate's first sample, before any CSV step.
            self._since_probe[batch] = 0
            self._cold.add(batch)
            self.probes += 1
            return False
        if on and self.probe_every:
            n = self._since_probe.get(batch)
            if n is not None and n >= (self._interval.get(batch, self.probe_every) if batch in self._probed else 0):
                self._since_probe[batch] = 0
                self._probed.add(batch)
                self.probes += 1
                return False
        return on

    def neighbour_estimate(self, batch: Hashable) -> float | None:
        """``batch``'s estimate from the batch sizes of its kind of key measured in place (module
        docstring, "Estimates from neighbours"): the line between the nearest below and above
        it, else, where ``batch`` is at most :data:`EXTRAPOLATE` times the largest, the line
        through the two largest (slope at least 0); None otherwise, or where ``batch`` is
        neither an ``int`` nor ``(int, tag)``."""
        size, tag = _size_and_tag(batch)
        if size is None:
            return None
        below, hi = [], None
        for other in self._samples:  # (keys with in-place samples: a few dozen at most)
            s, t = _size_and_tag(other)
            if t != tag or s is None or s == size:
                continue
            if s < size:
                below.append((s, self.dense_seconds[other]))
            elif hi is None or s < hi[0]:
                hi = (s, self.dense_seconds[other])
        below.sort()
        if below and hi is not None:
            (s0, e0), (s1, e1) = below[-1], hi
            return e0 + (e1 - e0) * (size - s0) / (s1 - s0)
        if hi is None and len(below) >= 2 and size <= EXTRAPOLATE * below[-1][0]:
            (s0, e0), (s1, e1) = below[-2:]
            return e1 + max(0.0, (e1 - e0) / (s1 - s0)) * (size - s1)
        return None

    def _from_neighbours(self, batch: Hashable) -> None:
        """A new batch size takes its neighbours' estimate where there is one, and one on such an
        estimate follows them until it has samples of its own. Its probes then run on the usual
        schedule: no dense step before its first CSV step, the first probe a cold call."""
        est = self.neighbour_estimate(batch)
        if est is None:
            return
        if batch not in self.dense_seconds:
            self._on_neighbours.add(batch)
            self._probed.add(batch)  # (the usual schedule: probe_every CSV steps to the first probe)
            self._since_probe[batch] = 0
            self._cold.add(batch)
        self.dense_seconds[batch] = est

    def refusals_ahead(self, batch: Hashable, kind: str = "") -> int:
        """After :meth:`allow` refused a step of ``batch`` rows and of ``kind`` because the kind is
        off (not for a probe): how many more such steps it will surely refuse, if nothing else
        is reported meanwhile (0: the next may try CSV, or the refusal was a probe). While a
        kind is off its ``excess`` stands still and each step adds the batch size's dense
        estimate to its ``dense_total``: step ``j`` from now is refused while
        ``excess > tolerance (dense_total + j d)``. The caller may then skip :meth:`allow` for
        those steps and account them at once with :meth:`skip` (the plugin's fast lane: a
        switched-off step is vLLM's call and nothing else). Capped at :data:`LANE_MAX`."""
        if self._on.get(kind, True):
            return 0
        d, gap = self.dense_seconds[batch], self._excess.get(kind, 0.0) - self.tolerance * self._dense_total[kind]
        if self.tolerance <= 0.0 or d <= 0.0:
            return LANE_MAX
        # (1 - 1e-9): where the exact count is a whole number, rounding must not add a step
        # that allow() would have let try CSV; one step too few only ends the lane early.
        return max(0, min(LANE_MAX, math.ceil(gap / (self.tolerance * d) * (1 - 1e-9)) - 1))

    def skip(self, batch: Hashable, kind: str, steps: int) -> None:
        """Account ``steps`` steps of ``batch`` rows and of ``kind`` that ran dense without
        :meth:`allow` (at most :meth:`refusals_ahead`, with no call in between): the same
        ledger as ``steps`` refused calls of :meth:`allow`."""
        self._dense_total[kind] += steps * self.dense_seconds[batch]

    def observe(self, batch: Hashable, seconds: float, kind: str | None = None) -> None:
        """Account a step that tried CSV and took ``seconds`` (after :meth:`allow`), to the
        ledger of ``kind`` (default: the kind the last :meth:`allow` named)."""
        self._since_probe[batch] = self._since_probe.get(batch, 0) + 1
        dense, kind = self.dense_seconds[batch], self._kind if kind is None else kind
        seen = self._warm.get(kind, 0)
        if seen < self.warmup_steps:
            self._warm[kind] = seen + 1
            self.recent[kind].append((True, batch, seconds, dense, None))
            return
        excess = seconds - dense
        if self._outside_ready(batch):  # (with the steps charged before there was an estimate)
            excess += self.outside_excess(batch) * (1 + self._outside_owed.pop((batch, kind), 0))
        else:
            self._outside_owed[(batch, kind)] = self._outside_owed.get((batch, kind), 0) + 1
        self._excess[kind] = max(self._excess.get(kind, 0.0) + excess, -self.credit_steps * dense)
        self.recent[kind].append((True, batch, seconds, dense, excess))

    def explain(self, kind: str = "") -> str:
        """Why ``kind``'s ledger stands where it does, for a log line: its excess against its
        allowance, and its last :data:`HISTORY` timed steps: CSV steps with what each added to
        the excess (its time less the estimate, plus what it costs around the head, before the
        floor of ``credit_steps``), or that it was a warm-up step; its dense samples."""
        total = self._dense_total.get(kind, 0.0)
        steps = "; ".join(
            f"{kind or 'csv' if csv else 'dense'} {key}: {s * 1e3:.2f} ms (estimate {d * 1e3:.2f} ms"
            + ("" if not csv else ", warm-up" if c is None else f", charged {c * 1e3:+.2f} ms") + ")"
            for csv, key, s, d, c in self.recent.get(kind, ()))
        return (f"excess {self._excess.get(kind, 0.0) * 1e3:.2f} ms over {total * 1e3:.1f} ms of dense time "
                f"(allowed {self.tolerance * total * 1e3:.2f} ms); last steps: {steps or 'none'}")

    def observe_outside(self, batch: Hashable, csv: bool, seconds: float) -> None:
        """The time outside the timed span of a step of ``batch`` (a CSV step if ``csv``, else a
        dense one), up to the next step of the same batch: the model's forward and what else
        the serving loop runs in between (module docstring, "Around the head")."""
        key = (batch, csv)
        if key not in self._outside:
            # each side's first sample is a cold step's (the batch size's first dense steps, its
            # first CSV step): 2.3-2.8 ms around the head on the test model where warm steps take
            # 1.4-1.8 ms, and with two of them among the first three the dense side's median made
            # CSV look 0.64 ms a step cheaper around the head; while CSV is on, that side only
            # gets the probes' samples, so CSV stayed on for 100 steps. It opens the window only.
            self._outside[key] = deque(maxlen=OUTSIDE_WINDOW)
            return
        self._outside[key].append(seconds)
        self._outside_estimate.pop(batch, None)  # the window changed: outside_excess recomputes it

    def outside_excess(self, batch: Hashable) -> float:
        """What a CSV step of ``batch`` costs outside its timed span more than a dense one: the
        difference of the medians of :meth:`observe_outside`'s samples (0 until each side has
        :data:`OUTSIDE_MIN`). Charged to every CSV step (:meth:`observe`), negative included
        (a path that makes the rest of the step faster earns it). Computed once per change of
        the key's samples: the same two medians, kept until :meth:`observe_outside` adds one."""
        est = self._outside_estimate.get(batch)
        if est is None:
            if not self._outside_ready(batch):
                return 0.0
            est = statistics.median(self._outside[(batch, True)]) - statistics.median(self._outside[(batch, False)])
            self._outside_estimate[batch] = est
        return est

    def _outside_ready(self, batch: Hashable) -> bool:
        if batch in self._outside_estimate:  # (kept only once both sides had OUTSIDE_MIN samples)
            return True
        return all(len(self._outside.get((batch, csv), ())) >= OUTSIDE_MIN for csv in (True, False))

    def observe_dense(self, batch: Hashable, seconds: float, kind: str | None = None) -> None:
        """A dense step of ``batch`` rows and of ``kind`` (default: the last :meth:`allow`'s;
        :data:`UNASKED` for a step that called none) timed in place (a probe, CSV off, or rows
        dense by their parameters): updates the batch size's estimate (median of the last
        :data:`WINDOW`)."""
        if batch in self._cold:  # the batch size's first step (allow): cold, not a sample
            self._cold.discard(batch)
            return
        s = self._samples.setdefault(batch, deque(maxlen=WINDOW))
        if s and self.probe_every:  # (the probe interval: module docstring)
            agrees = abs(seconds - self.dense_seconds[batch]) <= STABLE * self.dense_seconds[batch]
            now = self._interval.get(batch, self.probe_every)
            self._interval[batch] = min(2 * now, BACKOFF * self.probe_every) if agrees else self.probe_every
        s.append(seconds)
        self._on_neighbours.discard(batch)
        self.recent[self._kind if kind is None else kind].append(
            (False, batch, seconds, self.dense_seconds.get(batch, seconds), None))
        self.dense_seconds[batch] = statistics.median(s)


def _size_and_tag(batch: Hashable) -> tuple[int | None, Hashable]:
    """A key's batch size and tag: ``B`` is ``(B, None)``, ``(B, tag)`` is itself; other keys
    ``(None, None)`` (no estimate from neighbours for them)."""
    if isinstance(batch, int):
        return batch, None
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], int):
        return batch
    return None, None
