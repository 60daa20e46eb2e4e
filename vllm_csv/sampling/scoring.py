"""What every certificate loop shares (:mod:`.rounds`, :mod:`.rows_v2`, :mod:`.sharded_rows`,
:mod:`.verify_v2`): the screen's bounds and which columns to score next within the budget.

A loop starts from the screen's bounds of every token and nothing scored (:func:`screen`, a
:class:`~.types.Screened`), or from another loop's state, asks for the columns its certificate
needs (:func:`next_columns` picks those that fit the budget, :attr:`.HeadAdapter.budget_columns`),
has them scored (:meth:`.HeadAdapter.score_columns`: the bounds only tighten), and ends with a
:class:`~.types.RowsResult` (:func:`vllm_csv.vocabulary.reasons`: why a row was not certified).
"""

from __future__ import annotations

import math

import torch

from ..ops.bools import any_
from .head_adapter import HeadAdapter
from .types import Screened

MAX_ROUNDS = 4
FIRST_GUESS = 8  # one-sided screens (no lower bounds): score the 8 highest upper bounds first


def within_budget(own: torch.Tensor, open_rows: torch.Tensor, over_budget: torch.Tensor,
                  room: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which open rows get their contenders scored this round, ``room`` tokens at most.

    Parameters
    ----------
    own : torch.Tensor
        ``[R]`` int64, each row's contenders not yet scored.
    open_rows, over_budget : torch.Tensor
        ``[R]`` bool: rows still undecided; rows already past the budget.
    room : int
        Tokens that may still be scored.

    Returns
    -------
    (take, over_budget): ``take`` the indices of the rows served, fewest contenders first while
    the sum of their counts (a bound on the union) fits; ``over_budget`` plus the open rows
    whose own contenders alone do not fit.
    """
    over_budget = over_budget | (open_rows & (own > room))
    idx = (open_rows & ~over_budget).nonzero().squeeze(1)
    order = own[idx].argsort()
    return idx[order[own[idx][order].cumsum(0) <= room]], over_budget


def next_columns(need: torch.Tensor, contenders: torch.Tensor, scored: torch.Tensor, open_rows: torch.Tensor,
                 over_budget: torch.Tensor, budget: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The columns to score this round and the rows over budget: ``need``'s columns where they
    fit in what is left of ``budget``; else not every open row fits: rows whose own contenders
    cannot fit go dense; of the rest, those with the fewest contenders are served first (the sum
    of their counts bounds the union), the others wait for the next round. ``None`` when no
    row fits (every open row is then over budget), and when the rows served have every
    contender scored already: they asked for other columns (a top-k / top-p row's focus,
    :func:`~.rounds._focus`) that do not fit, and every other open row is over budget, so a next round
    would score nothing and decide the same (its bounds unchanged): every open row is over
    budget."""
    new = need.nonzero().squeeze(1)
    room = budget - int(scored.sum())
    if new.numel() > room:
        take, over_budget = within_budget((contenders & ~scored[None]).sum(1), open_rows, over_budget, room)
        new = (any_(contenders[take], 0) & ~scored).nonzero().squeeze(1)  # (none when take is empty)
        if new.numel() == 0:
            return None, over_budget | open_rows
    return new, over_budget


def screen_bounds(adapter: HeadAdapter, hidden: torch.Tensor, masked: torch.Tensor | None = None):
    """``(lo, hi, hnorm, finite, one_sided)``: the screen's bounds of every token (``lo`` all
    ``-inf`` for a one-sided screen), as :meth:`.HeadAdapter.intervals` gives them; ``-inf`` on
    both sides for the tokens of ``masked`` (``[R, V]`` bool: the grammar bitmask's, which
    :func:`score_columns` keeps there)."""
    lo, hi, hnorm, finite = adapter.intervals(hidden)
    one_sided = lo is None
    if one_sided:
        lo = torch.full_like(hi, -math.inf)
    if masked is not None and masked.dim() == 2 and masked.stride(0) == 0:
        # the same tokens on every row (a model's suppressed tokens: fill.upstream_mask): their
        # columns, not a [R, V] masked_fill (a scalar loop on the CPU)
        cols = masked[0].nonzero().squeeze(1)
        lo.index_fill_(1, cols, -math.inf)
        hi.index_fill_(1, cols, -math.inf)
    elif masked is not None:
        lo.masked_fill_(masked, -math.inf)
        hi.masked_fill_(masked, -math.inf)
    return lo, hi, hnorm, finite, one_sided


def screen(adapter: HeadAdapter, hidden: torch.Tensor, masked: torch.Tensor | None = None) -> Screened:
    """A loop's start: the screen's bounds of every row (:func:`screen_bounds`), ``values [R, V]``
    all ``-inf`` (model dtype) and nothing scored (``[V]`` bool)."""
    lo, hi, hnorm, finite, one_sided = screen_bounds(adapter, hidden, masked)
    R, V = hi.shape
    return Screened(lo, hi, hnorm, finite, one_sided,
                    torch.full((R, V), -math.inf, dtype=adapter.dtype, device=hi.device),
                    torch.zeros(V, dtype=torch.bool, device=hi.device))
