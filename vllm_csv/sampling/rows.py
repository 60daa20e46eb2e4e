"""Certify a batch of rows for vLLM's draw: grow the scored set until the draw is decided.

Pipeline (per batch of rows that the sampler will draw from):

1. bounds on every token's sampler input from the head's screen (:class:`.HeadAdapter`);
2. ``process``: the caller's map from head values to the draw's inputs (vLLM's own logits
   processors, penalties and temperature, run on the bounds; every step is monotone
   non-decreasing per token, so bounds map to bounds);
3. :func:`~.certificate.certify_draw` (packed: :func:`~.certificate.certify_draw_packed`); the
   contenders not yet scored are scored exactly
   (their bounds shrink to the rounding interval of the dense value, intersected with the
   screen's) and 2-3 repeat, until every row is decided, nothing is left to score, or the
   budget is spent. When ``process`` is per token (``elementwise``), the rounds after the first
   certify on the first round's contenders only, the tokens it ruled out kept as one summary
   per row (:func:`~.certificate.ruled_out`): no second pass over the vocabulary.

A row certified in a round stays certified: its proof used valid bounds, and later rounds only
score more tokens, whose exact values it already beat.

A certified row is handed to the sampler as exact values on the scored set ``S`` and
``-inf`` elsewhere (and on tokens ``process`` rules out): the sampler then runs vLLM's
unchanged code on it. Every finite value of the row lies within its token's bounds and was
beaten by the winner, so the row's draw returns the certified winner too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .certificate import DrawCertificate, certify_draw, certify_draw_packed, ruled_out
from .outside import Outside
from .head_adapter import HeadAdapter

MAX_ROUNDS = 4
FIRST_GUESS = 8  # one-sided screens (no lower bounds): score the 8 highest upper bounds first


@dataclass
class RowsResult:
    values: torch.Tensor  # [R, V] model dtype: exact on S, -inf elsewhere and on masked tokens
    certified: torch.Tensor  # [R] bool
    winner: torch.Tensor  # [R] int64, the certified token (meaningful where certified)
    reason: list[str | None]  # None if certified, else "uncertified" / "budget" / "nonfinite"
    scored: int  # |S| (shared by the rows)


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


def certify_rows(adapter: HeadAdapter, hidden: torch.Tensor, process: Process, seeds: torch.Tensor,
                 greedy: torch.Tensor, masked: torch.Tensor | None = None,
                 elementwise: bool = False) -> RowsResult:
    """Certify the draw of each row of ``hidden [R, d]``.

    Parameters
    ----------
    adapter : HeadAdapter
    hidden : torch.Tensor
        ``[R, d]`` model dtype, the rows' final hidden states.
    process : callable
        ``(lo, hi) -> (ylo, yhi)``, all ``[R, V]`` float32: maps bounds on the head's values
        to bounds on the draw's inputs (monotone per token).
    seeds : torch.Tensor
        ``[R]`` int64, the seeds the sampler will draw with (ignored for greedy rows).
    greedy : torch.Tensor
        ``[R]`` bool.
    masked : torch.Tensor, optional
        ``[R, V]`` bool, tokens already set to ``-inf`` upstream (grammar bitmask).
    elementwise : bool
        ``process`` maps each token's bounds on their own (no min-p, top-k, top-p): later
        rounds then certify on the first round's contenders only (module docstring).
    """
    R, V = hidden.shape[0], adapter.vocab_size
    dev = hidden.device
    lo, hi, hnorm, finite = adapter.intervals(hidden)
    one_sided = lo is None
    if one_sided:
        lo = torch.full_like(hi, -math.inf)
    if masked is not None:
        lo.masked_fill_(masked, -math.inf)
        hi.masked_fill_(masked, -math.inf)
    values = torch.full((R, V), -math.inf, dtype=adapter.dtype, device=dev)
    scored = torch.zeros(V, dtype=torch.bool, device=dev)
    budget = max(1, math.ceil(adapter.budget * V))
    certified = torch.zeros(R, dtype=torch.bool, device=dev)
    winner = torch.zeros(R, dtype=torch.long, device=dev)
    over_budget = torch.zeros(R, dtype=torch.bool, device=dev)

    def add(ids: torch.Tensor) -> None:
        v, lower, upper = adapter.score(hidden, ids, hnorm)
        values[:, ids] = v
        # both bounds hold: keep the tighter (bounds only tighten, which ruled_out relies on)
        lo[:, ids] = torch.maximum(lo[:, ids], lower)
        hi[:, ids] = torch.minimum(hi[:, ids], upper)
        if masked is not None:
            m = masked[:, ids]
            lo[:, ids] = lo[:, ids].masked_fill(m, -math.inf)
            hi[:, ids] = hi[:, ids].masked_fill(m, -math.inf)
        scored[ids] = True

    if one_sided and bool(finite.any()):
        add(hi[finite].topk(min(FIRST_GUESS, V), dim=1).indices.unique())
    narrow = None  # (columns, ruled-out summaries): the rounds after the first, elementwise
    for rnd in range(MAX_ROUNDS + 1):
        ylo, yhi = process(lo, hi)
        if narrow is None:
            cert = certify_draw_packed(ylo, yhi, seeds, greedy)
        else:
            cert = _certify_columns(ylo, yhi, seeds, greedy, *narrow)
        now = cert.certified & finite & scored[cert.winner] & ~certified
        winner = torch.where(now, cert.winner, winner)
        certified |= now
        span = None if narrow is None else narrow[0]  # contenders lie in these columns only
        open_rows = finite & ~certified & ~over_budget
        need = _contended(cert.contenders, open_rows, span)
        if rnd == 0 and elementwise and bool((cert.finite | ~finite).all()):
            every = need if bool(open_rows.all()) else _contended(cert.contenders, None, None)
            cols = every.nonzero().squeeze(1)
            narrow = (cols, ruled_out(cert, greedy)) if cols.numel() else None
        need &= ~scored
        # rows where no token is certainly kept yet (e.g. min-p / top-p undecided on screen
        # bounds): score their highest upper bounds first
        blind = open_rows & ~cert.finite
        if bool(blind.any()):  # (the full pass only when some row may be blind)
            blind &= (yhi > -math.inf).any(1)
        if bool(blind.any()):
            top = yhi[blind].topk(min(FIRST_GUESS, V), dim=1)
            need[top.indices[top.values > -math.inf]] = True
            need &= ~scored
            cert.contenders[blind] = False
            cert.contenders[blind.nonzero().squeeze(1)[:, None], top.indices] = top.values > -math.inf
            span = None  # (contenders outside the narrow columns now)
        if not bool(need.any()):
            break
        if rnd == MAX_ROUNDS:
            break
        new = need.nonzero().squeeze(1)
        room = budget - int(scored.sum())
        if new.numel() > room:
            # Not every open row fits: rows whose own contenders cannot fit go dense; of the
            # rest, those with the fewest contenders are served first (the sum of their
            # counts bounds the union), the others wait for the next round.
            take, over_budget = within_budget((cert.contenders & ~scored[None]).sum(1), open_rows,
                                              over_budget, room)
            if take.numel() == 0:
                over_budget |= open_rows
                break
            new = (cert.contenders[take].any(0) & ~scored).nonzero().squeeze(1)
        add(new)
    # values are -inf outside S: only its columns are masked
    s_idx = scored.nonzero().squeeze(1)
    v = values[:, s_idx]
    if masked is not None:
        v.masked_fill_(masked[:, s_idx], -math.inf)
    # A token whose upper bound after ``process`` is -inf (masked, or certainly dropped by
    # min-p / top-p) was never compared with the winner: it must not compete on the row the
    # sampler gets either (the sampler may not drop it again: top-p is not re-applied to a
    # certified row, and min-p on a partial row keeps at least what it keeps on the full row).
    values[:, s_idx] = v.masked_fill_(yhi[:, s_idx] == -math.inf, -math.inf)
    open_rows = finite & ~certified & ~over_budget
    cont, unscored = (cert.contenders, ~scored) if span is None else (cert.contenders[:, span], ~scored[span])
    over_budget |= open_rows & (cont & unscored[None]).any(1)  # still waiting for room
    reason = [None if c else ("nonfinite" if not f else ("budget" if b else "uncertified"))
              for c, f, b in zip(certified.tolist(), finite.tolist(), over_budget.tolist())]
    return RowsResult(values, certified, winner, reason, int(scored.sum()))


def _contended(contenders: torch.Tensor, rows: torch.Tensor | None, span: torch.Tensor | None) -> torch.Tensor:
    """``[V]`` bool: the tokens that are contenders in some row of ``rows`` (``[R]`` bool; None:
    all), reading only the columns ``span`` where given (the others hold no contender)."""
    if span is None:
        return (contenders if rows is None or bool(rows.all()) else contenders[rows]).any(0)
    out = torch.zeros(contenders.shape[1], dtype=torch.bool, device=contenders.device)
    sub = contenders[:, span]
    out[span] = (sub if rows is None else sub[rows]).any(0)
    return out


def _certify_columns(ylo: torch.Tensor, yhi: torch.Tensor, seeds: torch.Tensor, greedy: torch.Tensor,
                     cols: torch.Tensor, rest: Outside) -> DrawCertificate:
    """:func:`~.certificate.certify_draw` on the columns ``cols`` (``[n]`` int64, ascending: ties
    still go to the lowest token id) of ``ylo, yhi`` (``[R, V]``), every other token in ``rest``;
    the result in full-vocabulary coordinates."""
    R, V = ylo.shape
    cert = certify_draw(ylo[:, cols], yhi[:, cols], seeds, greedy, cols.expand(R, -1), rest)
    contenders = torch.zeros((R, V), dtype=torch.bool, device=ylo.device)
    contenders[:, cols] = cert.contenders
    winner = cols[cert.winner] if cols.numel() else cert.winner
    return DrawCertificate(winner, cert.certified, contenders, cert.finite, cert.bar, cert.absmax, cert.hmax)
