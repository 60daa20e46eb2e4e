"""Certify rows of vLLM's Model Runner V2 draw (CUDA): temperature sampling, with min-p,
vLLM's native logits processors (logit bias, allowed ids, min_tokens, penalties, bad words)
and structured output (the grammar bitmask).

Pipeline (per batch of rows V2's ``gumbel_sample`` will draw from; rows V2 masks with a top-k or
a top-p first, ``top``, are certified where the masks certainly keep the winner: under a top-k
alone, a draw among the tokens it surely keeps ahead of all it may keep
(:func:`~.gumbel_v2.top_k_bounds`, after min-p in 3.), else the row's certain maximum,
:func:`~.gumbel_v2.certain_maximum`):

1. bounds on every token's logit from the head's screen (:class:`.HeadAdapter`); ``-inf`` on
   both sides for the tokens the grammar bitmask removed (``masked``: V2's runner sets them to
   exactly ``-inf`` in the head's output before the sampler runs, and every V2 processor, the
   temperature and min-p keep ``-inf`` there), also once they are scored;
2. the processors on both bounds (``process``: the caller runs vLLM's own ones; each is
   monotone non-decreasing per token, so the bounds stay bounds);
3. bounds on what V2 draws from, ``fl32(x / T)`` (:func:`~.gumbel_v2.temperature_bounds`; a row
   with ``T = 1`` is not divided at all, which the bounds hold as well; a greedy row, ``T = 0``,
   neither: its draw is the argmax, ``greedy`` in :func:`~.gumbel_v2.certify_draw_v2`), then min-p on them
   (:func:`~.gumbel_v2.min_p_bounds`; the tokens that may be the row's maximum are scored with
   the draw's contenders: they set min-p's threshold);
4. :func:`~.gumbel_v2.certify_draw_v2` with the rows' request seeds and positions (the noise is
   computed once: it depends on neither the bounds nor the round); the contenders not yet
   scored are scored exactly (their bounds shrink to the rounding interval of the dense value,
   intersected with the screen's) and 2-4 repeat until every row is decided, nothing is left to
   score, or the budget is spent (without processors, 3's bounds before min-p are kept between
   rounds and recomputed on the scored columns alone: each token's are its own).

A loop may also go on from another's bounds and scored columns (``start``: V2's verification
hands its acceptance rounds' state to the draws after them, :mod:`.verify_v2`).

Host syncs (on CUDA): a few a round (is anything left to score, the budget's room, the reasons
at the end): the loop's length and the tokens it scores depend on them. The head runs eagerly,
outside vLLM's CUDA graphs, as does this loop.

A certified row is handed to V2's sampler as exact values on the scored set ``S`` and ``-inf``
elsewhere, and ``-inf`` on the tokens min-p certainly drops and on the grammar's: V2's unchanged pipeline then runs
its processors, temperature and min-p on it and draws. Each processor acts per token, so every
finite value it makes lies within its token's bounds; the partial row's maximum is at most the
full row's, so its min-p threshold is at most the full row's: the winner (certainly kept) stays,
and whatever else stays is a token the certificate did not drop, which the winner beat. The
certificate holds for any values within the bounds, so the kernel returns the certified winner.
A top-k or top-p row's mask then runs on the partial row: its winner is that row's maximum by the
same margin, or (a top-k alone) above that row's ``k``-th value by the same margin (every other
finite value lies within its bounds, and within ``A``; the tokens the full row's top-k surely
drops are written ``-inf``), so the mask keeps it there too, and the tokens it keeps besides are
ones the winner beat.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..ops.bools import any_, any_columns
from ..vocabulary import reasons
from .gumbel_v2 import (certain_maximum, certify_draw_v2, min_p_bounds, noise_bounds, temperature_bounds,
                        top_k_bounds)
from .head_adapter import HeadAdapter
from .scoring import FIRST_GUESS, MAX_ROUNDS, next_columns, screen
from .types import RowsResult, Screened


Bounds = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def certify_rows_v2(adapter: HeadAdapter, hidden: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                    temp: torch.Tensor, process: Bounds | None = None, min_p: torch.Tensor | None = None,
                    masked: torch.Tensor | None = None, removed: torch.Tensor | None = None,
                    start: Screened | None = None, top: torch.Tensor | None = None) -> RowsResult:
    """Certify V2's draw for each row of ``hidden``.

    Parameters
    ----------
    adapter : HeadAdapter
    hidden : torch.Tensor
        ``[R, d]`` model dtype, the rows' final hidden states.
    seeds, pos : torch.Tensor
        ``[R]`` int64 on ``hidden``'s device: each row's request seed (V2's ``SamplingStates.seeds``)
        and the position it samples at.
    temp : torch.Tensor
        ``[R]`` float32, each row's temperature (``0``: greedy, V2's argmax of the processed
        logits, certified without noise; below 0 never certified).
    process : callable, optional
        ``(lo, hi) -> (lo, hi)``: the logits processors V2 runs before the temperature, applied
        to ``[R, V]`` float32 bounds of the rows' logits (out of place); each must be monotone
        non-decreasing per token. None: no processor acts on these rows.
    min_p : torch.Tensor, optional
        ``[R]`` float32, each row's ``min_p`` (0: none). None: no row has one.
    masked : torch.Tensor, optional
        ``[R, V]`` bool, the tokens the grammar bitmask set to ``-inf`` (None: none).
    removed : torch.Tensor, optional
        ``[R, V]`` bool, tokens the draw leaves out after min-p took its threshold with them
        (V2's verification: a rejected draft; :mod:`.verify_v2`). None: none.
    start : Screened, optional
        The rows' bounds and scored columns from an earlier loop over them (:mod:`.verify_v2`'s
        acceptance rounds), taken over (tightened and filled in place) instead of screening the
        rows again (the budget bounds the columns this loop adds to them). None: screen the rows.
    top : torch.Tensor, optional
        ``[R]`` integer (or bool), how V2 masks each row after min-p: 0 (False) not at all; ``k >=
        2`` a top-k ``k`` alone, whose bounds then go through :func:`~.gumbel_v2.top_k_bounds`
        (the draw among the tokens the mask surely keeps, ahead of every token it may keep; the
        tokens it surely drops ``-inf`` in the row written back); 1 (True) any other top-k or
        top-p, or a top-k row those bounds cannot take: certified only where the winner is the
        row's certain maximum (:func:`~.gumbel_v2.certain_maximum`). The tokens that may settle
        either are scored as contenders. None: no such row.

    Returns
    -------
    RowsResult
        ``values [R, V]`` in the model dtype (exact on ``S``, ``-inf`` elsewhere and on the
        tokens min-p certainly drops or ``masked`` holds), ``certified``, ``winner``, a reason per row that is not
        certified, ``|S|`` (``start``'s columns included).
    """
    R, V = hidden.shape[0], adapter.vocab_size
    dev = hidden.device
    budget = adapter.budget_columns
    if start is None:
        start = screen(adapter, hidden, masked)
    else:
        budget += int(start.scored.sum())  # (the budget is this loop's: the columns it adds, as from the screen)
        if masked is not None:
            start.lo.masked_fill_(masked, -math.inf)
            start.hi.masked_fill_(masked, -math.inf)
    lo, hi, hnorm, finite, one_sided = start.lo, start.hi, start.hnorm, start.finite, start.one_sided
    values, scored = start.values, start.scored
    greedy = temp == 0
    any_greedy = bool(greedy.any())  # (one sync: the rounds then skip the greedy passes where there is none)
    finite = finite & (temp >= 0)
    t_div = torch.where(greedy, 1.0, temp)  # (greedy rows: no division, bounds replaced below)
    if min_p is not None:  # min-p keeps a row's maximum: a greedy row's argmax is the same either way
        min_p = min_p.masked_fill(greedy, 0.0)
    top_k = k_dropped = None
    if top is not None:  # the codes: a top-k alone (k >= 2) takes top_k_bounds, every masked row the maximum's rule
        top = top.long()
        # (one sync: without a top-k alone in the batch the rounds skip top_k_bounds)
        top_k = torch.where(top >= 2, top, 0) if bool((top >= 2).any()) else None
        top = top > 0
    certified = torch.zeros(R, dtype=torch.bool, device=dev)
    winner = torch.zeros(R, dtype=torch.long, device=dev)
    over_budget = torch.zeros(R, dtype=torch.bool, device=dev)
    noise = noise_bounds(seeds, pos, torch.arange(V, device=dev))

    if one_sided and bool(finite.any()):  # no lower bounds: score the likely winners first
        first = adapter.masks.row_topk(hi[finite], min(FIRST_GUESS, V)).indices.unique()
        first = first[~scored[first]]
        if first.numel():
            adapter.score_columns(hidden, hnorm, first, values, lo, hi, scored, masked)

    def tempered(lo, hi):  # what V2 draws from before min-p: processed, then divided (greedy rows not)
        plo, phi = (lo, hi) if process is None else process(lo, hi)
        qlo, qhi = temperature_bounds(plo, phi, t_div)
        if any_greedy:
            qlo, qhi = torch.where(greedy[:, None], plo, qlo), torch.where(greedy[:, None], phi, qhi)
        return qlo, qhi

    dropped = tq = new = None
    for rnd in range(MAX_ROUNDS + 1):
        if tq is None or process is not None:
            tq = tempered(lo, hi)
        else:  # (each token's own map: only the columns scored last round moved)
            tq[0][:, new], tq[1][:, new] = tempered(lo[:, new], hi[:, new])
        qlo, qhi = tq
        maxers = None
        if min_p is not None:
            # the tokens that may be a min-p row's maximum set its threshold: scored with the
            # contenders, or the threshold stays as loose as their screen bounds
            maxers = (min_p > 0)[:, None] & (qhi >= qlo.amax(1, keepdim=True))
            qlo, qhi, dropped = min_p_bounds(qlo, qhi, min_p)
        if removed is not None:
            qlo, qhi = qlo.masked_fill(removed, -math.inf), qhi.masked_fill(removed, -math.inf)
        if top_k is not None:  # (a top-k alone: what its mask surely keeps and surely drops)
            qlo, qhi, k_dropped, k_near, k_on = top_k_bounds(qlo, qhi, top_k, pre=tq if min_p is not None else None)
        w, cert, contenders = certify_draw_v2(qlo, qhi, seeds, pos, noise=noise,
                                              greedy=greedy if any_greedy else None)
        if maxers is not None:
            contenders |= maxers
        if top is not None:  # (top-k / top-p rows: the mask must keep the winner)
            kept, near = certain_maximum(qlo, qhi, w, top if top_k is None else top & ~k_on)
            cert, contenders = cert & kept, contenders | near
            if top_k is not None:
                contenders |= k_near
        now = cert & finite & scored[w] & ~certified
        winner = torch.where(now, w, winner)
        certified |= now
        open_rows = finite & ~certified & ~over_budget
        need = any_columns(contenders, open_rows) & ~scored
        if not bool(any_(need)) or rnd == MAX_ROUNDS:
            break
        new, over_budget = next_columns(need, contenders, scored, open_rows, over_budget, budget)
        if new is None:
            break
        adapter.score_columns(hidden, hnorm, new, values, lo, hi, scored, masked)
    open_rows = finite & ~certified & ~over_budget
    over_budget |= open_rows & any_(contenders & ~scored[None], 1)
    if dropped is not None:  # from the last round's bounds: a superset of any earlier round's
        values.masked_fill_(dropped, -math.inf)
    if top_k is not None:  # (the same for the top-k's: its bounds on x_(k) and A only tighten)
        values.masked_fill_(k_dropped, -math.inf)
    if masked is not None:
        values.masked_fill_(masked, -math.inf)
    if removed is not None:
        values.masked_fill_(removed, -math.inf)
    return RowsResult(values, certified, winner, reasons(certified, finite, over_budget), int(scored.sum()))
