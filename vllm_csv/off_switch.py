"""Adaptive off-switch: stop trying CSV while it does not pay.

After every step that tried CSV, the step's head time is compared with the dense
head's time for the same batch size (measured once per batch size, best of two).
When the mean ratio over the last ``window`` such steps exceeds ``1 + tolerance``
(CSV slower than dense), CSV is switched off for ``cooldown`` steps, after which it
is tried again. Bounded overhead: at most one window of slow steps per cooldown.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class OffSwitch:
    def __init__(self, window: int = 32, tolerance: float = 0.0, cooldown: int = 1024):
        self.window, self.tolerance, self.cooldown = window, tolerance, cooldown
        self.ratios: deque[float] = deque(maxlen=window)
        self.dense_seconds: dict[int, float] = {}
        self.off_left = 0
        self.times_tripped = 0

    def allow(self) -> bool:
        """False while switched off (each call uses up one step of the cooldown)."""
        if self.off_left > 0:
            self.off_left -= 1
            return False
        return True

    def dense_estimate(self, batch: int, measure: Callable[[], float]) -> float:
        if batch not in self.dense_seconds:
            self.dense_seconds[batch] = min(measure(), measure())
        return self.dense_seconds[batch]

    def observe(self, batch: int, seconds: float, measure_dense: Callable[[], float]) -> None:
        self.ratios.append(seconds / max(self.dense_estimate(batch, measure_dense), 1e-9))
        if len(self.ratios) == self.window and sum(self.ratios) / self.window > 1.0 + self.tolerance:
            self.off_left = self.cooldown
            self.times_tripped += 1
            self.ratios.clear()
