"""vLLM's top-p on bounds, every token decided: the tokens ``apply_top_k_top_p_pytorch`` certainly
keeps or drops.

Bounds in and out as :mod:`vllm_csv.sampling.nucleus` says (dropped: ``-inf`` on both sides;
undecided: ``ylo = -inf``). Deciding chosen tokens only is :mod:`.top_p_queries`, on the same
sums and cuts (:func:`decide_on_sums`, :func:`top_p_cuts`).

top-p (``apply_top_k_top_p_pytorch``): sorted ascending, token ``i`` is dropped iff the
fp32 cumulative sum of probabilities up to and including it is ``<= 1 - p`` (the largest is
always kept). In real arithmetic that sum is ``1 - A_i``, ``A_i`` the mass of the tokens
sorted after ``i``: ``A_i = N / (N + R)`` with ``N = sum_{after} e^{y_j}``, ``R`` the rest
(``i`` included); ``A`` increases with ``N`` and decreases with ``R``. Tokens that may sort
after ``i`` are those with ``yhi_j >= ylo_i`` (ties included), those that must are those with
``ylo_j > yhi_i``; so ``A_hi = N_hi / (N_hi + R_lo)`` with ``N_hi`` the upper masses of the
first set and ``R_lo`` the lower masses of the others (``i`` included), and
``A_lo = N_lo / (N_lo + R_hi)`` likewise.

top-p's rounding (:func:`top_p_cuts`). vLLM drops ``i`` iff its computed ``C_i <= fl(1 - p)``,
``C_i = 1 - A_i`` in real arithmetic. Every term of that sum is positive and every rounding
in it relative (but for underflow), so the computed sum is within a *relative* ``rho`` of
the real one: with ``m`` the row's maximum, ``exp(fl(y_j - m))`` is within ``a = 256u`` of
``e^(y_j - m)`` (the subtraction moves the argument by at most ``u |y_j - m| <= 88u`` while the
result is a normal float; the vectorised ``exp``, at most 64 ulps), their sum (any order) within
``gamma_V``, the reciprocal and the product within ``u`` each, and the cumulative sum (any
order; fp32, or double and one rounding) within ``gamma_V`` and ``u``: ``1 + rho_up =
(1 + a)(1 + u)^3 (1 + gamma_V) / ((1 - a)(1 - gamma_V))``, ``1 - rho_dn`` likewise; underflow
adds at most ``tau = 2^-90`` in all. ``fl(1 - p)`` is within ``u (1 - p)`` of ``q = 1 - p``. So
``i`` is dropped if ``(1 - A_lo)(1 + rho_up) + tau < q (1 - u)`` and kept if ``(1 - A_hi)(1 - rho_dn)
- tau > q (1 + u)``: the margin is relative to ``q`` (``2 gamma_V q`` at first order, a tenth of
``2 gamma_V`` at ``p = 0.9``), as the sums compared are near ``q``. Kept if ``A_hi < p_keep``,
dropped if ``A_lo > p_drop``, each moved by ``1e-9`` more for the float64 evaluation of ``A``.

The tail (top-p, the cost): sorting all ``V`` tokens per row is what vLLM itself does, and
most of them are far out of the nucleus. With ``t = ylo_k``, the ``k``-th highest lower
bound, the ``k`` tokens of highest lower bounds sort after every ``j`` with ``yhi_j < t``
(strictly), so ``A_j >= N / (N + tot_h - H)`` (:func:`_tail_bound`: ``N`` their lower
masses, ``H`` their upper masses, ``tot_h - H`` the upper mass of all the rest, ``j``
included). If that exceeds ``p_drop`` for some ``k <=`` :data:`TAIL_SCAN` (or, past those, at a
``t`` on a grid below the scan, :func:`_grid_tail`: the bound holds for any real ``t``), every token with
``yhi_j < t`` is dropped as a block (the smallest such ``k``: the highest ``t``). The others
(``yhi_i >= t``) are decided as above over themselves, the tail's masses added where they may
count: a tail token may sort after ``i`` unless ``ylo_i >= t``, so ``N_hi`` gains the tail's
upper mass if ``ylo_i < t`` and ``R_lo`` its lower mass otherwise; it never must sort after
``i`` (``ylo_j <= yhi_j < t <= yhi_i``), so ``N_lo`` gains nothing and ``R_hi`` its upper
mass. Each bound is the one of the whole row with the tail's terms bounded, so decisions stay
sound; only tokens with ``ylo_i < t <= yhi_i`` may be left undecided more often.

Underflow in the masses. The masses are float64 ``e^(y - c)``, ``c`` at least every ``yhi`` of
the row: a term below ``2^-1022`` is subnormal or 0, off by a few ``2^-1074`` (normal terms are
within the relative slack above), so a sum of at most ``2^31`` of them is within
``UNDERFLOW = 2^-1000`` of the real one on that count. Each upper sum (``n_hi``, ``r_hi``, the
rest of the tail bound) is raised by it and each lower sum (``r_lo``, ``n_lo``, the tail's ``N``)
lowered (at 0) before the ratios. Without it a row whose masses all underflowed (bounds 745
apart or more: a screen's interval after a temperature of 0.01, or a shift ``c`` left from an
earlier round, :meth:`~.top_p_queries.TopPQueries.narrowed`) read ``n_hi = 0`` as "no token may sort after
``i``", ``A = 0``, and kept ``i``: two tokens tied far below ``c``, one of which vLLM's top-p drops
(the sort order of ties decides which), were both kept, and the draw could return the dropped
one (found by ``vllm_csv.testing.audit_sampler``: family ``near_tie``, seed 7716, bf16, temperature
0.01, top-p 0.3).

The outside blocks (:class:`~vllm_csv.sampling.outside.Outside`, tensor parallelism; min-p
before top-p may have forgotten a block's lower side, :mod:`.min_p`). Each block's masses
(``e^lel``, ``e^leh``, shifted like the others) enter ``tot_h`` (the tail bound's "upper mass
of all the rest") and every token's four sums as the tail's do, with the block's own
threshold: every block token has ``yhi_j <= hi``, so it sorts before ``i`` when ``ylo_i > hi``
(strictly: ties may sort either way), and may sort after it otherwise; it never must. A block
whose ``hi`` is below a dropped tail's ``t`` is dropped with the tail. Block tokens are never
certainly kept (their lower bounds are not known one by one).
"""

