"""Certify a batch of rows for vLLM's draw: grow the scored set until the draw is decided.

Pipeline (per batch of rows that the sampler will draw from):

1. bounds on every token's sampler input from the head's screen (:class:`.HeadAdapter`);
2. ``process``: the caller's map from head values to the draw's inputs (vLLM's own logits
   processors, penalties and temperature, run on the bounds; every step is monotone
   non-decreasing per token, so bounds map to bounds), then vLLM's min-p, top-k and top-p on
   the bounds of the rows still open (:mod:`.nucleus`); top-p decided for the tokens the draw's
   certificate needs only (:class:`~.nucleus.top_p_queries.TopPQueries`: the likely winners, then the
   contenders that leaves), the others left undecided;
3. :func:`~.certificate.certify_draw` (packed: :func:`~.certificate.certify_draw_packed`); the
   contenders not yet scored (and the tokens of highest upper bound on rows with a top-k or a
   top-p, which decide what those certainly keep: :func:`~.rounds._focus_counts`) are scored exactly
   (their bounds shrink to the rounding interval of the dense value, intersected with the
   screen's) and 2-3 repeat, until every row is decided, nothing is left to score, or the
   budget is spent (:mod:`.rounds`). Top-p rows have their :data:`~.rounds.TOP_P_GUESS` highest
   upper bounds scored before the first round (a round of theirs costs far more than scoring a few tokens, and
   those are where the draw and the nucleus' mass usually are); top-k rows their
   :data:`~.top_k_rows.TOP_K_GUESS` ``(k + 1)``.
   When ``process`` is per token (``elementwise``), the rounds after the first round with no
   masks on the open rows certify on that round's contenders only, the tokens it ruled out kept
   as one summary per row (:func:`~.certificate.ruled_out`): no second pass over the
   vocabulary; with ``columns`` (a per-row map) they map those columns only.

Before the rounds, the rows with a top-k or a min-p (a top-p may follow; given ``columns``,
nothing masked) are certified on their highest upper bounds alone
(:mod:`.top_k_rows`: no ``[R, V]`` map, no rounds); the rounds take the rest, on the same
screen bounds, with what is left of the budget.

A certified row is handed to the sampler as exact values on the set ``S`` of columns scored
while it was open and ``-inf`` elsewhere (and on tokens ``process`` or the masks rule out in
its certifying round): the sampler then runs vLLM's unchanged code on it. Every finite value of
the row lies within its token's bounds and was beaten by the winner, so the row's draw returns
the certified winner too.
"""

from __future__ import annotations

import torch

from ..ops.gather import rows_of
from .head_adapter import HeadAdapter
from .nucleus.top_k import has_top_k
from .rounds import run_rounds
from .scoring import screen
from .top_k_rows import certify_top_k
from .types import Process, RowsResult


