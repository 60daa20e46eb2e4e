"""Synthetic LM heads and the hidden states that go with them: heads whose logits have a clear
winner for hidden states built from their rows (as a learned head's do), and rows of logits
shaped like a learned head's after temperature."""

from __future__ import annotations

import torch


def peaked_head(V: int, d: int, seed: int = 0, dtype=torch.float32):
    """A head whose logits have a clear winner for hidden states built from its rows
    (like a learned head): h = a * w_t + noise, so token t tends to be the top-1.

    Returns
    -------
    (W, g)
        ``W`` ``[V, d]`` in ``dtype``; ``g`` the ``torch.Generator`` it was drawn from (seeded
        with ``seed``), to draw the hidden states on (:func:`hidden_near_rows`).
    """
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, d, generator=g) / d**0.5
    return W.to(dtype), g


def peaked_rows(seed, R=48, V=8192):
    """``(y, g)``: rows shaped like a learned head's after temperature, a few leading tokens over
    a long tail, with exact ties (columns 0-4 equal to 5-9); ``g`` the generator, to draw on."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(R, V, generator=g) * 2
    lead = torch.randint(0, V, (R, 8), generator=g)
    y.scatter_(1, lead, torch.rand(R, 8, generator=g) * 12 + 4)
    y[:, :5] = y[:, 5:10]  # exact ties
    return y, g


def hidden_near_rows(W: torch.Tensor, B: int, g, scale: float = 6.0, noise: float = 0.3):
    """``B`` hidden states ``scale * sqrt(d) * w_t + noise * N(0, 1)``, ``t`` drawn uniformly from
    ``W``'s rows with ``g``: each row's own token tends to be its top-1. Computed in fp32, returned
    in ``W``'s dtype."""
    t = torch.randint(0, W.shape[0], (B,), generator=g)
    h = scale * W[t].float() * W.shape[1] ** 0.5 + noise * torch.randn(B, W.shape[1], generator=g)
    return h.to(W.dtype)
