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
