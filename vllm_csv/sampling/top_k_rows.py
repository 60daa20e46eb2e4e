"""Top-k and min-p rows certified from each row's highest upper bounds: no rounds, no ``[R, V]`` map.

A row vLLM samples with a top-k (``0 < k < V``; no grammar mask; a min-p may come before it and
a top-p after it) and with no logits processor other than the temperature acting (the caller's
per-row map, ``columns`` of :func:`~.rows.certify_rows`) draws among the ``k`` largest processed
values ``y = x / T`` (vLLM's fp32 division) that min-p keeps, ties at the ``k``-th value kept
(:mod:`.nucleus`, "top-k"), then, with a top-p, among the nucleus of those alone (vLLM's softmax
and cumulative sum run over the row after top-k, where every other token is ``-inf``, of mass 0).
Every token outside the row's highest upper bounds is then usually dropped for sure, so the
whole certificate can run on those few columns: no ``[R, V]`` map, no top-k levels, top-p
masses or draw certificate over the vocabulary, no rounds. A row with a min-p and no top-k
(``k = V``: off) takes the same path: its other tokens must then be dropped by min-p (step 4).

Pipeline (:func:`certify_top_k`):

1. the screen's upper bounds ``hi [R, V]`` (computed once by the caller, :func:`~.scoring.screen_bounds`);
2. each row's ``K + 1`` highest upper bounds (``K = TOP_K_GUESS (k + 1)``, or
   :data:`MIN_P_GUESS` on a row without a top-k; at most the row's share of the budget; one :func:`~vllm_csv.ops.topk.row_topk` pass): the first ``K`` are the
   row's candidates, the ``(K + 1)``-th value bounds every other token of the row (``-inf`` when
   ``K = V``);
3. the candidates' union scored exactly (:meth:`.HeadAdapter.score`: ``lower <= dense <= upper``,
   and the dense value where the two agree bit for bit), each row's own candidates gathered out
   of it, and the bounds mapped by ``columns`` (monotone per token: bounds map to bounds); the
   others' bounds mapped too, as one more column: the ``(K + 1)``-th upper bound above, and below
   the row's smallest lower bound where the row has a min-p (``lo_min``), else ``-inf``;
4. with a min-p, vLLM's min-p on those ``K + 1`` columns (:func:`~.nucleus.min_p.min_p_bounds`). Its
   decision on a token rests on that token's own bounds, the row's maximum ``m`` and a margin
   of that token's ``|y|`` and ``|m|`` (:mod:`.nucleus`, "min-p"), and ``m`` lies between the
   columns' largest lower bound and their largest upper bound, which is the row's (the highest
   upper bound is a candidate's): so each candidate's decision is the one on the whole row.
   Every other token lies within the others' column's bounds, so the margin computed over the
   columns covers it too: where min-p drops that column, it drops every other token. Where it
   does not, the column stands for tokens min-p may or may not keep (it is never certainly kept
   as one token stands for many: its lower bound becomes ``-inf``), which is what vLLM's top-k
   then sees;
5. vLLM's top-k on those ``K + 1`` columns (:func:`~.nucleus.top_k.top_k_bounds`: certainly kept,
   certainly dropped, undecided). The row goes on only if the others' column is certainly
   dropped (by min-p above, or here): its upper bound is below ``L_k``, the ``k``-th largest
   lower bound of the candidates, a lower bound of the dense ``k``-th value (after min-p: a
   candidate min-p may drop has lower bound ``-inf`` there), so every other token is dropped.
   The decisions on the columns are then those on the whole row: ``L_k`` is the row's (the others'
   lower bounds are below it), and so are the ``k``-th and ``(k + 1)``-th largest upper bounds
   that decide "certainly kept" (the others are below ``L_k``, itself at most the ``k``-th largest
   candidate upper bound; one column at the others' bound gives the ``(k + 1)``-th as any number
   of others would);
6. with a top-p, vLLM's top-p on the columns (:func:`~.nucleus.top_p.top_p_bounds`): every other
   token is certainly dropped by min-p or top-k (step 5 checks that before top-p: top-p sees the
   others' column as one token of one token's mass, and could drop it where the many tokens it
   stands for are kept), so it adds nothing to any mass; vLLM's rounding is bounded for sums
   over the whole row (``row_length = V``);
7. the draw's certificate on the columns (:func:`~.certificate.certify_draw`, the columns'
   token ids given: each one's noise is its token's): the winner certainly kept, and its noisy
   lower bound above every other not-dropped candidate's noisy upper bound, with the kernel's
   rounding margin.

A certified row is handed to the sampler with its candidates' values where not certainly
dropped (each within its bounds) and ``-inf`` elsewhere: the draw on it returns the winner (it
beats every finite entry), as on the dense row (where every kept token is a not-dropped
candidate). Rows not certified here (the others not certainly dropped, an undecided contender
whose value is not known bit for bit, a close draw) go through :func:`~.rows.certify_rows`'
rounds, with the same screen bounds; before that, a row whose others were not certainly
dropped is tried again on a list :data:`LONGER` times longer (budget allowing).

On the demo model (V 65536, ``top_k = 20``, 8 rows, 2 threads) this replaces about 600 small torch
ops of the rounds (two ``[R, V]`` maps, top-k levels, the draw's certificate over the packed
rows, the focus) by one ``row_topk`` pass and a few dozen ops on ``[R, K + 1]``.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from .certificate import certify_draw
from .head_adapter import HeadAdapter
from .nucleus.min_p import min_p_bounds
from .nucleus.top_k import top_k_bounds
from .nucleus.top_p import top_p_bounds

TOP_K_GUESS = 4  # top-k rows: their 4 (k + 1) highest upper bounds scored first (also the rounds' first guess).
# The demo model's top-k 20 rows needed 36 at the median, 65 at the 86th percentile, 86 at most
# (320 rows): 3 (k + 1) sent 14% of rows to a longer try, 4 (k + 1) about 1%
MIN_P_GUESS = 32  # min-p rows without a top-k: their 32 highest upper bounds first (then 128, 512)
LONGER = 4  # a row whose others were not certainly dropped: tried again on a list this many times longer
LONGER_TRIES = 2  # that many times at most (4 (k + 1), then 16 (k + 1), then 64 (k + 1) candidates)


class TopKRows(NamedTuple):
    values: torch.Tensor  # [R, V] model dtype: a certified row's values on its not-dropped candidates, -inf elsewhere
    certified: torch.Tensor  # [R] bool
    winner: torch.Tensor  # [R] int64, the drawn token (meaningful where certified)
    scored: int  # columns scored (the candidates' unions, added over the tries)
    short: torch.Tensor  # [R] bool: the others' column was not certainly dropped (a longer list may help)


def certify_top_k(adapter: HeadAdapter, hidden: torch.Tensor, hnorm: torch.Tensor, hi: torch.Tensor,
                  top_k: torch.Tensor, seeds: torch.Tensor, columns: Callable, rows: torch.Tensor | None,
                  budget: int, top_p: torch.Tensor | None = None, min_p: torch.Tensor | None = None,
                  lo_min: torch.Tensor | None = None) -> TopKRows | None:
    """Certify top-k rows from their highest upper bounds (module docstring); the rows whose
    others were not certainly dropped tried again on a list :data:`LONGER` times longer, up to
    :data:`LONGER_TRIES` times.

    Parameters
    ----------
    adapter : HeadAdapter
    hidden : torch.Tensor
        ``[R, d]`` model dtype, finite rows (the screen's ``finite``).
    hnorm : torch.Tensor
        ``[R]`` the screen's ``||h||`` (what :meth:`.HeadAdapter.score` takes).
    hi : torch.Tensor
        ``[R, V]`` float32, the screen's upper bounds on the values the dense head hands the sampler.
    top_k : torch.Tensor
        ``[R]`` int64, ``0 < k < V``, or ``V`` (no top-k) on rows with a min-p.
    seeds : torch.Tensor
        ``[R]`` int64, the seeds the sampler will draw these rows with.
    columns : callable
        ``(lo, hi, rows) -> (ylo, yhi)`` on ``[R, c]`` bounds of any columns: the per-row map to
        the draw's inputs (vLLM's temperature), ``rows`` as given here.
    rows : torch.Tensor or None
        What ``columns`` takes as ``rows`` for these rows (None: all of the caller's, in order).
    budget : int
        Columns that may be scored; ``R (k + 1) <= budget`` on every row with a top-k (each
        row's list is cut to its share, ``budget / R``).
    top_p : torch.Tensor, optional
        ``[R]`` float32, vLLM's top-p after the top-k (``1``: off).
    min_p : torch.Tensor, optional
        ``[R]`` float32, vLLM's min-p before the top-k (``0``: off).
    lo_min : torch.Tensor, optional
        ``[R]`` float32, each row's smallest lower bound over the vocabulary (the screen's, before
        ``columns``): the others' lower bound on rows with a min-p (default ``-inf``: min-p then
        never drops the others).

    Returns
    -------
    TopKRows, or None when a try's union exceeds ``budget`` (nothing scored in it).
    """
    R, V = hi.shape
    k = top_k.long()
    K = first_list(k, V).clamp_(max=max(1, budget // R))  # within each row's share of the budget
    floor = hi.new_full((R, 1), -math.inf)  # the others' lower bound
    if min_p is not None and lo_min is not None:
        floor = torch.where((min_p > 0)[:, None], lo_min[:, None], floor)
    out = _try(adapter, hidden, hnorm, hi, floor, k, top_p, min_p, seeds, columns, rows, K, budget)
    for _ in range(LONGER_TRIES):
        if out is None or not bool(out.short.any()):
            break
        r = out.short.nonzero().squeeze(1)
        K = (K * LONGER).clamp_(max=V)
        again = _try(adapter, hidden[r], hnorm[r], hi[r], floor[r], k[r], None if top_p is None else top_p[r],
                     None if min_p is None else min_p[r], seeds[r], columns, r if rows is None else rows[r], K[r],
                     budget - out.scored)
        if again is None:
            break
        out.values.index_copy_(0, r, again.values)
        out = out._replace(certified=out.certified.index_put((r,), again.certified),
                           winner=out.winner.index_put((r,), again.winner), scored=out.scored + again.scored,
                           short=torch.zeros_like(out.short).index_put_((r,), again.short))
    return out


def first_list(top_k: torch.Tensor, V: int) -> torch.Tensor:
    """``[R]`` int64: each row's first list, ``TOP_K_GUESS (k + 1)`` candidates, or
    :data:`MIN_P_GUESS` on a row without a top-k (``k >= V``), at most ``V``."""
    k = top_k.long()
    return torch.where(k < V, TOP_K_GUESS * (k + 1), MIN_P_GUESS).clamp_(max=V)


def _try(adapter: HeadAdapter, hidden: torch.Tensor, hnorm: torch.Tensor, hi: torch.Tensor, floor: torch.Tensor,
         k: torch.Tensor, top_p: torch.Tensor | None, min_p: torch.Tensor | None, seeds: torch.Tensor,
         columns: Callable, rows: torch.Tensor | None, K: torch.Tensor, budget: int) -> TopKRows | None:
    """One try of :func:`certify_top_k` with ``K [R]`` candidates a row (``k`` int64 ``[R]``;
    ``floor [R, 1]`` the others' lower bound)."""
    R, V = hi.shape
    Kmax = int(K.max())
    ops = adapter.masks  # (the passes the adapter bound: masks' and each row's top-k)
    top = ops.row_topk(hi, min(Kmax + 1, V))
    # the row's candidates: its first K columns; the others' bound: its (K + 1)-th upper bound
    # (>= every other hi; -inf when K = V); past K a row's columns count as others
    listed = torch.arange(Kmax, device=hi.device)[None] < K[:, None]  # [R, Kmax]
    cand = top.indices[:, :Kmax].contiguous()  # distinct within a row
    others = torch.cat([top.values, hi.new_full((R, 1), -math.inf)], 1).gather(1, K[:, None])  # [R, 1]
    ids = torch.unique(cand[listed])  # sorted: the scoring reads W in order
    if ids.numel() > budget:
        return None
    pos = torch.searchsorted(ids, cand).clamp_(max=ids.numel() - 1)  # (unlisted columns: any, masked below)
    z, lower, upper = adapter.score(hidden, ids, hnorm)  # [R, n]
    z, lower, upper = z.gather(1, pos), lower.gather(1, pos), upper.gather(1, pos)
    lower, upper = lower.masked_fill(~listed, -math.inf), upper.masked_fill(~listed, -math.inf)
    ylo, yhi = columns(torch.cat([lower, floor], 1), torch.cat([upper, others], 1), rows)  # the others' column last
    if min_p is not None:
        ylo, yhi = min_p_bounds(ylo, yhi, min_p, ops=ops)
    # the others' column stands for many tokens: never counted as one certainly kept token
    ylo[:, Kmax] = -math.inf
    ylo, yhi = top_k_bounds(ylo, yhi, k, ops)
    # The others must be dropped by min-p or top-k, before top-p: top-p sees their column as one
    # token of one token's mass, and could drop it where the many tokens it stands for are kept
    short = yhi[:, Kmax] > -math.inf
    if top_p is not None:
        ylo, yhi = top_p_bounds(ylo, yhi, top_p, row_length=V)
    ids_ext = torch.cat([cand, cand[:, :1]], 1)  # (the others' column: any id; it is dropped or the row open)
    cert = certify_draw(ylo, yhi, seeds, torch.zeros(R, dtype=torch.bool, device=hi.device), ids=ids_ext,
                        ops=adapter.draw)
    winner = ids_ext.gather(1, cert.winner[:, None])[:, 0]
    values = _handed_rows(V, cand, z, yhi[:, :Kmax])
    return TopKRows(values, cert.certified & ~short, winner, int(ids.numel()), short)


def _handed_rows(V: int, cand: torch.Tensor, z: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` (``z``'s dtype): the rows handed to the sampler, ``z`` on the candidates ``cand``
    (``[R, K]``) whose upper bound ``up`` after top-k is not ``-inf`` (certainly dropped ones and
    unlisted columns are), ``-inf`` elsewhere."""
    values = torch.full((cand.shape[0], V), -math.inf, dtype=z.dtype, device=z.device)
    return values.scatter_(1, cand, z.masked_fill(up == -math.inf, -math.inf))
