"""Two screens of one head, chosen per call by the batch size.

A screen's cost is its GEMM plus the exact scoring of the tokens it cannot rule out. The int4
copy (:mod:`.int4`) reads half the bytes of the int8 one (:mod:`.fbgemm`) but bounds each logit
about ten times more loosely, so it leaves more candidates a row, and the scored set of a batch
is the union of its rows'. On this repo's CPUs (AVX512-VNNI, 2 threads) the int4 step wins at
one row and loses from two rows on: on the demo head (V 65536, d 768, bf16; each step timed over
16 distinct batches of held-out hidden states, whose scored sets differ widely: int4 scores 733
tokens a step on average there, int8 10) it took 1.11-1.27 against 1.29-1.35 ms at one row in
four runs, 1.75 against 1.45 ms at two rows, 3.7 against 1.37 ms at four (benchmarks/README.md, "Timing
learned heads over many batches"). Each call's bound is its
own screen's: :class:`~vllm_csv.screens.ScreenOut` carries its radius and coefficients. The
certificate of rows drawn in vLLM's sampler asks for the ``tight`` (large-batch) copy at every
batch size: it compares the bounds of many tokens (the draw's contenders, top-k's and top-p's
decisions), where int4's width costs more than its bytes save. On a
head of ``151936 x 1024`` (random weights, peaked hidden states: one or two tokens scored) the
int4 step took 2.8 against 5.0 ms at one row; on small heads the two are even
(:data:`MIN_WEIGHTS`). On AVX2 CPUs both screens run AVX2 kernels; measured as AVX2 code on a
Zen 4 core, the int4 step wins at one row with two threads and loses with one, so ``auto``
keeps the int8 screen alone there (:func:`small_screen_pays`; docs/kernels.md).
"""

from __future__ import annotations

import torch

SMALL_BATCH = 1  # rows at most for the small-batch screen
MIN_WEIGHTS = 2**25  # heads of fewer weights keep one screen: at 32768 x 512 (2^24) the int4 step
# measured no faster than the int8 one (0.27 against 0.28 ms at one row), where the GEMM is small


def small_screen_pays(backend: str | None, threads: int) -> bool:
    """Whether ``auto``'s one-row int4 screen beats the int8 one its large batches use, from the
    int8 screen's ``backend`` and the intra-op ``threads`` the kernels get (vLLM's CPU worker
    binds one thread a core it owns: one on a 2-core VM). Not on the AVX2 kernels at one thread:
    the demo head (V 65536, d 768, bf16, one row of held-out hidden states, ``benchmarks/lm_head.py
    --screens int8 int4 --batches 1``, at ``8d6d517`` on a Zen 4 core, AVX2 code under
    ``VLLM_CSV_CPU_ISA=avx2`` and the emulation's other variables) took 1.59 ms with int8 against
    1.97 with int4 at one thread (1.93 / 1.98 and 1.75 / 1.99 in two earlier runs), 1.33 against
    0.94 at two threads; the VNNI kernels at one thread: 1.20 against 1.08. The int4 kernel's
    nibble unpacking and group sums cost AVX2 more multiplies a byte than VNNI, which one core
    does not hide behind the halved bytes. (AVX2 code on an AVX-512 core: a real AVX2 CPU may
    differ; issue 45.)"""
    return not (backend == "avx2" and threads <= 1)


class ByBatchScreen:
    """``small`` for batches of at most ``max_small`` rows, ``large`` for the others; both
    two-sided screens of the same head that understand ``defer_row_scale``."""

    two_sided = True
    defers_row_scale = True

    def __init__(self, large, small, max_small: int = SMALL_BATCH):
        self.large, self.small, self.max_small = large, small, max_small
        self.name = f"{large.name}+{small.name}"
        self.backend = getattr(large, "backend", None)
        self.radius = large.radius
        self.tight = large  # what callers that need the tighter bound at any batch size take
        self.extra_bytes = getattr(large, "extra_bytes", 0) + getattr(small, "extra_bytes", 0)

    def for_batch(self, rows: int):
        """The screen a batch of ``rows`` rows takes."""
        return self.small if rows <= self.max_small else self.large

    def center_radius(self, h: torch.Tensor, defer_row_scale: bool = False):
        return self.for_batch(h.shape[0]).center_radius(h, defer_row_scale=defer_row_scale)
