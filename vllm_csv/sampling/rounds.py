"""The rounds of :func:`~.rows.certify_rows`: map the bounds, mask, certify the draw, score the
contenders, repeat (steps 2-3 of :mod:`.rows`' pipeline).

Each round maps the screen's bounds of the rows still open through ``process`` and vLLM's masks
(:class:`~.nucleus.chain.Masks`; top-p decided for the tokens the certificate needs only,
:class:`~.nucleus.top_p_queries.TopPQueries`), certifies the draw
(:func:`~.certificate.certify_draw_packed`) and scores the contenders not yet scored
(:func:`~.scoring.next_columns`, :meth:`.HeadAdapter.score_columns`), plus, on rows with a top-k or a
top-p, the tokens of highest upper bound that decide what the mask certainly keeps
(:func:`_focus_counts`). Top-p rows have their :data:`TOP_P_GUESS` highest upper bounds scored
before the first round, top-k rows their :data:`~.top_k_rows.TOP_K_GUESS` ``(k + 1)``, one-sided screens their
:data:`~.scoring.FIRST_GUESS`.

A row certified in a round leaves the loop: its proof used valid bounds and compared its winner
with every token, scored or not, so it needs nothing more; the rounds after it (their maps, masks,
certificates and scoring) run on the rows still open only (on 8 top-k rows, one or two are left
after the first round).
"""

from __future__ import annotations

import math

import torch

from ..ops.bools import any_, any_columns  # ([R, V] and [V] masks; a row mask [R] reduces with torch's own any / all)
from ..ops.gather import rows_of
from ..ops.noise import PER_CALL, DrawOps
from ..ops.topk import row_topk
from ..vocabulary import reasons
from .certificate import DrawCertificate, certify_columns, certify_draw_packed
from .head_adapter import HeadAdapter
from .nucleus.chain import Masks
from .scoring import FIRST_GUESS, MAX_ROUNDS, next_columns
from .top_k_rows import TOP_K_GUESS
from .types import Process, RowsResult, Screened

TOP_P_GUESS = 64  # top-p rows: their 64 highest upper bounds scored up front (budget allowing)
TOP_P_FOCUS = (128, 2048)  # open top-p rows with every contender scored: their V / 32 highest upper
# bounds, within these, 4x more each time. V / 32 from 128: 32 top-p 0.9 rows of the demo model (V
# 65536) 0.91-0.99x dense against 0.73-0.82x, 96.4% certified against 95.9% (benchmarks/README.md, "Top-p rows
# stuck on their masses"); at most V / 32: a first widening near the budget (5% of V) left more
# rows uncertified on small vocabularies (V 1024)