def certify_rows(adapter: HeadAdapter, hidden: torch.Tensor, process: Process, seeds: torch.Tensor,
                 greedy: torch.Tensor, masked: torch.Tensor | None = None,
                 elementwise: bool = False, *, min_p: torch.Tensor | None = None,
                 top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                 columns: Process | None = None) -> RowsResult:
    """Certify the draw of each row of ``hidden [R, d]``.

    Parameters
    ----------
    adapter : HeadAdapter
    hidden : torch.Tensor
        ``[R, d]`` model dtype, the rows' final hidden states.
    process : callable
        ``(lo, hi, rows) -> (ylo, yhi)``, all ``[n, V]`` float32: maps bounds on the head's values
        to bounds on the draw's inputs (monotone per token), for the rows ``rows`` (``[n]`` int64,
        ascending indices into the ``R`` rows; None: all of them, in order).
    seeds : torch.Tensor
        ``[R]`` int64, the seeds the sampler will draw with (ignored for greedy rows).
    greedy : torch.Tensor
        ``[R]`` bool.
    masked : torch.Tensor, optional
        ``[R, V]`` bool, tokens already set to ``-inf`` upstream (grammar bitmask).
    elementwise : bool
        ``process`` maps each token's bounds on their own: once the open rows have no min-p,
        top-k or top-p, the rounds after a round over every column certify on its contenders
        only (module docstring).
    min_p, top_k, top_p : torch.Tensor, optional
        ``[R]`` each (float32, int64, float32; ``0``, ``k <= 0`` or ``k >= V``, ``1``: off), vLLM's
        masks, applied after ``process`` in vLLM's order (:mod:`.nucleus`) on the rows still
        open only: a row certified in a round keeps that round's winner, and its output is
        masked with that round's drops (the proof compared the winner with every other token).
        The masks also choose tokens to score (never the proof): the winner must be certainly
        kept, and what decides that is not only the draw's contenders. With a top-k, each open
        row's ``k + 1`` highest upper bounds are scored (top-k compares the winner with the
        ``k``-th largest upper bound of the others, :func:`~.nucleus.top_k.top_k_bounds`); with a
        top-p, an open row whose contenders are all scored has its ``V / 32`` highest upper
        bounds scored (within :data:`~.rounds.TOP_P_FOCUS`), 4x more each such round (top-p compares
        masses, and the loosest are those of the tokens of highest upper bound, dropped ones
        included: a screen's ``e^hi`` may be several times ``e^y``).
    columns : callable, optional
        ``process`` on some columns only (``[n, c]`` bounds of any ``c`` columns, the same map
        on each, and ``rows`` as for ``process``): given where each token's map depends on its
        row alone (vLLM's temperature with no logits processor acting). With ``elementwise`` and
        no masks, the later rounds then map the contenders' columns only, not ``[n, V]`` twice.

    Returns
    -------
    RowsResult
        A certified row's values are exact on the columns scored while it was open, ``-inf``
        elsewhere.

    Rows with a top-k or a min-p (a top-p may follow), where ``columns`` is given and nothing
    is ``masked``, are first certified from their highest upper bounds alone
    (:func:`~.top_k_rows.certify_top_k`: no rounds); the others, and those it leaves open, go
    through the rounds, on the same screen bounds, with what is left of the budget.

    Each round runs on the rows still open only: a row leaves the loop in the round that
    certifies it (or puts it over budget), its output finished then (:func:`~.rounds._finish_rows`), and
    columns scored later are scored for the open rows only (a certified row needs no more: its
    proof already compared its winner with every token, scored or not).
    """
    start = screen(adapter, hidden, masked)
    R, V = hidden.shape[0], adapter.vocab_size
    budget = adapter.budget_columns
    quick = None
    if columns is not None and masked is None and (top_k is not None or min_p is not None):
        tk = top_k if top_k is not None else torch.full((R,), V, dtype=torch.long, device=hidden.device)
        with_k = has_top_k(tk, V)
        # (a min-p row without a top-k needs the screen's lower bounds: min-p must drop its others)
        quick = start.finite & ~greedy & (with_k if min_p is None or start.one_sided else with_k | (min_p > 0))
        # each top-k row's k + 1 within its share of the budget (a row with a large k, e.g. V - 1,
        # goes through the rounds; certify_top_k keeps each list within the share)
        quick &= torch.where(with_k, tk + 1, 1) * int(quick.sum()) <= budget
    fast = None
    if quick is not None and bool(quick.any()):
        q = quick.nonzero().squeeze(1)
        every = q.numel() == R
        mp = None if min_p is None or not bool((min_p[q] > 0).any()) else min_p[q]
        fast = certify_top_k(adapter, rows_of(hidden, q), rows_of(start.hnorm, q), rows_of(start.hi, q), tk[q],
                             seeds[q], columns, None if every else q, budget, top_p=None if top_p is None else top_p[q],
                             min_p=mp, lo_min=None if mp is None else rows_of(start.lo, q).amin(1))
    if fast is None:
        return run_rounds(adapter, hidden, start, process, seeds, greedy, masked, elementwise, min_p, top_k, top_p,
                          columns, budget)
    if every and bool(fast.certified.all()):
        return RowsResult(fast.values, fast.certified, fast.winner, [None] * R, fast.scored)
    done = torch.zeros(R, dtype=torch.bool, device=hidden.device).index_put_((q,), fast.certified)
    rest = (~done).nonzero().squeeze(1)
    sub = run_rounds(adapter, rows_of(hidden, rest), start if rest.numel() == R else start.rows(rest),
                     _on_rows(process, rest, R), seeds[rest], greedy[rest], None, elementwise,
                     *(None if t is None else t[rest] for t in (min_p, top_k, top_p)), _on_rows(columns, rest, R),
                     max(1, budget - fast.scored))
    if every:
        values = fast.values
    else:
        values = torch.empty((R, V), dtype=fast.values.dtype, device=hidden.device).index_copy_(0, q, fast.values)
    values.index_copy_(0, rest, sub.values)
    certified = done.index_put_((rest,), sub.certified)
    winner = torch.zeros(R, dtype=torch.long, device=hidden.device).index_put_((q,), fast.winner)
    winner.index_put_((rest,), sub.winner)
    reason: list[str | None] = [None] * R
    for r, why in zip(rest.tolist(), sub.reason):
        reason[r] = why
    # (scored: the two sets' sizes added; they may overlap)
    return RowsResult(values, certified, winner, reason, fast.scored + sub.scored)


def _on_rows(f: Process | None, sub: torch.Tensor, R: int) -> Process | None:
    """``f`` (``process`` or ``columns``, whose ``rows`` index the caller's ``R`` rows) for a loop
    over the rows ``sub`` only (ascending), whose own ``rows`` index those."""
    if f is None or sub.numel() == R:
        return f
    return lambda lo, hi, rows=None: f(lo, hi, sub if rows is None else sub[rows])
