"""Wall-clock timing of one call and of repeated calls: one place for how the CPU benchmarks
time (``time.perf_counter``, milliseconds; ``sync`` waits for a device's queued work, e.g.
``torch.cuda.synchronize``, where the call returns before its work is done); and how the GPU
benchmarks capture what they replay (:func:`cuda_graph`)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def call_ms(fn: Callable[[], object], sync: Callable[[], object] | None = None) -> float:
    """Milliseconds one call of ``fn`` (and ``sync``) takes."""
    t0 = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return (time.perf_counter() - t0) * 1e3


def times_ms(fn: Callable[[], object], repeats: int, sync: Callable[[], object] | None = None) -> list[float]:
    """Milliseconds of each of ``repeats`` calls, after one untimed warm-up call."""
    fn()
    if sync is not None:
        sync()
    return [call_ms(fn, sync) for _ in range(repeats)]


def median_ms(fn: Callable[[], object], repeats: int, sync: Callable[[], object] | None = None) -> float:
    """The median of :func:`times_ms`."""
    return statistics.median(times_ms(fn, repeats, sync))


def cuda_graph(fn: Callable[[], object]):
    """``fn`` captured in a CUDA graph after three warm-up calls on a side stream (allocations and
    lazy initialisation happen outside the capture): ``(graph, out)``, ``out`` what ``fn`` returned
    during the capture (in the graph's memory: each ``graph.replay()`` rewrites it)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out
