"""What every certificate loop shares (:mod:`.rounds`, :mod:`.rows_v2`, :mod:`.sharded_rows`):
the screen's bounds, exact scoring of chosen columns within a budget, and the loop's result.

A loop starts from the screen's bounds of every token (:func:`screen_bounds`) and an empty state
(:func:`empty_state`: nothing scored), or from another loop's (:class:`Screened`), scores the columns its certificate asks for
(:func:`next_columns` picks those that fit the budget, :attr:`.HeadAdapter.budget_columns`; :func:`score_columns`
scores them, the bounds only tightening), and ends with a :class:`RowsResult` (:func:`reasons`:
why a row was not certified).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..ops.bools import any_
from ..vocabulary import reason_of
from .head_adapter import HeadAdapter

MAX_ROUNDS = 4
FIRST_GUESS = 8  # one-sided screens (no lower bounds): score the 8 highest upper bounds first


@dataclass
class RowsResult:
    """A loop's result for its ``R`` rows (``S``: the columns scored)."""

    values: torch.Tensor  # [R, V] model dtype: exact on S, -inf elsewhere and on masked tokens
    certified: torch.Tensor  # [R] bool
    winner: torch.Tensor  # [R] int64, the certified token (meaningful where certified)
    reason: list[str | None]  # None if certified, else "uncertified" / "budget" / "nonfinite"
    scored: int  # |S| (shared by the rows)


@dataclass
class Screened:
    """Rows' bounds and scored set as a loop left them, for a loop that goes on from there instead
    of screening and scoring the rows again (:mod:`.verify_v2`'s draws start from its acceptance
    rounds'): ``lo, hi [R, V]`` float32 (tightened where scored), ``hnorm``, ``finite [R]``
    bool, ``one_sided`` (as :func:`screen_bounds` gives them), ``values [R, V]`` in the model
    dtype, exact on the columns ``scored [V]`` bool, ``-inf`` elsewhere."""

    lo: torch.Tensor
    hi: torch.Tensor
    hnorm: torch.Tensor
    finite: torch.Tensor
    one_sided: bool
    values: torch.Tensor
    scored: torch.Tensor

    def rows(self, idx: torch.Tensor) -> Screened:
        """The state of rows ``idx`` alone, copied (a loop tightens and fills its state in place)."""
        return Screened(self.lo[idx], self.hi[idx], self.hnorm[idx], self.finite[idx], self.one_sided,
                        self.values[idx], self.scored.clone())


# (lo, hi, rows) -> (ylo, yhi): a map from the head's values to the draw's inputs (certify_rows' process)
Process = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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


def score_columns(adapter: HeadAdapter, hidden: torch.Tensor, hnorm: torch.Tensor, ids: torch.Tensor,
                  values: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scored: torch.Tensor,
                  masked: torch.Tensor | None = None) -> None:
    """Score the columns ``ids`` exactly, in place: their values into ``values``, their bounds
    into ``lo, hi`` (both bounds hold: the tighter is kept, so bounds only tighten, which
    :func:`~.certificate.ruled_out` relies on), and mark them ``scored``. The tokens of
    ``masked`` (``[R, V]`` bool, set to ``-inf`` upstream: the grammar bitmask) keep ``-inf``
    bounds (the exact score of a token the grammar removed is not what the sampler sees)."""
    v, lower, upper = adapter.score(hidden, ids, hnorm)
    values[:, ids] = v
    lo[:, ids] = torch.maximum(lo[:, ids], lower)
    hi[:, ids] = torch.minimum(hi[:, ids], upper)
    if masked is not None:
        m = masked[:, ids]
        lo[:, ids] = lo[:, ids].masked_fill(m, -math.inf)
        hi[:, ids] = hi[:, ids].masked_fill(m, -math.inf)
    scored[ids] = True


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


def empty_state(adapter: HeadAdapter, R: int, dev: torch.device):
    """A loop's start: ``values [R, V]`` all ``-inf`` (model dtype), nothing scored (``[V]``
    bool), and per row not certified, winner 0, not over budget (the budget is the caller's:
    :attr:`.HeadAdapter.budget_columns`, or a share of it)."""
    V = adapter.vocab_size
    return (torch.full((R, V), -math.inf, dtype=adapter.dtype, device=dev), torch.zeros(V, dtype=torch.bool, device=dev),
            torch.zeros(R, dtype=torch.bool, device=dev),
            torch.zeros(R, dtype=torch.long, device=dev), torch.zeros(R, dtype=torch.bool, device=dev))


def reasons(certified: torch.Tensor, finite: torch.Tensor, over_budget: torch.Tensor) -> list[str | None]:
    """Per row: None if certified, else why not (``nonfinite``, ``budget``, ``uncertified``)."""
    return [reason_of(c, f, b) for c, f, b in zip(certified.tolist(), finite.tolist(), over_budget.tolist())]


def contended(contenders: torch.Tensor, rows: torch.Tensor | None, span: torch.Tensor | None) -> torch.Tensor:
    """``[V]`` bool: the tokens that are contenders in some row of ``rows`` (``[R]`` bool; None:
    all), reading only the columns ``span`` where given (the others hold no contender)."""
    if span is None:
        return any_(contenders if rows is None or bool(rows.all()) else contenders[rows], 0)
    out = torch.zeros(contenders.shape[1], dtype=torch.bool, device=contenders.device)
    sub = contenders[:, span]
    out[span] = any_(sub if rows is None else sub[rows], 0)
    return out
