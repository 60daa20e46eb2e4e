"""The tail bound of a screen over part of the hidden dimensions (``benchmarks/tail_bound.py``,
an analysis, not a screen of this package): multiply the first ``k`` of ``d`` dimensions, bound the
rest by Cauchy-Schwarz, ``|<w_tail, h_tail>| <= ||w_tail|| ||h_tail||``; a token survives when its
upper bound reaches the largest lower bound of its row."""

from __future__ import annotations

import torch


def surviving(h: torch.Tensor, W: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, V]`` bool: the tokens whose upper bound over the first ``k`` dimensions plus the tail's
    Cauchy-Schwarz term reaches the row's largest lower bound (the row's top token among them)."""
    head = h[:, :k] @ W[:, :k].T
    slack = h[:, k:].norm(dim=1, keepdim=True) * W[:, k:].norm(dim=1)[None]
    lb = (head - slack).max(dim=1, keepdim=True).values
    return (head + slack) >= lb


def survivors(h: torch.Tensor, W: torch.Tensor, k: int) -> float:
    """Median share of the vocabulary a row keeps (:func:`surviving`)."""
    return surviving(h, W, k).float().mean(dim=1).median().item()


def top_cosine(h: torch.Tensor, W: torch.Tensor) -> float:
    """Median cosine between a row's state and its top token's row of ``W``."""
    top = (h @ W.T).argmax(dim=1)
    return torch.nn.functional.cosine_similarity(h, W[top]).median().item()
