"""The thread count the tests and the small benchmarks run with: two, so that runs on a shared
machine do not oversubscribe its cores and their timings compare across runs."""

from __future__ import annotations

import torch

TEST_THREADS = 2


def use_test_threads() -> None:
    """Set torch's intra-op threads to :data:`TEST_THREADS`."""
    torch.set_num_threads(TEST_THREADS)
