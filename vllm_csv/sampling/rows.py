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
   top-p, which decide what those certainly keep: :func:`_focus_counts`) are scored exactly
   (their bounds shrink to the rounding interval of the dense value, intersected with the
   screen's) and 2-3 repeat, until every row is decided, nothing is left to score, or the
   budget is spent. Top-p rows have their :data:`TOP_P_GUESS` highest upper bounds scored
   before the first round (a round of theirs costs far more than scoring a few tokens, and
   those are where the draw and the nucleus' mass usually are); top-k rows their
   :data:`TOP_K_GUESS` ``(k + 1)``.
   When ``process`` is per token (``elementwise``), the rounds after the first round with no
   masks on the open rows certify on that round's contenders only, the tokens it ruled out kept
   as one summary per row (:func:`~.certificate.ruled_out`): no second pass over the
   vocabulary; with ``columns`` (a per-row map) they map those columns only.

Before the rounds, the rows with a top-k or a min-p (a top-p may follow; given ``columns``,
nothing masked) are certified on their highest upper bounds alone
(:mod:`.top_k_rows`: no ``[R, V]`` map, no rounds); the rounds take the rest, on the same
screen bounds, with what is left of the budget.

A row certified in a round leaves the loop: its proof used valid bounds and compared its winner
with every token, scored or not, so it needs nothing more; the rounds after it (their maps, masks,
certificates and scoring) run on the rows still open only (on 8 top-k rows, one or two are left
after the first round).

A certified row is handed to the sampler as exact values on the set ``S`` of columns scored
while it was open and ``-inf`` elsewhere (and on tokens ``process`` or the masks rule out in
its certifying round): the sampler then runs vLLM's unchanged code on it. Every finite value of
the row lies within its token's bounds and was beaten by the winner, so the row's draw returns
the certified winner too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .certificate import DrawCertificate, certify_draw, certify_draw_packed, ruled_out
from .nucleus.chain import Masks
from .nucleus.top_k import has_top_k
from ..ops.bools import all_, any_
from ..ops.gather import rows_of
from ..ops.topk import row_topk
from ..vocabulary import reason_of
from .outside import Outside
from .head_adapter import HeadAdapter
from .top_k_rows import TOP_K_GUESS, certify_top_k

MAX_ROUNDS = 4
FIRST_GUESS = 8  # one-sided screens (no lower bounds): score the 8 highest upper bounds first
TOP_P_GUESS = 64  # top-p rows: their 64 highest upper bounds scored up front (budget allowing)
TOP_P_FOCUS = (128, 2048)  # open top-p rows with every contender scored: their V / 32 highest upper
# bounds, within these, 4x more each time. V / 32 from 128: 32 top-p 0.9 rows of the demo model (V
# 65536) 0.91-0.99x dense against 0.73-0.82x, 96.4% certified against 95.9% (benchmarks/README.md, "Top-p rows
# stuck on their masses"); at most V / 32: a first widening near the budget (5% of V) left more
# rows uncertified on small vocabularies (V 1024)


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
        bounds scored (within :data:`TOP_P_FOCUS`), 4x more each such round (top-p compares
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
    certifies it (or puts it over budget), its output finished then (:func:`_finish_rows`), and
    columns scored later are scored for the open rows only (a certified row needs no more: its
    proof already compared its winner with every token, scored or not).
    """
    bounds = screen_bounds(adapter, hidden, masked)
    R, V = hidden.shape[0], adapter.vocab_size
    budget = budget_of(adapter)
    quick = None
    if columns is not None and masked is None and (top_k is not None or min_p is not None):
        tk = top_k if top_k is not None else torch.full((R,), V, dtype=torch.long, device=hidden.device)
        with_k = has_top_k(tk, V)
        # (a min-p row without a top-k needs the screen's lower bounds: min-p must drop its others)
        quick = bounds[3] & ~greedy & (with_k if min_p is None or bounds[4] else with_k | (min_p > 0))
        # each top-k row's k + 1 within its share of the budget (a row with a large k, e.g. V - 1,
        # goes through the rounds; certify_top_k keeps each list within the share)
        quick &= torch.where(with_k, tk + 1, 1) * int(quick.sum()) <= budget
    fast = None
    if quick is not None and bool(quick.any()):
        q = quick.nonzero().squeeze(1)
        every = q.numel() == R
        mp = None if min_p is None or not bool((min_p[q] > 0).any()) else min_p[q]
        fast = certify_top_k(adapter, rows_of(hidden, q), rows_of(bounds[2], q), rows_of(bounds[1], q), tk[q],
                             seeds[q], columns, None if every else q, budget, top_p=None if top_p is None else top_p[q],
                             min_p=mp, lo_min=None if mp is None else rows_of(bounds[0], q).amin(1))
    if fast is None:
        return _rounds(adapter, hidden, bounds, process, seeds, greedy, masked, elementwise, min_p, top_k, top_p,
                       columns, budget)
    if every and bool(fast.certified.all()):
        return RowsResult(fast.values, fast.certified, fast.winner, [None] * R, fast.scored)
    done = torch.zeros(R, dtype=torch.bool, device=hidden.device).index_put_((q,), fast.certified)
    rest = (~done).nonzero().squeeze(1)
    sub = _rounds(adapter, rows_of(hidden, rest), tuple(rows_of(t, rest) for t in bounds[:4]) + (bounds[4],),
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


def _rounds(adapter: HeadAdapter, hidden: torch.Tensor, bounds: tuple, process: Process, seeds: torch.Tensor,
            greedy: torch.Tensor, masked: torch.Tensor | None, elementwise: bool, min_p: torch.Tensor | None,
            top_k: torch.Tensor | None, top_p: torch.Tensor | None, columns: Process | None,
            budget: int) -> RowsResult:
    """:func:`certify_rows`' rounds, on the screen's ``bounds`` of these rows (:func:`screen_bounds`),
    scoring at most ``budget`` columns."""
    R, V = hidden.shape[0], adapter.vocab_size
    dev = hidden.device
    lo, hi, hnorm, finite, one_sided = bounds  # (masked tokens -inf already: screen_bounds)
    values, scored, certified, winner, over_budget = empty_state(adapter, R, dev)
    # the results, all R rows: a row's are written once, when it leaves the loop
    out = RowsResult(values, certified.clone(), winner.clone(), [], 0)
    out_over, all_finite = over_budget.clone(), finite
    live = torch.arange(R, device=dev)  # the rows in the loop (indices into the R rows)

    def add(ids: torch.Tensor) -> None:
        score_columns(adapter, hidden, hnorm, ids, values, lo, hi, scored, masked)

    def leave(rows: torch.Tensor, yhi: torch.Tensor | None) -> None:
        # the rows ``rows`` ([n] bool over the live rows) leave the loop in this round: results
        # out; a certified row's values masked with this round's drops (yhi: its upper bounds
        # after process and the masks; None in a column-only round: mapped here)
        idx = live[rows]
        out.certified[idx], out.winner[idx], out_over[idx] = certified[rows], winner[rows], over_budget[rows]
        done = rows & certified
        if bool(any_(done)):
            r = done.nonzero().squeeze(1)
            s_idx = scored.nonzero().squeeze(1)
            if yhi is not None:
                up = rows_of(yhi, r)[:, s_idx]
            else:  # (lo, hi are this round's: no column was scored after its map)
                up = columns(rows_of(lo, r)[:, s_idx], rows_of(hi, r)[:, s_idx], rows_of(live, r))[1]
            _finish_rows(out.values, rows_of(live, r), s_idx, rows_of(values, r),
                         None if masked is None else rows_of(masked, r), up)

    if one_sided and bool(finite.any()):
        add(row_topk(hi[finite], min(FIRST_GUESS, V)).indices.unique())
    elif top_p is not None and TOP_P_GUESS and bool((guess := finite & (top_p < 1.0)).any()):
        # top-p rows: their highest upper bounds scored before the first round, which then
        # often certifies (a top-p round is the costly part: masks, queries, certificate over
        # [R, V]); at most a quarter of the budget, shared by the rows
        n = min(TOP_P_GUESS, V, budget // (4 * int(guess.sum())))
        if n > 0:
            add(row_topk(hi[guess], n).indices.unique())
    elif top_k is not None and bool((guess := finite & (top_k > 0) & (top_k < V)).any()):
        # top-k rows: their TOP_K_GUESS (k + 1) highest upper bounds scored before the first round
        # (the k + 1 are what the focus scores after a round anyway: they decide what top-k
        # certainly keeps, and the draw's winner is a kept token; the extra ones what the k-th
        # exact value must rise above for the others to be certainly dropped), so the first round
        # usually certifies; their union within a quarter of the budget (else k + 1 only)
        count = _focus_counts(top_k, None, torch.zeros_like(top_k), V).masked_fill(~guess, 0)
        for c in ((count * TOP_K_GUESS).clamp_(max=V), count):
            first = torch.zeros(V, dtype=torch.bool, device=dev)
            _focus(first, hi, c, guess, scored)
            ids = first.nonzero().squeeze(1)
            if ids.numel() <= budget // 4:
                add(ids)
                break
    narrow = None  # (columns, ruled-out summaries): the rounds after the one that set it, elementwise
    stuck = torch.zeros(R, dtype=torch.long, device=dev)  # top-p rows: rounds with every contender scored
    masks = Masks(min_p, top_k, top_p, V)
    asked = None  # top-p rows: the tokens whose decisions the draw's certificate needed so far
    by_query = None  # top-p rows: the last round's queries (TopPQueries), narrowed to the next round's bounds
    for rnd in range(MAX_ROUNDS + 1):
        rows = None if live.numel() == R else live
        if narrow is not None and columns is not None:
            # a later round, elementwise and no masks: only the contenders of the round that set
            # narrow are read, and with a per-row map they can be mapped alone (no [n, V] pass)
            cols_n, rest = narrow
            ylo_c, yhi_c = columns(lo.index_select(1, cols_n), hi.index_select(1, cols_n), rows)
            cert = _certify_columns(ylo_c, yhi_c, seeds, greedy, cols_n, rest, V)
            ylo = yhi = None  # (not mapped on every column this round: mapped below where read)
            by_query = None
        else:
            ylo0, yhi0 = masks.before_top_p(*process(lo, hi, rows), ~certified)
            # top-p rows: first decided on their likely winners only, then on the draw's contenders
            # that this leaves (nucleus.top_p_queries docstring); the rest stays
            # undecided, which the certificate allows for any token that cannot win
            # (asked: the previous round's contenders, which bounds that only tighten rarely add to)
            by_query = masks.top_p_queries(ylo0, yhi0, ~certified, by_query)
            ylo, yhi = masks.top_p_of(ylo0, yhi0, ~certified) if by_query is None else by_query.bounds(asked)
            if narrow is None:
                cert = certify_draw_packed(ylo, yhi, seeds, greedy)
            else:
                cert = _certify_columns(ylo[:, narrow[0]], yhi[:, narrow[0]], seeds, greedy, *narrow, V)
        if by_query is not None:
            # On a row left open: contenders that were not asked for are asked for now, and where
            # every contender is scored (only decisions can help) the contenders a short list
            # left undecided are decided on a longer one (TopPQueries.bounds). A row
            # certified above asks for the same tokens again (its one contender is its winner):
            # its bounds and certificate come out the same. A row with no certainly kept token
            # asks for every token (decided in full). Not in the first round, where nothing is
            # scored yet: its contenders are scored as they stand (the extra tokens undecided ones
            # add cost microseconds to score; a second pass over [R, V] cost about 1 ms a row at
            # V 65536), and are the next round's asks.
            wanted = _wanted(cert)
            late = any_(wanted & ~asked, 1) if asked is not None else torch.zeros_like(certified)
            left = ~certified & ~cert.certified & (top_p < 1.0)
            settled = left & ~any_(cert.contenders & ~scored[None], 1)
            redo = left & (late | settled)
            if bool(any_(redo)):
                asked = wanted if asked is None else wanted | asked
                # Only the rows of redo get new bounds, and are certified again: another row's
                # asked tokens did not grow (not late) and nothing was settled for it (its bounds
                # would come out the same), or it is certified already on the bounds it keeps
                # (more tokens decided would give a box within that one, for which the
                # certificate holds; its output is masked with the bounds it was certified on).
                ridx = redo.nonzero().squeeze(1)
                new_lo, new_hi = by_query.bounds(asked, wanted & (late | settled)[:, None], ridx)
                ylo.index_copy_(0, ridx, new_lo)  # (this round's own tensors: bounds() made them)
                yhi.index_copy_(0, ridx, new_hi)
                cert = _recertify(cert, ylo, yhi, seeds, greedy, ridx)
                wanted = _wanted(cert)
            asked = wanted if asked is None else wanted | asked
        now = cert.certified & finite & scored[cert.winner] & ~certified
        winner = torch.where(now, cert.winner, winner)
        certified |= now
        span = None if narrow is None else narrow[0]  # contenders lie in these columns only
        open_rows = finite & ~certified & ~over_budget
        need = contended(cert.contenders, open_rows, span)
        if narrow is None and elementwise and masks.off and bool((cert.finite | ~finite).all()):
            # (a round over every column with no masks on the rows in the loop: the rounds after
            # it read the open rows' contenders only, the rest of each row summarised)
            cols = need.nonzero().squeeze(1)
            narrow = (cols, ruled_out(cert, greedy)) if cols.numel() else None
        need &= ~scored
        # rows where no token is certainly kept yet (e.g. min-p / top-p undecided on screen
        # bounds): score their highest upper bounds first
        blind = open_rows & ~cert.finite
        if bool(any_(blind)):  # (the full pass only when some row may be blind)
            if yhi is None:  # (a narrow round: the full map, for these rows' highest upper bounds)
                ylo, yhi = process(lo, hi, rows)
            blind &= any_(yhi > -math.inf, 1)
        if bool(any_(blind)):
            top = row_topk(yhi[blind], min(FIRST_GUESS, V))
            need[top.indices[top.values > -math.inf]] = True
            need &= ~scored
            cert.contenders[blind] = False
            cert.contenders[blind.nonzero().squeeze(1)[:, None], top.indices] = top.values > -math.inf
            span = None  # (contenders outside the narrow columns now)
        if masks.top_k_on or masks.top_p_on:
            rows_f = open_rows & ~blind
            if masks.top_p_on:  # top-p rows with no contender left to score: stuck on masses
                stuck += rows_f & (top_p < 1.0) & ~any_(cert.contenders & ~scored[None], 1)
            _focus(need, hi, _focus_counts(top_k, top_p, stuck, V), rows_f, scored)
        if not bool(any_(need)) or rnd == MAX_ROUNDS:
            break
        new, over_budget = next_columns(need, cert.contenders, scored, open_rows, over_budget, budget)
        if new is None:
            break
        keep = finite & ~certified & ~over_budget
        if not bool(all_(keep)):
            # rows certified (or over budget) in this round leave: the next rounds, and the
            # scoring of their columns, run on the open rows only
            leave(~keep, yhi)
            k = keep.nonzero().squeeze(1)
            live, hidden, hnorm, lo, hi, values, seeds, greedy, finite, certified, winner, over_budget, stuck = (
                rows_of(t, k) for t in (live, hidden, hnorm, lo, hi, values, seeds, greedy, finite, certified,
                                        winner, over_budget, stuck))
            masked, asked, min_p, top_k, top_p = (None if t is None else rows_of(t, k)
                                                  for t in (masked, asked, min_p, top_k, top_p))
            masks = Masks(min_p, top_k, top_p, V)
            by_query = None  # (its lists are the old rows': a new one for these)
            narrow = None if narrow is None else (narrow[0], narrow[1].rows(k))
        add(new)
    open_rows = finite & ~certified & ~over_budget
    cont, unscored = (cert.contenders, ~scored) if span is None else (cert.contenders[:, span], ~scored[span])
    over_budget |= open_rows & any_(cont & unscored[None], 1)  # still waiting for room
    leave(torch.ones_like(certified), yhi)
    out.reason, out.scored = reasons(out.certified, all_finite, out_over), int(scored.sum())
    return out


def _finish_rows(out: torch.Tensor, rows: torch.Tensor, s_idx: torch.Tensor, values: torch.Tensor,
                 masked: torch.Tensor | None, up: torch.Tensor) -> None:
    """Certified rows' outputs, in place: ``out[rows]`` (``out`` ``[R, V]``, ``-inf`` off the
    scored columns ``s_idx``) gets ``values`` (``[n, V]``, the rows' exact values on ``s_idx``),
    with ``-inf`` where upstream masked a token (``masked``, ``[n, V]``) and where the round that
    certified the row had a ``-inf`` upper bound (``up``: ``[n, |s_idx|]``, its upper bounds after
    ``process`` and the masks, on ``s_idx``).

    A token whose upper bound was ``-inf`` in that round (masked, or certainly dropped by min-p /
    top-k / top-p) was never compared with the winner: it must not compete on the row the sampler
    gets either (the sampler does not drop it again: a certified row is drawn with no top-p or
    top-k, and vLLM's min-p may be skipped, ``vllm_plugin.v1.masks._masks_off``). (Another round's drops
    are not that proof's: the tail a top-p drops as one block may differ between rounds.)"""
    v = values[:, s_idx]
    if masked is not None:
        v.masked_fill_(masked[:, s_idx], -math.inf)
    v.masked_fill_(up == -math.inf, -math.inf)
    if rows.numel() == out.shape[0]:  # (rows ascending and distinct: every row, in order)
        out[:, s_idx] = v
    else:
        out[rows[:, None], s_idx[None]] = v


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
    :func:`_focus`) that do not fit, and every other open row is over budget, so a next round
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
    if masked is not None:
        lo.masked_fill_(masked, -math.inf)
        hi.masked_fill_(masked, -math.inf)
    return lo, hi, hnorm, finite, one_sided


def budget_of(adapter: HeadAdapter) -> int:
    """Columns a batch of rows may have scored: the head's budget share of ``V``, at least one."""
    return max(1, math.ceil(adapter.budget * adapter.vocab_size))


def empty_state(adapter: HeadAdapter, R: int, dev: torch.device):
    """A loop's start: ``values [R, V]`` all ``-inf`` (model dtype), nothing scored (``[V]``
    bool), and per row not certified, winner 0, not over budget (the budget is the caller's:
    :func:`budget_of`, or a share of it)."""
    V = adapter.vocab_size
    return (torch.full((R, V), -math.inf, dtype=adapter.dtype, device=dev), torch.zeros(V, dtype=torch.bool, device=dev),
            torch.zeros(R, dtype=torch.bool, device=dev),
            torch.zeros(R, dtype=torch.long, device=dev), torch.zeros(R, dtype=torch.bool, device=dev))


def reasons(certified: torch.Tensor, finite: torch.Tensor, over_budget: torch.Tensor) -> list[str | None]:
    """Per row: None if certified, else why not (``nonfinite``, ``budget``, ``uncertified``)."""
    return [reason_of(c, f, b) for c, f, b in zip(certified.tolist(), finite.tolist(), over_budget.tolist())]


def _focus_counts(top_k: torch.Tensor | None, top_p: torch.Tensor | None, stuck: torch.Tensor,
                  V: int) -> torch.Tensor:
    """``[R]`` int64: how many of its highest upper bounds (before ``process``: dropped tokens
    count for top-p's masses) each open row has scored this round: ``k + 1`` with a top-k
    (``0 < k < V``); with a top-p (``p < 1``), ``f 4^(n - 1)`` in the ``n``-th round
    (``stuck``, ``n >= 1``) in which every contender of the row was scored and it is still open:
    a top-p row that its contenders alone certify scores no more; ``f = V / 32`` within
    :data:`TOP_P_FOCUS` (the nucleus' mass spreads over more tokens in a larger vocabulary)."""
    n = torch.zeros_like(stuck)
    if top_k is not None:
        n = torch.where((top_k > 0) & (top_k < V), top_k + 1, n)
    if top_p is not None:
        first = min(max(V // 32, TOP_P_FOCUS[0]), TOP_P_FOCUS[1])
        wide = first << (2 * (stuck - 1).clamp_(min=0, max=8))
        n = torch.where((top_p < 1.0) & (stuck > 0), torch.maximum(n, wide), n)
    return n.clamp(max=V)


def _focus(need: torch.Tensor, yhi: torch.Tensor, count: torch.Tensor, rows: torch.Tensor,
           scored: torch.Tensor) -> None:
    """Add to ``need`` (``[V]`` bool, in place) the unscored tokens among the ``count[r]`` highest
    ``yhi`` of each row ``r`` of ``rows`` (``[R]`` bool)."""
    on = rows & (count > 0)
    if not bool(on.any()):
        return
    c = count[on]
    top = row_topk(yhi[on], int(c.max()))
    take = (torch.arange(top.indices.shape[1], device=yhi.device)[None] < c[:, None]) & (top.values > -math.inf)
    ids = top.indices[take]
    need[ids[~scored[ids]]] = True


def _recertify(cert: DrawCertificate, ylo: torch.Tensor, yhi: torch.Tensor, seeds: torch.Tensor,
               greedy: torch.Tensor, rows: torch.Tensor) -> DrawCertificate:
    """``cert`` with the rows ``rows`` certified again on ``ylo, yhi`` (the others kept)."""
    sub = certify_draw_packed(rows_of(ylo, rows), rows_of(yhi, rows), seeds[rows], greedy[rows])
    for name in ("winner", "certified", "contenders", "finite", "bar", "absmax", "hmax"):
        getattr(cert, name)[rows] = getattr(sub, name)
    return cert


def _wanted(cert: DrawCertificate) -> torch.Tensor:
    """``[R, V]`` bool: the tokens whose top-p decisions a row's certificate reads: its
    contenders, every token where it had no certainly kept token to start from."""
    out = cert.contenders.clone()
    if not bool(all_(cert.finite)):  # (a row-indexed write: torch.where over [R, V] is a scalar loop here)
        out[(~cert.finite).nonzero().squeeze(1)] = True
    return out


def contended(contenders: torch.Tensor, rows: torch.Tensor | None, span: torch.Tensor | None) -> torch.Tensor:
    """``[V]`` bool: the tokens that are contenders in some row of ``rows`` (``[R]`` bool; None:
    all), reading only the columns ``span`` where given (the others hold no contender)."""
    if span is None:
        return any_(contenders if rows is None or bool(all_(rows)) else contenders[rows], 0)
    out = torch.zeros(contenders.shape[1], dtype=torch.bool, device=contenders.device)
    sub = contenders[:, span]
    out[span] = any_(sub if rows is None else sub[rows], 0)
    return out


def _certify_columns(ylo: torch.Tensor, yhi: torch.Tensor, seeds: torch.Tensor, greedy: torch.Tensor,
                     cols: torch.Tensor, rest: Outside, V: int) -> DrawCertificate:
    """:func:`~.certificate.certify_draw` on the columns ``cols`` (``[n]`` int64, ascending: ties
    still go to the lowest token id), whose bounds are ``ylo, yhi`` (``[R, n]``), every other token
    of the ``V`` in ``rest``; the result in full-vocabulary coordinates."""
    R = ylo.shape[0]
    cert = certify_draw(ylo, yhi, seeds, greedy, cols.expand(R, -1), rest)
    contenders = torch.zeros((R, V), dtype=torch.bool, device=ylo.device)
    contenders[:, cols] = cert.contenders
    winner = cols[cert.winner] if cols.numel() else cert.winner
    return DrawCertificate(winner, cert.certified, contenders, cert.finite, cert.bar, cert.absmax, cert.hmax)
