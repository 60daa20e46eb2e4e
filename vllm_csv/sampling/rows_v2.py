"""Certify rows of vLLM's Model Runner V2 draw (CUDA): plain temperature sampling.

Pipeline (per batch of rows V2's ``gumbel_sample`` will draw from, rows with no logits
processor, min-p, top-k or top-p):

1. bounds on every token's logit from the head's screen (:class:`.HeadAdapter`);
2. bounds on what V2 draws from, ``fl32(x / T)`` (:func:`~.gumbel_v2.temperature_bounds`; a row
   with ``T = 1`` is not divided at all, which the bounds hold as well);
3. :func:`~.gumbel_v2.certify_draw_v2` with the rows' request seeds and positions (the noise is
   computed once: it depends on neither the bounds nor the round); the contenders not yet
   scored are scored exactly (their bounds shrink to the rounding interval of the dense value,
   intersected with the screen's) and 2-3 repeat until every row is decided, nothing is left to
   score, or the budget is spent.

Host syncs (on CUDA): a few a round (is anything left to score, the budget's room, the reasons
at the end): the loop's length and the tokens it scores depend on them. The head runs eagerly,
outside vLLM's CUDA graphs, as does this loop.

A certified row is handed to V2's sampler as exact values on the scored set ``S`` and ``-inf``
elsewhere: V2's unchanged kernel then draws from it. Every finite value of the row lies within
its token's bounds, and the certificate holds for any values within them, so the kernel returns
the certified winner.
"""

from __future__ import annotations

import torch

from ..ops.bools import any_
from .gumbel_v2 import certify_draw_v2, noise_bounds, temperature_bounds
from .head_adapter import HeadAdapter
from .rows import (FIRST_GUESS, MAX_ROUNDS, RowsResult, contended, empty_state, next_columns, reasons, score_columns,
                   screen_bounds)


def certify_rows_v2(adapter: HeadAdapter, hidden: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                    temp: torch.Tensor) -> RowsResult:
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
        ``[R]`` float32, each row's temperature (``> 0``; other rows are never certified).

    Returns
    -------
    RowsResult
        ``values [R, V]`` in the model dtype (exact on ``S``, ``-inf`` elsewhere), ``certified``,
        ``winner``, a reason per row that is not certified, ``|S|``.
    """
    R, V = hidden.shape[0], adapter.vocab_size
    dev = hidden.device
    lo, hi, hnorm, finite, one_sided = screen_bounds(adapter, hidden)
    finite = finite & (temp > 0)
    values, scored, budget, certified, winner, over_budget = empty_state(adapter, R, dev)
    noise = noise_bounds(seeds, pos, torch.arange(V, device=dev))

    if one_sided and bool(finite.any()):  # no lower bounds: score the likely winners first
        score_columns(adapter, hidden, hnorm, hi[finite].topk(min(FIRST_GUESS, V), dim=1).indices.unique(),
                      values, lo, hi, scored)
    for rnd in range(MAX_ROUNDS + 1):
        w, cert, contenders = certify_draw_v2(*temperature_bounds(lo, hi, temp), seeds, pos, noise=noise)
        now = cert & finite & scored[w] & ~certified
        winner = torch.where(now, w, winner)
        certified |= now
        open_rows = finite & ~certified & ~over_budget
        need = contended(contenders, open_rows, None) & ~scored
        if not bool(any_(need)) or rnd == MAX_ROUNDS:
            break
        new, over_budget = next_columns(need, contenders, scored, open_rows, over_budget, budget)
        if new is None:
            break
        score_columns(adapter, hidden, hnorm, new, values, lo, hi, scored)
    open_rows = finite & ~certified & ~over_budget
    over_budget |= open_rows & any_(contenders & ~scored[None], 1)
    return RowsResult(values, certified, winner, reasons(certified, finite, over_budget), int(scored.sum()))
