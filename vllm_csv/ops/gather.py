"""Row gathers and scatters without torch's slow CPU indexing.

On torch 2.13's CPU build ``x[rows]`` of a float ``[32, 65536]`` tensor takes about 6x as long as
``x.index_select(0, rows)`` (0.56 against 0.085 ms, 2 threads, measured 2026-11-26).
"""

from __future__ import annotations

import torch


def rows_of(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[rows]`` (``rows`` ``[r]`` int64, ascending, distinct), without the copy when it is every
    row of ``x``."""
    return x if rows.numel() == x.shape[0] else x.index_select(0, rows)


def put_rows(x: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with its rows ``rows`` (as :func:`rows_of`) replaced by ``new``; ``new``
    itself when ``rows`` is every row of ``x``."""
    return new if rows.numel() == x.shape[0] else x.index_copy(0, rows, new)