from __future__ import annotations

import math

import torch

from ...fp import FP32_UNIT_ROUNDOFF as _U, gamma
from ...ops.bools import any_
from ...ops.gather import put_rows, rows_of
from ..outside import Outside

TAIL_SCAN = 256  # highest lower bounds scanned one by one for the tail threshold (top-p)
BISECT_STEPS = 12  # then 2^12 thresholds below the scan, for rows with broad nuclei (_grid_tail)
COMPACT_BELOW = 0.5  # decide on the columns not -inf in every row when fewer than this share (TP rows)
# top-p: what underflow may take from a float64 sum of shifted masses, absolutely (module docstring,
# "underflow in the masses")
UNDERFLOW = 2.0**-1000


def has_top_p(top_p: torch.Tensor) -> torch.Tensor:
    """``[R]`` bool: the rows with a top-p (``top_p < 1``)."""
    return top_p < 1.0


def _tagged_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys of ``x = [lo | hi]`` (``[r, 2n]`` float32) whose order is the values' order with
    every lower bound before every upper bound of equal value: the float's bits made
    order-preserving (``-0.0`` made ``+0.0`` first: they are equal), times 2, plus 1 for the
    upper half. (An unstable int64 sort of these is faster than a stable float sort.)"""
    bits = (x + 0.0).view(torch.int32)  # -0.0 + 0.0 = +0.0
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long() * 2
    key[:, x.shape[1] // 2:] += 1
    return key


def _masses(lo: torch.Tensor, hi: torch.Tensor, el: torch.Tensor, eh: torch.Tensor):
    """For every token ``i`` of ``[r, n]`` float64 bounds (``el = e^lo``, ``eh = e^hi``, shifted):
    ``(n_hi, r_lo, n_lo, r_hi)`` = upper masses of the tokens that may sort after ``i``
    (``hi_j >= lo_i``, ``j != i``), lower masses of the others (``i`` included), lower masses
    of the tokens that must sort after it (``lo_j > hi_i``), upper masses of the others.

    One stable sort of the ``2n`` bounds together, lower bounds first: among equal values
    every lower bound precedes every upper bound, so at token ``i``'s lower bound the upper
    bounds before it are exactly those with ``hi_j < lo_i``, and at its upper bound the lower
    bounds before it are exactly those with ``lo_j <= hi_i``. (The bounds are fp32 values:
    the sort runs on fp32 values, the masses in float64.)"""
    r, n = lo.shape
    order = _tagged_keys(torch.cat([lo, hi], 1).float()).sort(dim=1).indices
    is_hi = order >= n
    tok = order - n * is_hi  # the token of each sorted bound
    zero = torch.zeros((), dtype=lo.dtype, device=lo.device)
    # prefix sums, exclusive, of the masses of upper bounds (eh, el) and lower bounds (el, eh)
    pre = []
    for src, mask in ((eh, is_hi), (el, is_hi), (el, ~is_hi), (eh, ~is_hi)):
        w = torch.where(mask, src.gather(1, tok), zero)
        pre.append(w.cumsum(1) - w)
    back = torch.empty((r, 2 * n), dtype=lo.dtype, device=lo.device)

    def at(x, hi_side):  # prefix values at each token's lower (or upper) bound
        return back.scatter(1, order, x)[:, n:] if hi_side else back.scatter(1, order, x)[:, :n]
    below_h, below_l = at(pre[0], False), at(pre[1], False)  # over hi_j < lo_i
    upto_l, upto_h = at(pre[2], True), at(pre[3], True)  # over lo_j <= hi_i (i included: lo_i comes first)
    n_lo = (el.sum(1, keepdim=True) - upto_l).clamp_min(0)
    return (eh.sum(1, keepdim=True) - below_h - eh).clamp_min(0), el + below_l, n_lo, upto_h


def top_p_cuts(p: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p_keep, p_drop)``, float64 like ``p`` (the rows' ``top_p``): a token whose mass sorted
    after it is certainly ``< p_keep`` is kept by vLLM's top-p over ``n`` tokens, one whose mass
    is certainly ``> p_drop`` is dropped (module docstring, "top-p's rounding")."""
    u, g, a, tau, slack = _U, gamma(n), 256 * _U, 2.0**-90, 1e-9
    rho_up = (1 + a) * (1 + u) ** 3 * (1 + g) / ((1 - a) * (1 - g)) - 1
    rho_dn = 1 - (1 - a) * (1 - u) ** 3 * (1 - g) / ((1 + a) * (1 + g))
    q = 1.0 - p
    p_drop = 1.0 - (q * (1 - u) - tau) / (1 + rho_up) + slack
    p_keep = 1.0 - (q * (1 + u) + tau) / (1 - rho_dn) - slack
    return p_keep, p_drop


