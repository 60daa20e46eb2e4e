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
  tens of ms: in a server's first request on the 2-core Zen 4, CSV steps of 2 to 3 ms read 48 to
  78 ms (traced: a 78 ms one within 82 ms of the thread's run-queue wait). One such
  step, the first charged after the warm-up, put CSV 36 ms in debt, which a short benchmark's 2%
  allowance never repaid (one of eight one-sequence ngram runs kept CSV off: 1.00x where the
  others gave 1.35-1.59x). Preemption falls on a step in proportion to the time it runs, whichever
  path it runs, so leaving it out keeps the comparison's sign and drops its heavy tail.

:func:`now` is ``time.perf_counter()`` less the calling thread's own run-queue wait so far,
less the seconds every full collection (generation 2) in this process took so far, each less its
collecting thread's run-queue wait meanwhile (``gc.callbacks``, registered at import): a clock
that stands still while the thread waits for a core or a full collection runs, so the difference
of two readings is a span's time without them. It is what the off-switch charges, the metrics'
step times and the outside-the-span times. A reading costs about 2 us (one ``pread`` of the
thread's schedstat; the file is opened at the thread's first reading and closed at its end);
the plugin takes two to five a step.

Not taken out: young-generation collections (they scale with the young objects, which the timed
step's own allocations are among); time the thread blocks (I/O, a lock, an OpenMP pool's
sleeping workers, a device sync), which is the step's; a preempted OpenMP worker, which the
calling thread waits for running or blocked, not on the run queue. The run-queue wait stays on
the clock where a cgroup caps the process's CPU time (a container's CPU limit: ``cpu.max``,
``cpu.cfs_quota_us``), since the throttling it brings shows as run-queue wait and the process's
own threads, CSV's among them, spend the quota; and where the schedstat file does not read (not
Linux, some sandboxes): :data:`RUN_QUEUE`. Run-queue wait the step's own threads cause, on a core
they share with it (more OpenMP threads than cores, ``VLLM_CPU_OMP_THREADS_BIND=nobind``), would
be left out too; vLLM-CPU binds one thread per core. The clock is monotone per thread (a reading
taken during a collection, from a finalizer, is the collection's start; readings never go back).
Caveats: a collection run by another Python thread while this one is in native code with the GIL
released is taken out too, though this thread ran on, and so is, twice, this thread's own wait
for a core during it (the plugin's steps run on the worker's one Python thread).
"""

from __future__ import annotations

import gc
import os
import threading
import time

_SCHEDSTAT = "/proc/thread-self/schedstat"  # run time, run-queue wait (ns), time slices


def _cpu_capped(cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> bool:
    """Whether a cgroup this process is in caps its CPU time (v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``, at its cgroup or any above it that the process sees): then the
    run-queue wait holds the cap's throttling, which the process's own threads (CSV's among
    them) bring on, and it stays on the clock."""
    try:
        with open(cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:  # (not the kernel's format: read at import in every vLLM process, so never an error)
            continue
        _, controllers, path = fields
        if controllers and "cpu" not in controllers.split(","):
            continue
        # v1: the hierarchy mounted as its controller list (``cpu,cpuacct``) or as ``cpu`` (the
        # usual name or link; a host mounting it elsewhere reads as uncapped)
        bases, name = ([root], "cpu.max") if not controllers else \
            ([os.path.join(root, d) for d in dict.fromkeys((controllers, "cpu"))], "cpu.cfs_quota_us")
        parts = [p for p in path.split("/") if p]
        for base in bases:
            for depth in range(len(parts), -1, -1):
                try:
                    with open(os.path.join(base, *parts[:depth], name)) as f:
                        limit = f.read().split()[0]
                except (OSError, IndexError):
                    continue
                if limit not in ("max", "-1"):
                    return True
    return False


def _readable() -> bool:
    """Whether this thread's schedstat reads, with a run time (a kernel without the scheduler's
    accounting prints zeros)."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            fields = f.read().split()
        return len(fields) >= 2 and int(fields[0]) > 0
    except (OSError, ValueError):
        return False


# whether now() takes out the run-queue wait (module docstring)
RUN_QUEUE = _readable() and not _cpu_capped()


class _File:
    """A thread's schedstat file, closed when its thread's locals go (at the thread's end)."""

    __slots__ = ("fd",)

    def __init__(self):
        self.fd = os.open(_SCHEDSTAT, os.O_RDONLY)

    def __del__(self):
        try:
            os.close(self.fd)
        except Exception:  # (at interpreter exit the os module may be gone already)
            pass


class _Thread(threading.local):
    """A thread's schedstat file (opened at its first reading) and its last reading."""

    file: _File | None = None
    last: float = float("-inf")


_thread = _Thread()


def _reset_after_fork() -> None:  # a forked child's thread is not its parent's: its own file
    global _thread
    _thread = _Thread()


if not globals().get("_fork_hooked"):  # (once: a reload keeps the hook, which reads this module's globals)
    os.register_at_fork(after_in_child=_reset_after_fork)
    _fork_hooked = True


def _waited() -> float:
    """The calling thread's run-queue wait so far, in seconds (0 without :data:`RUN_QUEUE`)."""
    if not RUN_QUEUE:
        return 0.0
    t = _thread
    f = t.file
    if f is None:
        f = t.file = _File()
    return int(os.pread(f.fd, 64, 0).split()[1]) * 1e-9


# (kept across a reload of this module: a reset would move the clock forward by every
# collection so far)
_collected: float = globals().get("_collected", 0.0)  # seconds of full collections, up to the last one's end
_started: tuple[float, float] | None = None  # the running full collection's start: wall time, the collector's wait


def _on_collection(phase: str, info: dict) -> None:
    global _collected, _started
    if info.get("generation") != 2:
        return
    if phase == "start":
        _started = (time.perf_counter(), _waited())
    elif _started is not None:
        (p0, w0), _started = _started, None
        _collected += (time.perf_counter() - p0) - (_waited() - w0)  # (its time less the collector's wait)


def wall() -> float:
    """``time.perf_counter()``, for a span too short to be worth a system call (a few us: the
    step's plan lookup, which the layer leaves out of dense samples), where :func:`now` costs 5
    to 8 us in the serving loop."""
    return time.perf_counter()


def now() -> float:
    """Seconds on the steps' clock (module docstring): only differences mean anything."""
    t = _thread
    while True:
        started, collected = _started, _collected
        wall = time.perf_counter() if started is None else started[0]
        waited = _waited()  # (each reader its own wait; the read releases the GIL:)
        if _started is started and _collected == collected:  # (no collection began or ended meanwhile)
            break
    reading = max(t.last, wall - waited - collected)
    t.last = reading
    return reading


# one callback, this module's (a reload replaces the old one)
gc.callbacks[:] = [cb for cb in gc.callbacks
                   if not (getattr(cb, "__module__", None) == __name__ and getattr(cb, "__name__", "") == "_on_collection")]
gc.callbacks.append(_on_collection)
