"""Norms that bound a low-precision copy of the head: the bound of every copy screen."""

from __future__ import annotations

from collections.abc import Callable

import torch


def row_norms(weight: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """``||w_i||`` in float64, chunked like :func:`copy_error_norms` (no float64 copy of all of
    ``W`` at once)."""
    return torch.cat([weight[a : a + chunk].double().norm(dim=1) for a in range(0, weight.shape[0], chunk)])


def copy_error_norms(weight: torch.Tensor, copy_rows: Callable[[int, int], torch.Tensor],
                     chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """``r_i = ||w_i - c_i||`` and ``n_i = ||c_i||`` in float64, for the copy whose rows
    ``a:b`` ``copy_rows(a, b)`` returns exactly in float64; chunked, so that no float64
    copy of all of ``W`` exists at once."""
    V = weight.shape[0]
    r = torch.empty(V, dtype=torch.float64, device=weight.device)
    n = torch.empty_like(r)
    for a in range(0, V, chunk):
        c = copy_rows(a, a + chunk)
        r[a : a + chunk] = (weight[a : a + chunk].double() - c).norm(dim=1)
        n[a : a + chunk] = c.norm(dim=1)
    return r, n