def decide_on_sums(n_hi, r_lo, n_lo, r_hi, lo, p_keep, p_drop):
    """``(keep, drop)``: ``A_hi < p_keep`` (and ``lo`` finite), ``A_lo > p_drop``, each sum moved
    by :data:`UNDERFLOW` its safe way first (module docstring, "underflow in the masses": a sum
    that underflowed to 0 is not "no token", so no 0/0 is read as ``A = 0``)."""
    n_hi, r_hi = n_hi + UNDERFLOW, r_hi + UNDERFLOW
    r_lo, n_lo = (r_lo - UNDERFLOW).clamp_min(0), (n_lo - UNDERFLOW).clamp_min(0)
    return (n_hi / (n_hi + r_lo) < p_keep) & (lo > -math.inf), n_lo / (n_lo + r_hi) > p_drop


def _tail_bound(n_top: torch.Tensor, h_top: torch.Tensor, tot_h: torch.Tensor) -> torch.Tensor:
    """Lower bound on ``A_j`` for every ``j`` below the ``k``-th highest lower bound, per ``k``:
    ``N / (N + tot_h - H)`` (module docstring, "the tail"), ``N`` lowered and the rest raised by
    :data:`UNDERFLOW` ("underflow in the masses")."""
    n = (n_top - UNDERFLOW).clamp_min(0)
    return n / (n + (tot_h - h_top).clamp_min(0) + UNDERFLOW)


