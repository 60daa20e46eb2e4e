"""A block of tokens known only through per-row summaries (tensor parallelism).

Under tensor parallelism each rank bounds only its shard's tokens. The rows' certificate is
decided on every rank from the same gathered numbers (:mod:`.sharded_rows`): a few tokens per
rank and row are sent one by one (*explicit* tokens), every other token of the vocabulary is
in the row's *outside block*, known only through the summaries below. The draw's
certificate (:func:`~.certificate.certify_draw`) and the min-p / top-p bounds
(:mod:`.nucleus`) take the block as one more argument; without it they are the single-rank
functions, unchanged.

What the summaries promise, for every token ``j`` of the block and the draw's input ``y_j``
(after vLLM's logits processors and the temperature, before min-p / top-p), with ``ylo_j <= y_j
<= yhi_j`` its rank's bounds:

* ``hi``: ``yhi_j <= hi`` (``-inf``: an empty block);
* ``noisy``: ``fl64(yhi_j + g_j) <= noisy`` (``g_j`` the token's Gumbel noise, computed as
  :func:`~.gumbel.noise_of_bits` does: so within ``delta / 16`` of the real ``yhi_j + g_j``,
  as in the certificate's own proof);
* ``lel``, ``leh``: ``lel <= log sum_j e^{ylo_j}`` and ``log sum_j e^{yhi_j} <= leh`` (the
  block's lower and upper softmax masses, as logs: no overflow);
* ``absmax``: ``max(|ylo_j|, |yhi_j|) <= absmax`` over the block's tokens with ``yhi_j > -inf``
  (``inf`` if one of them has ``ylo_j = -inf``: then nothing is dropped by min-p, nor
  certified by the Gumbel certificate).

A summary that is larger (``hi``, ``noisy``, ``leh``, ``absmax``) or smaller (``lel``) than
the truth keeps every decision sound; only certification gets rarer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Outside:
    """Per-row summaries ``[R]`` of the outside block (module docstring); float64."""

    hi: torch.Tensor
    noisy: torch.Tensor
    lel: torch.Tensor
    leh: torch.Tensor
    absmax: torch.Tensor

    @classmethod
    def empty(cls, rows: int, device=None) -> Outside:
        f = torch.full((rows,), -math.inf, dtype=torch.float64, device=device)
        return cls(f, f.clone(), f.clone(), f.clone(), torch.zeros(rows, dtype=torch.float64, device=device))

    def rows(self, idx: torch.Tensor) -> Outside:
        return Outside(*(getattr(self, f)[idx] for f in ("hi", "noisy", "lel", "leh", "absmax")))

    def put(self, idx: torch.Tensor, other: Outside) -> Outside:
        out = Outside(*(getattr(self, f).clone() for f in ("hi", "noisy", "lel", "leh", "absmax")))
        for f in ("hi", "noisy", "lel", "leh", "absmax"):
            getattr(out, f)[idx] = getattr(other, f)
        return out

    def drop(self, rows: torch.Tensor) -> Outside:
        """The block of ``rows`` (``[R]`` bool) certainly dropped (min-p / top-p): emptied."""
        e = Outside.empty(rows.shape[0], rows.device)
        return Outside(*(torch.where(rows, getattr(e, f), getattr(self, f))
                         for f in ("hi", "noisy", "lel", "leh", "absmax")))

    def usable(self) -> torch.Tensor:
        """``[R]`` bool: no ``+inf`` / NaN upper summaries (else the row is not certified)."""
        return (self.hi < math.inf) & ~torch.isnan(self.hi) & ~torch.isnan(self.noisy) & \
            ~torch.isnan(self.leh) & ~torch.isnan(self.lel) & ~torch.isnan(self.absmax)