def run_rounds(adapter: HeadAdapter, hidden: torch.Tensor, start: Screened, process: Process, seeds: torch.Tensor,
               greedy: torch.Tensor, masked: torch.Tensor | None, elementwise: bool, min_p: torch.Tensor | None,
               top_k: torch.Tensor | None, top_p: torch.Tensor | None, columns: Process | None,
               budget: int) -> RowsResult:
    """:func:`~.rows.certify_rows`' rounds (module docstring), scoring at most ``budget`` columns.

    Parameters
    ----------
    start : Screened
        The screen's bounds of these rows, nothing scored (:func:`~.scoring.screen`; masked
        tokens ``-inf`` already); tightened and filled in place.
    budget : int
        Columns that may be scored, at least one.
    adapter, hidden, process, seeds, greedy, masked, elementwise, min_p, top_k, top_p, columns
        As :func:`~.rows.certify_rows` (``columns``: None, or given).

    Returns
    -------
    RowsResult
        As :func:`~.rows.certify_rows`.
    """
    R, V = hidden.shape[0], adapter.vocab_size
    dev = hidden.device
    topk = adapter.masks.row_topk  # (each row's highest bounds: the pass the adapter bound)
    lo, hi, hnorm, finite, one_sided = start.lo, start.hi, start.hnorm, start.finite, start.one_sided
    values, scored = start.values, start.scored
    certified = torch.zeros(R, dtype=torch.bool, device=dev)
    winner = torch.zeros(R, dtype=torch.long, device=dev)
    over_budget = torch.zeros(R, dtype=torch.bool, device=dev)
    # the results, all R rows: a row's are written once, when it leaves the loop (out_values is
    # values itself until the first rows leave)
    out_values, out_certified, out_winner = values, certified.clone(), winner.clone()
    out_over, all_finite = over_budget.clone(), finite
    live = torch.arange(R, device=dev)  # the rows in the loop (indices into the R rows)

    def add(ids: torch.Tensor) -> None:
        adapter.score_columns(hidden, hnorm, ids, values, lo, hi, scored, masked)

    def leave(rows: torch.Tensor, yhi: torch.Tensor | None) -> None:
        # the rows ``rows`` ([n] bool over the live rows) leave the loop in this round: results
        # out; a certified row's values masked with this round's drops (yhi: its upper bounds
        # after process and the masks; None in a column-only round: mapped here)
        idx = live[rows]
        out_certified[idx], out_winner[idx], out_over[idx] = certified[rows], winner[rows], over_budget[rows]
        done = rows & certified
        if bool(done.any()):
            r = done.nonzero().squeeze(1)
            s_idx = scored.nonzero().squeeze(1)
            if yhi is not None:
                up = rows_of(yhi, r)[:, s_idx]
            else:  # (lo, hi are this round's: no column was scored after its map)
                up = columns(rows_of(lo, r)[:, s_idx], rows_of(hi, r)[:, s_idx], rows_of(live, r))[1]
            _finish_rows(out_values, rows_of(live, r), s_idx, rows_of(values, r),
                         None if masked is None else rows_of(masked, r), up)

    if one_sided and bool(finite.any()):
        add(topk(hi[finite], min(FIRST_GUESS, V)).indices.unique())
    elif top_p is not None and TOP_P_GUESS and bool((guess := finite & (top_p < 1.0)).any()):
        # top-p rows: their highest upper bounds scored before the first round, which then
        # often certifies (a top-p round is the costly part: masks, queries, certificate over
        # [R, V]); at most a quarter of the budget, shared by the rows
        n = min(TOP_P_GUESS, V, budget // (4 * int(guess.sum())))
        if n > 0:
            add(topk(hi[guess], n).indices.unique())
    elif top_k is not None and bool((guess := finite & (top_k > 0) & (top_k < V)).any()):
        # top-k rows: their TOP_K_GUESS (k + 1) highest upper bounds scored before the first round
        # (the k + 1 are what the focus scores after a round anyway: they decide what top-k
        # certainly keeps, and the draw's winner is a kept token; the extra ones what the k-th
        # exact value must rise above for the others to be certainly dropped), so the first round
        # usually certifies; their union within a quarter of the budget (else k + 1 only)
        count = _focus_counts(top_k, None, torch.zeros_like(top_k), V).masked_fill(~guess, 0)
        for c in ((count * TOP_K_GUESS).clamp_(max=V), count):
            first = torch.zeros(V, dtype=torch.bool, device=dev)
            _focus(first, hi, c, guess, scored, topk)
            ids = first.nonzero().squeeze(1)
            if ids.numel() <= budget // 4:
                add(ids)
                break
    narrow = None  # (columns, ruled-out summaries): the rounds after the one that set it, elementwise
    stuck = torch.zeros(R, dtype=torch.long, device=dev)  # top-p rows: rounds with every contender scored
    masks = Masks(min_p, top_k, top_p, V, adapter.masks)
    asked = None  # top-p rows: the tokens whose decisions the draw's certificate needed so far
    by_query = None  # top-p rows: the last round's queries (TopPQueries), narrowed to the next round's bounds
    for rnd in range(MAX_ROUNDS + 1):
        rows = None if live.numel() == R else live
        if narrow is not None and columns is not None:
            # a later round, elementwise and no masks: only the contenders of the round that set
            # narrow are read, and with a per-row map they can be mapped alone (no [n, V] pass)
            cols_n, rest = narrow
            ylo_c, yhi_c = columns(lo.index_select(1, cols_n), hi.index_select(1, cols_n), rows)
            cert = certify_columns(ylo_c, yhi_c, seeds, greedy, cols_n, rest, V, adapter.draw)
            ylo = yhi = None  # (not mapped on every column this round: mapped below where read)
            by_query = None
        else:
            # top-p rows: first decided on their likely winners only, then on the draw's contenders
            # that this leaves (nucleus.top_p_queries docstring); the rest stays
            # undecided, which the certificate allows for any token that cannot win
            # (asked: the previous round's contenders, which bounds that only tighten rarely add to)
            ylo, yhi, by_query = masks.round_bounds(*process(lo, hi, rows), ~certified, by_query, asked)
            if narrow is None:  # (with the summary a later round may go on from: below)
                cert = certify_draw_packed(ylo, yhi, seeds, greedy, adapter.draw, summary=elementwise and masks.off)
            else:
                cert = certify_columns(ylo[:, narrow[0]], yhi[:, narrow[0]], seeds, greedy, *narrow, V, adapter.draw)
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
            if bool(redo.any()):
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
                cert = _recertify(cert, ylo, yhi, seeds, greedy, ridx, adapter.draw)
                wanted = _wanted(cert)
            asked = wanted if asked is None else wanted | asked
        now = cert.certified & finite & scored[cert.winner] & ~certified
        winner = torch.where(now, cert.winner, winner)
        certified |= now
        span = None if narrow is None else narrow[0]  # contenders lie in these columns only
        open_rows = finite & ~certified & ~over_budget
        need = any_columns(cert.contenders, open_rows, span)  # (the open rows' contenders)
        if narrow is None and elementwise and masks.off and bool((cert.finite | ~finite).all()):
            # (a round over every column with no masks on the rows in the loop: the rounds after
            # it read the open rows' contenders only, the rest of each row summarised)
            cols = need.nonzero().squeeze(1)
            narrow = (cols, cert.rest) if cols.numel() else None
        need &= ~scored
        # rows where no token is certainly kept yet (e.g. min-p / top-p undecided on screen
        # bounds): score their highest upper bounds first
        blind = open_rows & ~cert.finite
        if bool(blind.any()):  # (the full pass only when some row may be blind)
            if yhi is None:  # (a narrow round: the full map, for these rows' highest upper bounds)
                ylo, yhi = process(lo, hi, rows)
            blind &= any_(yhi > -math.inf, 1)
        if bool(blind.any()):
            top = topk(yhi[blind], min(FIRST_GUESS, V))
            need[top.indices[top.values > -math.inf]] = True
            need &= ~scored
            cert.contenders[blind] = False
            cert.contenders[blind.nonzero().squeeze(1)[:, None], top.indices] = top.values > -math.inf
            span = None  # (contenders outside the narrow columns now)
        if masks.top_k_on or masks.top_p_on:
            rows_f = open_rows & ~blind
            if masks.top_p_on:  # top-p rows with no contender left to score: stuck on masses
                stuck += rows_f & (top_p < 1.0) & ~any_(cert.contenders & ~scored[None], 1)
            _focus(need, hi, _focus_counts(top_k, top_p, stuck, V), rows_f, scored, topk)
        if not bool(any_(need)) or rnd == MAX_ROUNDS:
            break
        new, over_budget = next_columns(need, cert.contenders, scored, open_rows, over_budget, budget)
        if new is None:
            break
        keep = finite & ~certified & ~over_budget
        if not bool(keep.all()):
            # rows certified (or over budget) in this round leave: the next rounds, and the
            # scoring of their columns, run on the open rows only
            leave(~keep, yhi)
            k = keep.nonzero().squeeze(1)
            live, hidden, hnorm, lo, hi, values, seeds, greedy, finite, certified, winner, over_budget, stuck = (
                rows_of(t, k) for t in (live, hidden, hnorm, lo, hi, values, seeds, greedy, finite, certified,
                                        winner, over_budget, stuck))
            masked, asked, min_p, top_k, top_p = (None if t is None else rows_of(t, k)
                                                  for t in (masked, asked, min_p, top_k, top_p))
            masks = Masks(min_p, top_k, top_p, V, adapter.masks)
            by_query = None  # (its lists are the old rows': a new one for these)
            narrow = None if narrow is None else (narrow[0], narrow[1].rows(k))
        add(new)
    open_rows = finite & ~certified & ~over_budget
    cont, unscored = (cert.contenders, ~scored) if span is None else (cert.contenders[:, span], ~scored[span])
    over_budget |= open_rows & any_(cont & unscored[None], 1)  # still waiting for room
    leave(torch.ones_like(certified), yhi)
    return RowsResult(out_values, out_certified, out_winner, reasons(out_certified, all_finite, out_over),
                      int(scored.sum()))


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
           scored: torch.Tensor, topk=row_topk) -> None:
    """Add to ``need`` (``[V]`` bool, in place) the unscored tokens among the ``count[r]`` highest
    ``yhi`` of each row ``r`` of ``rows`` (``[R]`` bool; ``topk``: :func:`~vllm_csv.ops.topk.row_topk`
    or the adapter's bound one)."""
    on = rows & (count > 0)
    if not bool(on.any()):
        return
    c = count[on]
    top = topk(yhi[on], int(c.max()))
    take = (torch.arange(top.indices.shape[1], device=yhi.device)[None] < c[:, None]) & (top.values > -math.inf)
    ids = top.indices[take]
    need[ids[~scored[ids]]] = True


def _recertify(cert: DrawCertificate, ylo: torch.Tensor, yhi: torch.Tensor, seeds: torch.Tensor,
               greedy: torch.Tensor, rows: torch.Tensor, ops: DrawOps = PER_CALL) -> DrawCertificate:
    """``cert`` with the rows ``rows`` certified again on ``ylo, yhi`` (the others kept)."""
    sub = certify_draw_packed(rows_of(ylo, rows), rows_of(yhi, rows), seeds[rows], greedy[rows], ops)
    for name in ("winner", "certified", "contenders", "finite", "bar", "absmax", "hmax"):
        getattr(cert, name)[rows] = getattr(sub, name)
    return cert


def _wanted(cert: DrawCertificate) -> torch.Tensor:
    """``[R, V]`` bool: the tokens whose top-p decisions a row's certificate reads: its
    contenders, every token where it had no certainly kept token to start from."""
    out = cert.contenders.clone()
    if not bool(cert.finite.all()):  # (a row-indexed write: torch.where over [R, V] is a scalar loop here)
        out[(~cert.finite).nonzero().squeeze(1)] = True
    return out
