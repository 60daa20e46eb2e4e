"""The steps' clock stands still while Python's garbage collector runs and while the OS runs
another process on the thread's core (vllm_csv/clock.py)."""

import gc
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from vllm_csv import CertifiedHead, clock


def _heap(n: int = 400_000) -> list:
    """Container objects enough that a full collection takes tens of milliseconds."""
    return [[i] for i in range(n)]


def _collect_in(fn):
    """``fn()``'s seconds on the wall and on the clock."""
    w0, c0 = time.perf_counter(), clock.now()
    fn()
    return time.perf_counter() - w0, clock.now() - c0


def test_a_collection_is_not_on_the_clock():
    heap = _heap()
    spent = []

    def work():
        t = time.perf_counter()
        gc.collect()
        spent.append(time.perf_counter() - t)

    wall, steps = _collect_in(work)
    assert spent[0] > 0.005, spent  # (the heap made it measurable)
    assert steps < 0.2 * wall, (steps, wall)
    readings = [clock.now() for _ in range(1000)]
    assert readings == sorted(readings)  # monotone
    del heap


def test_the_heads_step_seconds_leave_a_collection_out():
    """A collection inside the dense function of a step (as it lands in whichever step's
    allocation crosses the threshold) is not the step's time: StepStats.seconds, which the
    plugin's off-switch and metrics read, leaves it out."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(4096, 64, generator=g)
    h = torch.randn(4, 64, generator=g)
    head = CertifiedHead(W)
    heap = _heap()
    spent = []

    def dense(x):
        t = time.perf_counter()
        gc.collect()
        spent.append(time.perf_counter() - t)
        return x @ W.T

    w0 = time.perf_counter()
    logits, stats = head.sampler_logits(h, torch.zeros(4, dtype=torch.long), dense)  # k = 0: dense rows
    wall = time.perf_counter() - w0
    assert torch.equal(logits, h @ W.T)
    assert spent and spent[0] > 0.005
    assert stats.seconds <= wall - 0.9 * spent[0], (stats.seconds, wall, spent)
    del heap


def test_young_collections_stay_on_the_clock():
    """Only full collections stand the clock still: a young one scales with the young objects,
    the timed step's own allocations among them, and stays the step's time."""
    gc.collect()
    gc.disable()
    try:
        heap = _heap()  # young: no collection has seen them yet
        spent = []

        def work():
            t = time.perf_counter()
            gc.collect(0)
            spent.append(time.perf_counter() - t)

        ran = time.thread_time()
        wall, steps = _collect_in(work)
        ran = time.thread_time() - ran  # (not the wall time: another process may take the core meanwhile)
    finally:
        gc.enable()
    assert spent[0] > 0.002, spent
    assert steps >= 0.9 * ran, (steps, ran, wall)
    del heap


def test_a_reading_during_a_collection_and_a_reload_keep_it_monotone():
    """A finalizer that reads the clock during a full collection reads its start; a reload of the
    module keeps the seconds collected so far and one callback."""
    import importlib

    heap = _heap()
    readings = []

    class Reads:
        def __del__(self):
            readings.append(clock.now())

    a = Reads()
    a.cycle = a  # freed by the collector only
    del a
    gc.collect()
    after = clock.now()
    assert readings and readings[0] <= after
    before = clock.now()
    importlib.reload(clock)
    assert 0 <= clock.now() - before < 0.05
    assert sum(getattr(cb, "__name__", "") == "_on_collection" for cb in gc.callbacks) == 1
    del heap


@pytest.mark.skipif(not clock.RUN_QUEUE, reason="no /proc/thread-self/schedstat: the clock leaves out collections only")
def test_time_another_process_holds_the_core_is_not_on_the_clock():
    """A process spinning on this thread's core takes about half its wall time; the clock counts
    the thread's own running time (the plain wall clock, the step clock before, fails this)."""
    cpu = min(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    mask = os.sched_getaffinity(0)
    try:
        try:
            os.sched_setaffinity(0, {cpu})  # (this thread only)
        except PermissionError:
            pytest.skip("this sandbox refuses sched_setaffinity")
        time.sleep(0.3)  # (the hog is up and spinning)
        w0, c0, r0 = time.perf_counter(), clock.now(), time.thread_time()
        x = 0
        while time.thread_time() - r0 < 0.3:
            x += 1
        wall, steps, ran = time.perf_counter() - w0, clock.now() - c0, time.thread_time() - r0
    finally:
        os.sched_setaffinity(0, mask)
        hog.kill()
        hog.wait()
    assert wall > 1.4 * ran, (wall, ran)  # (the hog did take the core)
    # (above the thread's CPU time: steal and interrupt time, in neither)
    assert ran * 0.95 <= steps <= ran * 1.3, (steps, ran, wall)


def _child(queue) -> None:
    fresh = clock._thread.file is None  # (the parent's file, opened before the fork, is not this thread's)
    t0 = clock.now()
    queue.put((fresh, clock.now() >= t0))


@pytest.mark.skipif(not clock.RUN_QUEUE, reason="no /proc/thread-self/schedstat")
def test_a_forked_child_reads_its_own_thread():
    clock.now()
    assert clock._thread.file is not None
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    p = ctx.Process(target=_child, args=(queue,))
    p.start()
    got = queue.get(timeout=60)
    p.join(60)
    assert got == (True, True) and p.exitcode == 0


def test_a_reading_during_another_threads_collection_keeps_this_threads_clock(monkeypatch):
    """Each reader subtracts its own run-queue wait: a collection another thread runs does not
    move this thread's clock into that thread's frame (which held it still for the difference
    of the two threads' waits)."""
    main = threading.get_ident()
    # this (serving) thread has waited 5 s for its core over its life, the collector none
    monkeypatch.setattr(clock, "_waited", lambda: 5.0 if threading.get_ident() == main else 0.0)
    monkeypatch.setattr(clock, "_thread", clock._Thread())  # (no earlier reading: the mock moves the wait)
    clock.now()
    inside = threading.Event()

    class Finalized:
        def __del__(self):  # (runs inside the collection; sleeping lets the other thread run)
            inside.set()
            time.sleep(0.1)

    def collector():
        a = Finalized()
        a.cycle = a
        del a
        gc.collect()

    c = threading.Thread(target=collector)
    c.start()
    assert inside.wait(10)
    assert clock._started is not None
    clock.now()  # (this thread reads the clock during the other thread's collection)
    c.join()
    t0 = clock.now()
    time.sleep(0.2)
    assert clock.now() - t0 >= 0.15


@pytest.mark.skipif(not clock.RUN_QUEUE, reason="no /proc/thread-self/schedstat")
def test_a_threads_schedstat_file_closes_when_the_thread_ends():
    clock.now()
    fds = len(os.listdir("/proc/self/fd"))

    def collect():
        clock.now()
        gc.collect()  # (the collection callback reads the collector's file too)

    for _ in range(4):  # (a file left open per thread: 4 more; each full collection of the suite's heap takes ~1 s)
        t = threading.Thread(target=collect)
        t.start()
        t.join()
    assert len(os.listdir("/proc/self/fd")) <= fds + 1


@pytest.mark.parametrize("v2,mount", [(True, ""), (False, "cpu,cpuacct"), (False, "cpu")])
@pytest.mark.parametrize("capped_at", [None, "kubepods/pod1", "kubepods"])
def test_a_cpu_capped_cgroup_keeps_the_run_queue_wait_on_the_clock(tmp_path, v2, mount, capped_at):
    """Where a cgroup caps the CPU time (a container's limit), the throttling the process's own
    threads bring on shows as run-queue wait: not taken out. Read at the cgroup and above it,
    cgroup v2 and v1 (its hierarchy mounted as the controller list or as ``cpu``)."""
    ctrl, name, free, cap = (mount, "cpu.max", "max 100000", "50000 100000") if v2 else \
        (mount, "cpu.cfs_quota_us", "-1", "50000")
    for rel in ("", "kubepods", "kubepods/pod1"):
        d = tmp_path / "fs" / ctrl / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(cap if rel == capped_at else free)
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("0::/kubepods/pod1\n" if v2 else "4:memory:/other\n3:cpu,cpuacct:/kubepods/pod1\n")
    assert clock._cpu_capped(str(cgroup), str(tmp_path / "fs")) == (capped_at is not None)
    assert not clock._cpu_capped(str(tmp_path / "missing"), str(tmp_path / "fs"))
    cgroup.write_text("garbage\n" + cgroup.read_text())  # (a line not in the kernel's format is passed over)
    assert clock._cpu_capped(str(cgroup), str(tmp_path / "fs")) == (capped_at is not None)
