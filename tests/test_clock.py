"""The steps' clock stands still while Python's garbage collector runs (vllm_csv/clock.py)."""

import gc
import time

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

        wall, steps = _collect_in(work)
    finally:
        gc.enable()
    assert spent[0] > 0.002, spent
    assert steps >= 0.9 * wall, (steps, wall)
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
