"""Blocks of tokens known only through per-row summaries (tensor parallelism).

Under tensor parallelism each rank bounds only its shard's tokens. The rows' certificate is
decided on every rank from the same gathered numbers (:mod:`.sharded_rows`): a few tokens per
rank and row are sent one by one (*explicit* tokens), every other token of the vocabulary is
in one of the row's *outside blocks* (each rank splits its other tokens into a few blocks by
the level of their upper bound), known only through the summaries below. The draw's
certificate (:func:`~.certificate.certify_draw`) and the min-p / top-p bounds
(:mod:`.nucleus`) take the blocks as one more argument; without it they are the single-rank
functions, unchanged.

What the summaries of block ``l`` promise, for every token ``j`` of the block and the draw's
input ``y_j`` (after vLLM's logits processors and the temperature, before min-p / top-p), with
``ylo_j <= y_j <= yhi_j`` its rank's bounds:

* ``hi[:, l]``: ``yhi_j <= hi`` (``-inf``: an empty block);
* ``noisy[:, l]``: ``fl64(yhi_j + g_j) <= noisy`` (``g_j`` the token's Gumbel noise, computed as
  :func:`~.gumbel.noise_of_bits` does: so within ``delta / 16`` of the real ``yhi_j + g_j``,
  as in the certificate's own proof; ``-inf`` on greedy rows, which do not read it);
* ``lel[:, l]``, ``leh[:, l]``: ``lel <= log sum_j e^{ylo_j}`` and ``log sum_j e^{yhi_j} <= leh``
  (the block's lower and upper softmax masses, as logs: no overflow);
* ``absmax[:, l]``: ``max(|ylo_j|, |yhi_j|) <= absmax`` over the block's tokens (``inf`` if one
  of them has ``ylo_j = -inf``: then the block is never dropped by min-p, and a sampled row
  is not certified);
* ``lo[:, l]``: ``lo <= ylo_j`` (the block's smallest lower bound; ``+inf`` for an empty
  block): top-p places the whole block after a token ``i`` when ``lo > yhi_i``.

A summary that is larger (``hi``, ``noisy``, ``leh``, ``absmax``) or smaller (``lel``, ``lo``)
than the truth keeps every decision sound; only certification gets rarer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch


@dataclass
class Outside:
    """Per-row, per-block summaries ``[R, L]`` (module docstring); float64."""

    hi: torch.Tensor
    noisy: torch.Tensor
    lel: torch.Tensor
    leh: torch.Tensor
    absmax: torch.Tensor
    lo: torch.Tensor

    def _map(self, fn) -> Outside:
        return Outside(*(fn(f.name, getattr(self, f.name)) for f in fields(self)))

    def rows(self, idx: torch.Tensor) -> Outside:
        return self._map(lambda _, t: t[idx])

    def put(self, idx: torch.Tensor, other: Outside) -> Outside:
        def one(name, t):
            t = t.clone()
            t[idx] = getattr(other, name)
            return t
        return self._map(one)

    def drop(self, blocks: torch.Tensor) -> Outside:
        """The blocks ``blocks`` (``[R, L]`` bool) certainly dropped (min-p / top-p): emptied."""
        empty = {"absmax": 0.0, "lo": math.inf}
        return self._map(lambda name, t: t.masked_fill(blocks, empty.get(name, -math.inf)))

    def forget_lower(self, blocks: torch.Tensor) -> Outside:
        """The blocks ``blocks`` (``[R, L]`` bool) may have lost tokens to min-p (each such token's
        ``ylo`` is then ``-inf``): their lower mass is only known to be ``>= 0`` and their
        smallest lower bound ``>= -inf``."""
        return self._map(lambda name, t: t.masked_fill(blocks, -math.inf) if name in ("lel", "lo") else t)

    def max_hi(self) -> torch.Tensor:
        """``[R]``: every block token's ``yhi`` is at most this."""
        return self.hi.amax(1)

    def usable(self) -> torch.Tensor:
        """``[R]`` bool: no ``+inf`` / NaN upper summaries (else the row is not certified)."""
        every = torch.cat([self.hi, self.noisy, self.lel, self.leh, self.absmax, self.lo], 1)  # (one pass, not six)
        return ~(torch.isnan(every).any(1) | (self.hi == math.inf).any(1))
