"""The clock the plugin times its steps on: wall time less what no path of the head's is to blame for.

The off-switch (:mod:`vllm_csv.off_switch`) charges CSV each step's time against the dense head's,
so a step's time must be the path's own. Two things land in whichever step they happen to hit,
CSV or dense, and are taken out:

* **Python's full garbage collections.** A collection of the oldest generation in a serving
  worker stops every Python thread for as long as it takes to walk vLLM's heap: 0.1 to 0.6 s on
  the demo's worker on a Zen 4, measured with ``gc.callbacks``, against head steps of 2 to 10 ms.
  It runs in whichever step's allocation crosses the collector's threshold, and a CSV step (a
  plan, a few small objects) crosses it more often than a dense one (one GEMM), so a step that
  happened to host it was charged 0.1 to 0.5 s it did not cost, which kept CSV off for hundreds
  to thousands of steps (in a short benchmark, for the whole run: 0.93x where CSV, on, gives
  1.42x). The collections are the whole worker's allocations' doing, of which a step's own are a
  small part; what CSV's add to them shows in the serving benchmarks' tokens/s, not here.
* **Time the thread was ready to run but the OS ran something else** (its run-queue wait, the
  second field of Linux's ``/proc/thread-self/schedstat``). Another process on the worker's core
  (another tenant, the server's own API process, a second server) takes the core in slices of
  tens of ms: in a server's first request on the 2-core Zen 4, the worker's thread spent most of
  its wall time waiting on the run queue, and CSV steps of 2 to 3 ms read 48 to 78 ms. One such
  step, the first charged after the warm-up, put CSV 36 ms in debt, which a short benchmark's 2%
  allowance never repaid (one of eight one-sequence ngram runs kept CSV off: 1.00x where the
  others gave 1.35-1.59x). Preemption falls on a step in proportion to the time it runs, whichever
  path it runs, so leaving it out keeps the comparison's sign and drops its heavy tail.

:func:`now` is ``time.perf_counter()`` less the calling thread's run-queue wait so far, less
the seconds every full collection (generation 2) in this process took so far, each measured on
the clock without the run-queue wait (``gc.callbacks``, registered at import): a clock that
stands still while the thread waits for a core or a full collection runs, so the difference of
two readings is a span's time without them. It is what the off-switch charges, the metrics'
step times and the outside-the-span times. Not taken out: young-generation collections (they
scale with the young objects, which the timed step's own allocations are among); time the thread
blocks (I/O, a lock, an OpenMP pool's sleeping workers, a device sync), which is the step's; and
a preempted OpenMP worker, which the calling thread waits for running or blocked, not on the
run queue. Where the schedstat file cannot be read (not Linux, some sandboxes) only the
collections are taken out (:data:`RUN_QUEUE`). It is monotone per thread (a reading taken during
a collection, from a finalizer, is the collection's start; readings never go back). One caveat:
a collection run by another Python thread while this one is in native code with the GIL
released is taken out too, though this thread ran on (the plugin's steps run on the worker's one
Python thread).
"""

from __future__ import annotations

import gc
import os
import threading
import time

_SCHEDSTAT = "/proc/thread-self/schedstat"  # run time, run-queue wait (ns), time slices


def _readable() -> bool:
    try:
        with open(_SCHEDSTAT, "rb") as f:
            return len(f.read().split()) >= 2
    except OSError:
        return False


RUN_QUEUE = _readable()  # whether now() takes out the run-queue wait (module docstring)


class _Thread(threading.local):
    """A thread's schedstat file (opened at its first reading) and its last reading."""

    fd: int | None = None
    last: float = float("-inf")

    def __del__(self):  # (the thread ended: its file closes with it)
        if self.fd is not None:
            try:
                os.close(self.fd)
            except Exception:  # (at interpreter exit the os module may be gone already)
                pass


_thread = _Thread()


def _reset_after_fork() -> None:  # a forked child's thread is not its parent's: its own file
    global _thread
    _thread = _Thread()


os.register_at_fork(after_in_child=_reset_after_fork)


def _waited() -> float:
    """The calling thread's run-queue wait so far, in seconds (0 without :data:`RUN_QUEUE`)."""
    if not RUN_QUEUE:
        return 0.0
    t = _thread
    if t.fd is None:
        t.fd = os.open(_SCHEDSTAT, os.O_RDONLY)
    return int(os.pread(t.fd, 64, 0).split()[1]) * 1e-9


def _running() -> float:
    """Wall time less the calling thread's run-queue wait."""
    return time.perf_counter() - _waited()


# (kept across a reload of this module: a reset would move the clock forward by every
# collection so far)
_collected: float = globals().get("_collected", 0.0)  # seconds of full collections, up to the last one's end
_started: float | None = None  # the running full collection's start


def _on_collection(phase: str, info: dict) -> None:
    global _collected, _started
    if info.get("generation") != 2:
        return
    if phase == "start":
        _started = _running()
    elif _started is not None:
        _collected += _running() - _started
        _started = None


def now() -> float:
    """Seconds on the steps' clock (module docstring): only differences mean anything."""
    started = _started
    t = _thread
    reading = max(t.last, (_running() if started is None else started) - _collected)
    t.last = reading
    return reading


# one callback, this module's (a reload replaces the old one)
gc.callbacks[:] = [cb for cb in gc.callbacks
                   if not (getattr(cb, "__module__", None) == __name__ and getattr(cb, "__name__", "") == "_on_collection")]
gc.callbacks.append(_on_collection)
