"""The clock the plugin times its steps on: wall time with Python's garbage collections taken out.

The off-switch (:mod:`vllm_csv.off_switch`) charges CSV each step's time against the dense head's.
A collection of the oldest generation in a serving worker stops every Python thread for as long
as it takes to walk vLLM's heap: 0.1 to 0.6 s on the demo's worker on a Zen 4, measured with
``gc.callbacks``, against head steps of 2 to 10 ms. It runs in whichever step's allocation
crosses the collector's threshold, and a CSV step (a plan, a few small objects) crosses it more
often than a dense one (one GEMM), so a step that happened to host it was charged 0.1 to 0.5 s
it did not cost, which kept CSV off for hundreds to thousands of steps (in a short benchmark,
for the whole run: 0.93x where CSV, on, gives 1.42x). Neither path's time includes them now.
The collections are the whole worker's allocations' doing, of which a step's own are a small
part; what CSV's add to them shows in the serving benchmarks' tokens/s, not here.

:func:`now` is ``time.perf_counter()`` less the seconds every full collection (generation 2)
in this process took so far (``gc.callbacks``, registered at import): a clock that stands still
while such a collection runs, so the difference of two readings is a span's time without them.
Young-generation collections stay on it: they scale with the young objects, which the timed
step's own allocations are among. It is monotone (a reading taken during a collection, from a
finalizer, is the collection's start). One caveat: a collection run by another Python thread
while this one is in native code with the GIL released is taken out too, though this thread ran
on (the plugin's steps run on the worker's one Python thread).
"""

from __future__ import annotations

import gc
import time

# (kept across a reload of this module: a reset would move the clock forward by every
# collection so far)
_collected: float = globals().get("_collected", 0.0)  # seconds of full collections, up to the last one's end
_started: float | None = None  # the running full collection's start


def _on_collection(phase: str, info: dict) -> None:
    global _collected, _started
    if info.get("generation") != 2:
        return
    if phase == "start":
        _started = time.perf_counter()
    elif _started is not None:
        _collected += time.perf_counter() - _started
        _started = None


def now() -> float:
    """Seconds on the steps' clock (module docstring): only differences mean anything."""
    started = _started
    return (time.perf_counter() if started is None else started) - _collected


# one callback, this module's (a reload replaces the old one)
gc.callbacks[:] = [cb for cb in gc.callbacks
                   if not (getattr(cb, "__module__", None) == __name__ and getattr(cb, "__name__", "") == "_on_collection")]
gc.callbacks.append(_on_collection)
