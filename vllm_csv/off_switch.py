"""Adaptive off-switch: CSV may cost at most ``tolerance`` (2%) more head time than dense.

A ledger over the whole run, in seconds of LM-head time:

* ``dense_total``: the dense head's time for every step seen, CSV or not (estimated per
  batch size, measured once, best of two);
* ``excess``: over the steps that tried CSV, ``CSV time - dense time`` (negative when CSV
  saved time; savings are banked up to ``credit_steps`` dense steps, so that a model that
  turns slow spends at most that much of them).

A step may try CSV only while ``excess <= tolerance * dense_total``. Each tried step adds
one step's excess at most, so at every moment ``excess <= tolerance * dense_total + x``
with ``x`` the excess of a single step: over any run, CSV is never more than ``tolerance``
slower than the dense head, up to one step, plus, once per batch size, its first CSV step,
which is a warm-up (first calls of kernels, allocator growth) and is not charged, and the two
dense-head runs that measure its dense time. This holds for any sequence of steps (the floor
on ``excess`` only ever raises it), workloads that alternate between steps CSV pays for and
steps it does not included (``tests/test_off_switch.py``). A CSV path that is ``r`` times
slower than dense is retried once every ``(r - 1) / tolerance`` steps; a faster one is never
stopped. The ledger is one for all batch sizes: after a costly step of dense time ``d1``, a
batch of dense time ``d2`` waits up to ``(r - 1) d1 / (tolerance d2)`` steps for its retry.
"""

from __future__ import annotations

from collections.abc import Callable


class OffSwitch:
    def __init__(self, tolerance: float = 0.02, credit_steps: int = 64):
        self.tolerance, self.credit_steps = tolerance, credit_steps
        self.dense_seconds: dict[int, float] = {}
        self.dense_total = 0.0
        self.excess = 0.0
        self.times_tripped = 0  # transitions from trying CSV to not trying
        self._on = True
        self._warm: set[int] = set()

    def dense_estimate(self, batch: int, measure: Callable[[], float]) -> float:
        if batch not in self.dense_seconds:
            self.dense_seconds[batch] = min(measure(), measure())
        return self.dense_seconds[batch]

    def allow(self, batch: int, measure_dense: Callable[[], float]) -> bool:
        """Start a step of ``batch`` rows: whether it may try CSV (else it runs dense)."""
        self.dense_total += self.dense_estimate(batch, measure_dense)
        on = self.excess <= self.tolerance * self.dense_total
        if self._on and not on:
            self.times_tripped += 1
        self._on = on
        return on

    def observe(self, batch: int, seconds: float) -> None:
        """Account a step that tried CSV and took ``seconds`` (after :meth:`allow`)."""
        if batch not in self._warm:
            self._warm.add(batch)
            return
        dense = self.dense_seconds[batch]
        self.excess = max(self.excess + seconds - dense, -self.credit_steps * dense)

    def charge(self, seconds: float) -> None:
        """Add CSV work done outside an observed step (deferred rows certified in the sampler,
        which the dense path would not have done) to the excess."""
        self.excess += seconds