def _decide_packed(lo, hi, el, eh, t, p_keep, p_drop, block=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep, drop)`` ``[r, V]``: the tail ``yhi < t`` dropped, the other tokens packed into
    ``[r, n]`` (``-inf`` padding: no mass) and decided with the tail's masses added where they
    may count (module docstring, "the tail"), and the outside blocks' (``block = (hi, lower
    lower bound, lower mass, upper mass)``, each ``[r, L]``, module docstring, "the outside blocks")."""
    r, V = lo.shape
    tail = hi < t[:, None]
    head = ~tail & (hi > -math.inf)
    n = int(head.sum(1).max())
    drop = tail
    if n == 0:
        return torch.zeros_like(tail), drop
    pos = head.cumsum(1).sub_(1).masked_fill_(~head, n)  # column in the packed rows; n: discarded
    cols = torch.full((r, n + 1), V, dtype=torch.long, device=lo.device)
    cols.scatter_(1, pos, torch.arange(V, device=lo.device).expand(r, V))
    cols = cols[:, :n]  # V: padding
    valid = cols < V
    gcols = cols.clamp_max(V - 1)
    plo = lo.gather(1, gcols).masked_fill_(~valid, -math.inf)
    phi = hi.gather(1, gcols).masked_fill_(~valid, -math.inf)
    pel, peh = el.gather(1, gcols).masked_fill_(~valid, 0), eh.gather(1, gcols).masked_fill_(~valid, 0)
    tail_l = (el * tail).sum(1, keepdim=True)
    tail_h = (eh * tail).sum(1, keepdim=True)
    n_hi, r_lo, n_lo, r_hi = _masses(plo, phi, pel, peh)
    above = plo >= t[:, None]  # the whole tail sorts before i
    n_hi = n_hi + torch.where(above, 0.0, tail_h)
    r_lo = r_lo + torch.where(above, tail_l, 0.0)
    r_hi = r_hi + tail_h
    if block is not None:
        bhi, blo, bel, beh = (x[:, None, :] for x in block)  # [r, 1, L]
        before = plo[:, :, None] > bhi  # every block token has yhi_j <= bhi < ylo_i: sorts before i
        after = blo > phi[:, :, None]  # every block token has ylo_j >= blo > yhi_i: sorts after i
        n_hi = n_hi + torch.where(before, 0.0, beh).sum(2)
        r_lo = r_lo + torch.where(before, bel, 0.0).sum(2)
        n_lo = n_lo + torch.where(after, bel, 0.0).sum(2)
        r_hi = r_hi + torch.where(after, 0.0, beh).sum(2)
    k, d = decide_on_sums(n_hi, r_lo, n_lo, r_hi, plo, p_keep, p_drop)
    wide = torch.zeros((r, V + 1), dtype=torch.bool, device=lo.device)  # column V: padding
    return wide.scatter(1, cols, k)[:, :V], drop | wide.scatter(1, cols, d)[:, :V]


def _grid_tail(lo, el, eh, tot_h, need, upper) -> torch.Tensor:
    """Per row, a ``t < upper`` at which the tail bound exceeds ``need``, ``-inf`` where none is
    found: the highest of ``2^BISECT_STEPS`` evenly spaced thresholds ``m_k = a + k w`` from
    ``a`` (below every finite lower bound) up to ``upper``, the resolution of that many
    bisection steps, all checked from one histogram of the lower bounds (two scatter-adds, where
    bisection took three ``[r, V]`` passes a step).

    ``N``, ``H`` at ``m_k`` are counted over the tokens of bin ``>= k`` only, a token's bin
    taken one below ``floor((ylo - a) / w)``: each counted token has ``ylo >= m_k`` with a bin's
    width to spare against the rounding of the bin and of ``m_k``. A token left out only lowers
    the bound (fewer tokens known to sort after ``j``: ``N`` smaller, the rest's mass larger),
    so the bound at ``m_k`` holds (module docstring, "the tail"). Rows where the width is not
    well above the rounding of ``a`` and ``upper`` (or not finite) get ``-inf``.

    Parameters
    ----------
    lo, el, eh : torch.Tensor
        ``[r, V]`` float64: lower bounds, lower and upper masses (shifted).
    tot_h, need : torch.Tensor
        ``[r, 1]`` float64.
    upper : torch.Tensor
        ``[r]`` float64, the lowest lower bound the scan reached.

    Returns
    -------
    torch.Tensor
        ``[r]`` float64.
    """
    nb = 1 << BISECT_STEPS
    fin = lo > -math.inf  # (NaN: not counted)
    a = lo.masked_fill(~fin, math.inf).amin(1) - 1.0
    w = (upper - a) / nb
    scale = torch.maximum(torch.maximum(a.abs(), upper.abs()), torch.ones_like(a))
    usable = torch.isfinite(a) & torch.isfinite(upper) & (w > 1e-9 * scale)
    w = torch.where(usable, w, torch.ones_like(w))
    a0 = torch.where(usable, a, torch.zeros_like(a))
    q = ((lo - a0[:, None]) / w[:, None]).floor_().sub_(1.0).clamp_(-1.0, nb - 1.0)  # -inf lo: -1
    q = q.masked_fill_(~fin, -1.0).add_(1.0).long()  # column 0: counted nowhere
    r = lo.shape[0]
    bins_n = torch.zeros((r, nb + 1), dtype=lo.dtype, device=lo.device).scatter_add_(1, q, el.masked_fill(~fin, 0.0))
    bins_h = torch.zeros((r, nb + 1), dtype=lo.dtype, device=lo.device).scatter_add_(1, q, eh.masked_fill(~fin, 0.0))
    n = bins_n[:, 1:].flip(1).cumsum(1).flip(1)  # [r, nb]: over the tokens of bin >= k
    h = bins_h[:, 1:].flip(1).cumsum(1).flip(1)
    m = a0[:, None] + torch.arange(nb, dtype=lo.dtype, device=lo.device)[None] * w[:, None]
    ok = (_tail_bound(n, h, tot_h) > need) & usable[:, None] & (m < upper[:, None])
    k = nb - 1 - ok.flip(1).to(torch.uint8).argmax(1)  # the highest k that passes
    return torch.where(ok.any(1), m.gather(1, k[:, None]).squeeze(1), torch.full_like(a, -math.inf))


def _live_columns(hi: torch.Tensor) -> torch.Tensor | None:
    """The columns of ``hi [r, V]`` to decide on, or ``None`` for all: under tensor parallelism
    the rows are ``-inf`` but for the explicit tokens (:mod:`~vllm_csv.sampling.sharded_rows`). A column whose
    ``yhi`` is ``-inf`` in every row has no mass, is never kept and stays ``-inf``; leaving it
    out changes no decision so long as at least ``TAIL_SCAN + 1`` columns stay (the tail scan
    and its grid below them then see the same ``TAIL_SCAN`` highest lower bounds, ``-inf`` included)."""
    V = hi.shape[1]
    live = any_(hi != -math.inf, 0)  # (NaN stays)
    n = int(live.sum())
    if n >= COMPACT_BELOW * V:
        return None
    short = min(TAIL_SCAN + 1, V) - n
    if short > 0:
        live[(~live).nonzero().squeeze(1)[:short]] = True
    return live.nonzero().squeeze(1)


def top_p_bounds(ylo: torch.Tensor, yhi: torch.Tensor, top_p: torch.Tensor, outside: Outside | None = None,
                 row_length: int | None = None):
    """Apply top-p (``[R]`` float32, ``1`` = off) to bounds; see the module docstring.
    Returns ``(ylo, yhi)``, or ``(ylo, yhi, outside)`` when an outside block is given (see
    "the outside blocks" in the module docstring). ``row_length``: the length of the rows vLLM
    sums over, where ``ylo, yhi`` hold some of their columns only (every other token certainly
    ``-inf``, so of mass 0: it changes no sum, only how many terms vLLM's rounding counts);
    default ``ylo``'s width."""
    on = has_top_p(top_p)
    if not bool(on.any()):
        return (ylo, yhi) if outside is None else (ylo, yhi, outside)
    rows = on.nonzero().squeeze(1)
    ylo_r, yhi_r = rows_of(ylo, rows), rows_of(yhi, rows)
    lo, hi = ylo_r.double(), yhi_r.double()
    ob = None if outside is None else outside.rows(rows)
    r, V_row = lo.shape
    cols = _live_columns(hi)
    if cols is not None:
        lo, hi = lo[:, cols], hi[:, cols]
    V = lo.shape[1]
    c = hi.masked_fill(hi == math.inf, -math.inf).amax(1, keepdim=True)
    if ob is not None:
        c = torch.maximum(c, ob.hi.masked_fill(ob.hi == math.inf, -math.inf).amax(1, keepdim=True))
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    el, eh = torch.exp(lo - c), torch.exp(hi - c)  # -inf -> 0
    p_keep, p_drop = top_p_cuts(top_p[rows].double()[:, None], row_length or V_row)  # vLLM sums over the whole row
    tot_h = eh.sum(1, keepdim=True)
    if ob is not None:  # the blocks' masses [r, L], shifted like the others
        b_el, b_eh = torch.exp(ob.lel - c), torch.exp(ob.leh - c)
        tot_h = tot_h + b_eh.sum(1, keepdim=True)
    # the tail: tokens certainly dropped as a block (module docstring, "the tail")
    t = torch.full((r,), -math.inf, dtype=lo.dtype, device=lo.device)
    scan = min(TAIL_SCAN, V)
    if scan > 0:  # the highest TAIL_SCAN lower bounds, one at a time
        vals, idx = lo.topk(scan, dim=1)
        n_top = el.gather(1, idx).cumsum(1)
        h_top = eh.gather(1, idx).cumsum(1)
        ok = (_tail_bound(n_top, h_top, tot_h) > p_drop) & (vals > -math.inf)
        first = vals.gather(1, ok.to(torch.uint8).argmax(1, keepdim=True)).squeeze(1)  # smallest k: highest t
        t = torch.where(ok.any(1), first, t)
        todo = (t == -math.inf).nonzero().squeeze(1)
        if todo.numel() and scan < V and BISECT_STEPS:  # broad nuclei: thresholds on a grid below the scan
            t[todo] = _grid_tail(lo[todo], el[todo], eh[todo], tot_h[todo], p_drop[todo], vals[todo, -1])
    keep = torch.zeros_like(lo, dtype=torch.bool)
    drop = torch.zeros_like(keep)
    for i in range(r):  # one row at a time: packed widths differ widely between rows
        s = slice(i, i + 1)
        block = None if ob is None else (ob.hi[s], ob.lo[s], b_el[s], b_eh[s])
        keep[s], drop[s] = _decide_packed(lo[s], hi[s], el[s], eh[s], t[s], p_keep[s], p_drop[s], block)
    if cols is not None:
        keep = torch.zeros((r, V_row), dtype=torch.bool, device=lo.device).index_copy_(1, cols, keep)
        drop = torch.ones((r, V_row), dtype=torch.bool, device=lo.device).index_copy_(1, cols, drop)
    out_lo = put_rows(ylo, rows, torch.where(keep, ylo_r, -math.inf))
    out_hi = put_rows(yhi, rows, torch.where(drop, -math.inf, yhi_r))
    if outside is None:
        return out_lo, out_hi
    # a block below the dropped tail's threshold is dropped with it (every yhi_j <= hi < t)
    return out_lo, out_hi, outside.put(rows, ob.drop(ob.hi < t[:, None]))
