"""Bounds on the draw's inputs after vLLM's min-p, top-k and top-p masks.

Input: ``ylo <= y <= yhi`` (fp32, ``[R, V]``, ``-inf`` for masked tokens) on the values after
temperature. Output: the same bounds after the mask, sound for every ``y`` in the box:
a token certainly dropped gets ``-inf`` on both sides, a token certainly kept keeps its
bounds, an undecided one gets ``ylo = -inf`` (it may be dropped) and keeps ``yhi``.
The draw certificate (:mod:`.certificate`) then only certifies a winner that is certainly
kept and beats every token that may be kept.

min-p (``MinPLogitsProcessor``): token ``i`` is dropped iff ``p_i < p_max * min_p`` with
``p = softmax(y)`` in fp32, i.e. (real arithmetic) iff ``y_i - m < log(min_p)``, ``m = max y``.
vLLM's fp32 evaluation (``y - m``, ``exp``, the division by the sum, the product with
``min_p``) moves ``log(p_i / (p_max min_p))`` by at most ``8u + u(|y_i| + |m|)`` (``u = 2^-24``)
while nothing underflows; we decide with the margin ``1e-5 + 2^-21 (|y_i| + |m|)``, and
certify nothing for ``min_p < 1e-20`` (its threshold could be subnormal).
``m`` lies in ``[max ylo, max yhi]``. One margin serves the whole row (:func:`min_p_bounds`):
``|y_i|`` and ``|m|`` are replaced by ``A = max(|max yhi|, -least finite ylo, -least finite
yhi, 0)`` (``row_stats``' ``absmax``), at least ``|y_i|`` for every token whose lower bound is
finite and at least ``|max ylo|`` (a token whose lower bound is ``-inf`` is never dropped); the thresholds ``max yhi + log(min_p) + eps`` (keep: ``ylo_i >=``) and
``max ylo + log(min_p) - eps`` (drop: ``yhi_i <``) are evaluated in float64 and rounded outwards
to fp32, so each token costs one fp32 comparison. (The float64 rounding of a threshold,
``< 2^-51 (A + 50)``, and of ``log``, is far inside the margin's slack over vLLM's error:
``1e-5 - 8u`` and ``(2^-21 - 2^-24)(|y_i| + |m|)``.)

min-p on part of the row (:func:`min_p_drops_on_part`, tensor parallelism: a rank sees its
shard only). The part's ``m0 = max ylo`` over it is at most ``m``. Token ``i`` is dropped
for every ``m >= m0`` once ``yhi_i - m0 < log(min_p) - eps`` with ``eps`` as above, ``|m|``
replaced by ``ym0 >= |m0|``: what vLLM's evaluation must keep below 0,
``yhi_i - m - log(min_p) + 8u + u(|y_i| + |m|)``, does not grow with ``m`` (its
``u |m| - m`` has slope ``-1 +- u``), and it is below 0 at ``m0``.

top-p (``apply_top_k_top_p_pytorch``): sorted ascending, token ``i`` is dropped iff the
fp32 cumulative sum of probabilities up to and including it is ``<= 1 - p`` (the largest is
always kept). In real arithmetic that sum is ``1 - A_i``, ``A_i`` the mass of the tokens
sorted after ``i``: ``A_i = N / (N + R)`` with ``N = sum_{after} e^{y_j}``, ``R`` the rest
(``i`` included); ``A`` increases with ``N`` and decreases with ``R``. Tokens that may sort
after ``i`` are those with ``yhi_j >= ylo_i`` (ties included), those that must are those with
``ylo_j > yhi_i``; so ``A_hi = N_hi / (N_hi + R_lo)`` with ``N_hi`` the upper masses of the
first set and ``R_lo`` the lower masses of the others (``i`` included), and
``A_lo = N_lo / (N_lo + R_hi)`` likewise.

top-p's rounding (:func:`_top_p_cuts`). vLLM drops ``i`` iff its computed ``C_i <= fl(1 - p)``,
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
earlier round, :meth:`TopPQueries.narrowed`) read ``n_hi = 0`` as "no token may sort after
``i``", ``A = 0``, and kept ``i``: two tokens tied far below ``c``, one of which vLLM's top-p drops
(the sort order of ties decides which), were both kept, and the draw could return the dropped
one (found by ``vllm_csv.testing.audit_sampler``: family ``near_tie``, seed 7716, bf16, temperature
0.01, top-p 0.3).

Deciding some tokens only (:class:`TopPQueries`). Leaving a token undecided is always sound
(``ylo = -inf``, ``yhi`` kept), and the draw's certificate needs decisions only for its winner and
for the tokens whose noisy upper bound reaches the winner's noisy lower bound (:mod:`.rows` asks
for those: tens of tokens a row, where on a learned head's screen bounds the tail leaves
thousands undecided). Each asked token ``i`` is decided from a list per row, the ``K`` tokens of
highest ``yhi`` (:data:`QUERY_LIST`), and the masses of the tokens off the list summed (``U_h``,
``U_l``): every sum above is bounded by its listed terms and, where the unlisted ones may count,
their whole mass. ``n_hi <=`` the listed ``eh_j`` with ``yhi_j >= ylo_i``, ``j != i``, plus ``U_h``
unless the list is *covered* (its ``K``-th ``yhi`` ``< ylo_i``: then every unlisted token has
``yhi_j < ylo_i``, and ``i`` is listed); ``r_lo >=`` the listed ``el_j`` with ``yhi_j < ylo_i``, plus
``el_i``, plus ``U_l`` where covered; ``n_lo >=`` the listed ``el_j`` with ``ylo_j > yhi_i``; ``r_hi <=``
the listed ``eh_j`` with ``ylo_j <= yhi_i`` (``i`` included) plus ``U_h``. Each is exact where the
unlisted tokens all fall on the side added (covered, or for ``n_lo, r_hi`` the ``K``-th ``yhi <=
yhi_i``). The listed sums are prefix and suffix sums along the list sorted two ways, read at
one binary search per asked token; only ``n_hi``'s is formed by a subtraction (``i``'s own mass),
whose rounding is covered by adding ``2^-40`` of the prefix. The cost: one top-``K`` and two
``exp`` passes per row, then ``O(log K)`` per asked token. Where a list leaves undecided a token
that exact sums might decide (:meth:`TopPQueries.bounds`'s ``settle``), that token is decided on
the four sums over its whole row (:func:`~vllm_csv.ops.masks.top_p_sums`, one pass over the row
per token, the masses ``e^(y - c)`` in float64 as :func:`top_p_bounds` takes them): the
decision the full computation makes with no tail, and no other token of the row is touched.
(Before, such a row was decided again on a list 8x longer, then in full: a sort of ``2V``
bounds per row, about 19 ms a row at ``V`` 65536 on 2 cores, where the sums take about 25 us a
token.) From one round of :mod:`.rows` to the next the bounds only
tighten (checked: :meth:`TopPQueries.narrowed`), so the next round keeps the list's tokens and the
unlisted masses (still bounds of what they bound; the ``K``-th ``yhi`` of the old list still bounds
every unlisted ``yhi``, even where a listed token's exact value fell below it) and re-sorts the
listed bounds only: no top-``K`` and no ``exp`` pass over the row.

top-k (``apply_top_k_only``, or the sorted ``apply_top_k_top_p_pytorch`` when a top-p is set;
both after min-p, and top-p's softmax runs over what top-k kept): token ``i`` is kept iff
``y_i >= y_(k)``, the ``k``-th largest value of the row (ties at it kept), i.e. iff fewer than
``k`` tokens have ``y_j > y_i``. Pure fp32 comparisons of the values the bounds bound: no
margin. Certainly dropped when ``yhi_i < L_k``, the ``k``-th largest ``ylo`` (``k`` tokens are
then certainly above it); certainly kept when ``ylo_i >= H_k`` with ``H_k`` the ``k``-th largest
``yhi`` of the *other* tokens (at most ``k - 1`` of them can then be above it): ``H_k`` of the
row if ``yhi_i < H_k``, else ``H_(k+1)`` (``i`` holds one of the first ``k`` places). Each bound
holds for every ``y`` in the box, ``-inf`` included, so min-p before it and top-p after it
compose as the masks do. (Not under tensor parallelism: block tokens are not counted.)

The outside blocks (:class:`~.outside.Outside`, tensor parallelism: tokens known through
per-row, per-block summaries only, ``-inf`` on both sides in ``ylo, yhi``). min-p: the maximum
``m`` may be a block token, so ``m <= max(max yhi, max hi)``; a block is dropped as a whole
when ``hi - max ylo < log(min_p) - eps_b``, ``eps_b = 1e-5 + 2^-21 (absmax + |m|max)`` (at
least every block token's own margin: ``|y_j| <= absmax``), and kept as a whole when
``lo - m_hi >= log(min_p) + eps_b`` (every token's ``ylo_j >= lo``). A block not kept as a
whole may lose tokens (their ``ylo_j`` becomes ``-inf``, as a single token's does): its lower
mass is then only ``>= 0`` and its smallest lower bound ``-inf`` (``lel = lo = -inf``; its
upper side stays an upper bound), so top-p neither counts its lower mass before a token nor
places it after one. top-p: each block's masses
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

from ..fp import gamma, round_down32, round_up32
from ..ops.bools import all_, any_, flat_nonzero
from ..ops.gather import put_rows, rows_of
from ..ops.masks import min_p_cut, top_k_cut, top_p_sums, unlisted_masses
from ..ops.topk import row_topk
from ..ops.noise import row_stats
from .outside import Outside

_U = 2.0**-24
MIN_P_FLOOR = 1e-20
TAIL_SCAN = 256  # highest lower bounds scanned one by one for the tail threshold (top-p)
BISECT_STEPS = 12  # then 2^12 thresholds below the scan, for rows with broad nuclei (_grid_tail)
DECIDE_FIRST = 16  # TopPQueries: each row's listed tokens of highest lower bound are always decided
QUERY_LIST = 256  # TopPQueries: tokens listed per row (highest upper bounds)
QUERY_MAX = 1024  # TopPQueries: a row asking for more tokens is decided in full (top_p_bounds)
COMPACT_BELOW = 0.5  # decide on the columns not -inf in every row when fewer than this share (TP rows)
# top-p: what underflow may take from a float64 sum of shifted masses, absolutely (module docstring,
# "underflow in the masses")
UNDERFLOW = 2.0**-1000
STALE_SHIFT = 16.0  # TopPQueries.narrowed: a row's shift this far above its new highest yhi: build anew


def _min_p_margin(y_abs: torch.Tensor, m_abs: torch.Tensor) -> torch.Tensor:
    """min-p's decision margin for tokens with ``|y_i| <= y_abs`` when ``|m| <= m_abs`` (float64):
    ``1e-5 + 2^-21 (|y_i| + |m|)``, above vLLM's fp32 error ``8u + u(|y_i| + |m|)`` (module
    docstring)."""
    return 1e-5 + 2.0**-21 * (y_abs + m_abs)


def _min_p_on(min_p: torch.Tensor) -> torch.Tensor:
    return min_p > 0


def _top_k_on(top_k: torch.Tensor, V: int) -> torch.Tensor:
    return (top_k > 0) & (top_k < V)


def _top_p_on(top_p: torch.Tensor) -> torch.Tensor:
    return top_p < 1.0


def all_off(min_p: torch.Tensor | None, top_k: torch.Tensor | None, top_p: torch.Tensor | None, V: int) -> bool:
    """Whether min-p, top-k and top-p (``[R]`` each, as :func:`min_p_bounds`,
    :func:`top_k_bounds`, :func:`top_p_bounds` take them; None: not given) are off on every row:
    then the map from the head's values to the draw's inputs is per token."""
    return not any(bool(on(x).any()) for x, on in ((min_p, _min_p_on), (top_k, lambda k: _top_k_on(k, V)),
                                                  (top_p, _top_p_on)) if x is not None)


def has_top_k(top_k: torch.Tensor, V: int) -> torch.Tensor:
    """``[R]`` bool: the rows with a top-k (``0 < k < V``; a min-p may come before it and a top-p
    after it)."""
    return _top_k_on(top_k, V)


def min_p_bounds(ylo: torch.Tensor, yhi: torch.Tensor, min_p: torch.Tensor, outside: Outside | None = None):
    """Apply min-p (``[R]`` float32, ``0`` = off) to bounds; see the module docstring.
    Returns ``(ylo, yhi)``, or ``(ylo, yhi, outside)`` when an outside block is given (see
    "the outside blocks" in the module docstring).

    Per-row thresholds, one fp32 comparison per token (:func:`~vllm_csv.ops.masks.min_p_cut`).
    A row without min-p keeps its bounds, but for NaN lower bounds, which become ``-inf`` (a
    lower bound still)."""
    on = _min_p_on(min_p)
    if not bool(on.any()) or ylo.shape[1] == 0:
        return (ylo, yhi) if outside is None else (ylo, yhi, outside)
    st = row_stats(ylo, yhi, 1)  # one pass: max ylo, max yhi (NaN if the row has one), A
    mlo, mhi = st.lmax.double(), st.hmax.double()
    if outside is not None:  # a block may hold the maximum: m <= max(max yhi, its hi)
        mhi = torch.maximum(mhi, outside.max_hi())
    # A = max(|max yhi|, -min finite ylo, -min finite yhi, 0) >= |y_i| for every token whose
    # lower bound is finite, and >= |max ylo|
    absmax = st.absmax.double()
    logmp = torch.log(min_p.double().clamp_min(MIN_P_FLOOR))
    ym = torch.maximum(absmax, mhi.abs())
    eps = _min_p_margin(absmax, ym)
    usable = on & (min_p >= MIN_P_FLOOR)
    # kept iff ylo_i >= max yhi + log(min_p) + eps (rounded up to fp32: a larger threshold keeps
    # less); dropped iff yhi_i < max ylo + log(min_p) - eps (rounded down) and ylo_i > -inf. Rows
    # without min-p: every lower bound kept, nothing dropped; unusable rows (min_p below the
    # floor, or a NaN / +inf bound): nothing kept nor dropped.
    keep_at = round_up32(mhi + logmp + eps)
    keep_at = torch.where(usable & (keep_at < math.inf), keep_at, math.nan).masked_fill_(~on, -math.inf)
    drop_at = round_down32(mlo + logmp - eps).masked_fill_(~usable, -math.inf)
    new_lo, new_hi = min_p_cut(ylo, yhi, keep_at, drop_at)
    if outside is None:
        return new_lo, new_hi
    # each block as one token: every y_j <= its hi, lo <= ylo_j and |y_j| <= its absmax
    mlo, mhi, logmp, ym = mlo[:, None], mhi[:, None], logmp[:, None], ym[:, None]
    eps_b = _min_p_margin(outside.absmax, ym)
    drop_b = (outside.hi - mlo) < logmp - eps_b
    keep_b = (outside.lo - mhi) >= logmp + eps_b
    unsure = ~(keep_b & usable[:, None]) & on[:, None]  # may lose tokens: its lower side is unknown
    return new_lo, new_hi, outside.drop(drop_b & (usable & on)[:, None]).forget_lower(unsure)


def min_p_drops_on_part(ylo: torch.Tensor, yhi: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``[R, n]`` bool: tokens of part of each row (``ylo, yhi`` ``[R, n]`` float32, the rest
    of the row unseen) that min-p (``[R]`` float32, ``0`` = off) drops whatever the rest holds
    (module docstring, "min-p on part of the row")."""
    usable = (min_p > 0) & (min_p >= MIN_P_FLOOR)
    if ylo.shape[1] == 0 or not bool(usable.any()):
        return torch.zeros_like(yhi, dtype=torch.bool)
    m0 = ylo.amax(1, keepdim=True).double()
    ym0 = torch.maximum(m0.abs(), yhi.amax(1, keepdim=True).double().abs())
    logmp = torch.log(min_p.double().clamp_min(MIN_P_FLOOR))[:, None]
    eps = _min_p_margin(torch.maximum(ylo.abs(), yhi.abs()).double(), ym0)
    return ((yhi.double() - m0) < logmp - eps) & usable[:, None]


def top_k_bounds(ylo: torch.Tensor, yhi: torch.Tensor, top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply top-k to bounds; see the module docstring.

    Parameters
    ----------
    ylo, yhi : torch.Tensor
        ``[R, V]`` float32 bounds of the values vLLM's top-k sees (after temperature and min-p).
    top_k : torch.Tensor
        ``[R]`` int64, ``k >= V`` (vLLM's "no top-k") or ``k <= 0``: off.

    Returns
    -------
    (ylo, yhi): certainly dropped tokens ``-inf`` on both sides, undecided ones ``ylo = -inf``.
    """
    R, V = ylo.shape
    on = _top_k_on(top_k, V)
    if not bool(on.any()):
        return ylo, yhi
    rows = on.nonzero().squeeze(1)
    k = top_k[rows].long().to(ylo.device)[:, None]  # [r, 1], 1 <= k < V
    lo, hi = rows_of(ylo, rows), rows_of(yhi, rows)
    kmax = int(k.max())
    new_lo, new_hi = top_k_cut(lo, hi, *_top_k_levels(lo, hi, k, kmax))
    return put_rows(ylo, rows, new_lo), put_rows(yhi, rows, new_hi)


def _top_k_levels(lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor, kmax: int):
    """``(H_k, H_(k+1), L_k)``, ``[r]`` float32 each, of bounds ``lo, hi`` (``[r, V]``; ``k`` ``[r, 1]``
    int64 in ``[1, V)``): token ``i`` is certainly kept if ``lo_i`` is at least the ``k``-th
    largest upper bound of the *other* tokens, which is ``H_(k+1)`` if ``hi_i >= H_k`` (``i`` is
    among the ``k`` highest) and ``H_k`` otherwise; certainly dropped if ``hi_i < L_k``
    (:func:`~vllm_csv.ops.masks.top_k_cut` applies them)."""
    lk = row_topk(lo, kmax).values.gather(1, k - 1)  # L_k
    h = row_topk(hi, kmax + 1).values  # kmax + 1 <= V
    return h.gather(1, k - 1)[:, 0], h.gather(1, k)[:, 0], lk[:, 0]  # H_k, H_(k+1), L_k


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


def _top_p_cuts(p: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def _decide(n_hi, r_lo, n_lo, r_hi, lo, p_keep, p_drop):
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
    k, d = _decide(n_hi, r_lo, n_lo, r_hi, plo, p_keep, p_drop)
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
    the rows are ``-inf`` but for the explicit tokens (:mod:`.sharded_rows`). A column whose
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
    on = _top_p_on(top_p)
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
    p_keep, p_drop = _top_p_cuts(top_p[rows].double()[:, None], row_length or V_row)  # vLLM sums over the whole row
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


class TopPQueries:
    """vLLM's top-p on bounds, deciding chosen tokens only (module docstring, "deciding some
    tokens only"); what a row's decisions read is prepared once, for several sets of tokens.

    Parameters
    ----------
    ylo, yhi : torch.Tensor
        ``[R, V]`` float32 bounds of the values top-p sees (after temperature, min-p, top-k).
    top_p : torch.Tensor
        ``[R]`` float32, ``1`` = off.
    """

    def __init__(self, ylo: torch.Tensor, yhi: torch.Tensor, top_p: torch.Tensor):
        self.ylo, self.yhi, self.top_p = ylo, yhi, top_p
        V = ylo.shape[1]
        self.rows = _top_p_on(top_p).nonzero().squeeze(1)
        lo, hi = rows_of(ylo, self.rows), rows_of(yhi, self.rows)
        c = hi.amax(1, keepdim=True)
        # rows with NaN or +inf bounds ask for nothing (never certified: every token undecided)
        # (amax propagates NaN: one reduction instead of an isnan pass)
        self.usable = (torch.isfinite(c) | (c == -math.inf))[:, 0] & ~torch.isnan(lo.amax(1))
        self.c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
        K = self.listed = min(QUERY_LIST, V)
        th, self.ih = row_topk(hi, K)
        # every unlisted token's yhi is at most kth (what "covered" reads: module docstring)
        self.kth = th[:, -1].double()
        self.is_listed = torch.zeros_like(hi, dtype=torch.bool).scatter_(1, self.ih, True)
        # masses off the list, summed directly (fp32 exp, float64 sum, widened: docstring)
        self.unl_h, self.unl_l = self._unlisted(lo, hi)
        self.p_keep, self.p_drop = _top_p_cuts(top_p[self.rows].double(), V)
        self._index(lo, hi)

    def _index(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """The listed tokens' bounds (``lo``, ``hi``: ``[r, V]``, the rows') as prefix / suffix sums."""
        self.th, order = hi.gather(1, self.ih).double().sort(dim=1, descending=True)
        self.ih = self.ih.gather(1, order)
        self.tl = lo.gather(1, self.ih).double()
        eh_l, el_l = self._mass(self.th), self._mass(self.tl)
        # the listed masses as prefix / suffix sums ([r, K + 1]) along the list (yhi descending)
        # and along its lower bounds sorted descending: each of the four sums over listed
        # tokens is one of them at a searchsorted position (bounds)
        z = torch.zeros_like(eh_l[:, :1])
        self.neg_th = -self.th  # ascending
        self.pre_eh = torch.cat([z, eh_l.cumsum(1)], 1)  # over th >= x: the first P
        self.suf_el = torch.cat([el_l.flip(1).cumsum(1).flip(1), z], 1)  # over th < x: from P on
        tl_s, perm = self.tl.sort(dim=1, descending=True)
        self.neg_tl = -tl_s
        self.pre_el = torch.cat([z, el_l.gather(1, perm).cumsum(1)], 1)  # over tl > x
        self.suf_eh = torch.cat([eh_l.gather(1, perm).flip(1).cumsum(1).flip(1), z], 1)  # over tl <= x
        self.first = self.ih.gather(1, perm[:, :min(DECIDE_FIRST, perm.shape[1])])  # [r, <=16]

    def narrowed(self, ylo: torch.Tensor, yhi: torch.Tensor, top_p: torch.Tensor) -> "TopPQueries | None":
        """The queries of tighter bounds, without a pass over the rows' vocabulary but two
        comparisons: ``ylo, yhi`` (``[R, V]``, as the constructor's) on the rows of ``top_p``,
        which must be rows of this one with the same ``top_p``, and within this one's bounds
        (checked here; else None, and the caller builds anew). The list keeps its tokens, their
        new bounds re-sorted; the unlisted masses stay valid bounds (each ``yhi_j`` only fell,
        each ``ylo_j`` only rose), and so does ``kth`` (every unlisted ``yhi_j`` is at most the
        old one, at most ``kth``); so does the shift ``c`` (at least every ``yhi``). One round of
        :mod:`.rows` to the next changes the bounds of the tokens it scored only."""
        rows = _top_p_on(top_p).nonzero().squeeze(1)
        n = self.rows.numel()
        if rows.numel() == 0 or n == 0:
            return None
        pos = torch.searchsorted(self.rows, rows).clamp_max(n - 1)  # (self.rows ascending: nonzero)
        if not bool((self.rows[pos] == rows).all() and (self.top_p[rows] == top_p[rows]).all()):
            return None
        lo, hi = rows_of(ylo, rows), rows_of(yhi, rows)
        if not bool(all_(lo >= rows_of(self.ylo, rows)) and all_(hi <= rows_of(self.yhi, rows))):
            return None  # (NaN fails both comparisons)
        # the shift c stays valid (at least every yhi) but grows stale as the bounds fall: a row
        # whose highest yhi (at most its listed ones' or kth) fell STALE_SHIFT below it would
        # decide on masses near underflow (module docstring): built anew
        top = torch.maximum(hi.gather(1, self.ih[pos]).amax(1).double(), self.kth[pos])
        if not bool((self.c[pos, 0].double() - top <= STALE_SHIFT).all()):
            return None
        q = TopPQueries.__new__(TopPQueries)
        q.ylo, q.yhi, q.top_p, q.rows, q.listed = ylo, yhi, top_p, rows, self.listed
        for name in ("usable", "c", "ih", "kth", "is_listed", "unl_h", "unl_l", "p_keep", "p_drop"):
            setattr(q, name, getattr(self, name)[pos])
        q._index(lo, hi)
        return q

    def _mass(self, y: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``e^(y - c)`` in float64: ``y`` ``[r, n]`` float64 (or ``[Q]``, of the rows ``rows``),
        shifted by its row's ``c``; ``-inf`` -> 0."""
        c = self.c.double() if rows is None else self.c[rows, 0].double()
        return torch.exp(y - c)

    def _unlisted(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``([r], [r])`` float64: an upper bound of the sum of ``e^(hi_j - c)`` and a lower bound of
        the sum of ``e^(lo_j - c)`` over the tokens off the list. ``fl32(y_j - c)`` is within
        ``u |y_j - c|`` of ``y_j - c`` (``y_j <= c``), which moves a normal ``e^x`` (``x >= -87``)
        by at most ``88u`` relatively; the vectorised fp32 ``exp`` (torch's, or SLEEF's 1-ulp one
        in the CPU kernel, :func:`~vllm_csv.ops.masks.unlisted_masses`) adds at most 64 ulps; the
        float64 sum of at most ``V`` nonnegative terms, in any order, ``gamma_V`` (double): so
        ``(1 +- 512u)`` covers it all, and ``V 2^-126`` whatever underflows (either way)."""
        e_lo, e_hi = unlisted_masses(lo, hi, self.c, self.ih).unbind(1)
        tiny = lo.shape[1] * 2.0**-126
        return e_hi * (1 + 512 * _U) + tiny, (e_lo * (1 - 512 * _U) - tiny).clamp_min(0)

    def _decide_whole(self, ri: torch.Tensor, ci: torch.Tensor, p_keep: torch.Tensor,
                      p_drop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keep, drop)`` ``[Q]`` bool of the tokens ``ci`` of the rows ``ri`` (``[Q]`` int64,
        ``ri`` into :attr:`rows`, row-major), each on the four sums over its whole row
        (:func:`~vllm_csv.ops.masks.top_p_sums`), the masses ``e^(y - c)`` float64 as
        :func:`top_p_bounds` forms them (``c`` at least every ``yhi`` of the row)."""
        held, qrow = torch.unique_consecutive(ri, return_inverse=True)
        lo, hi = rows_of(self.ylo, self.rows[held]), rows_of(self.yhi, self.rows[held])
        c = self.c[held].double()
        el, eh = torch.exp(lo.double() - c), torch.exp(hi.double() - c)  # -inf -> 0
        n_hi, r_lo, n_lo, r_hi = top_p_sums(lo, hi, el, eh, qrow, ci).unbind(1)
        r_lo = r_lo + el[qrow, ci]  # i's own lower mass (r_lo counts i)
        return _decide(n_hi, r_lo, n_lo, r_hi, lo[qrow, ci].double(), p_keep, p_drop)

    def bounds(self, only: torch.Tensor | None = None, settle: torch.Tensor | None = None,
               subset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ylo, yhi)`` with top-p applied to the tokens ``only`` (``[R, V]`` bool; None: none)
        and each row's :data:`DECIDE_FIRST` listed tokens of highest lower bound; the others
        undecided. A token of ``settle`` (``[R, V]`` bool, within ``only``; None: none) that the
        list leaves undecided where exact sums might decide it is decided on its whole row's sums
        (:meth:`_decide_whole`). A row asking for more than :data:`QUERY_MAX` tokens is decided
        in full (:func:`top_p_bounds`). ``subset`` (``[n]`` int64, ascending, rows of
        :attr:`rows`): those rows only, ``[n, V]`` each, the same values as their rows of the whole
        result (every decision reads its own row's bounds and sums only)."""
        rows = self.rows
        r, V = rows.numel(), self.ylo.shape[1]
        dev = self.ylo.device
        # the asked tokens as (row, column) pairs, each row's DECIDE_FIRST added (row-major,
        # distinct): one nonzero over [r, V] (or the subset's rows), the rest on the pairs
        at = torch.arange(r, device=dev) if subset is None else torch.searchsorted(rows, subset)  # into rows
        if subset is not None and not bool((rows[at.clamp(max=max(r - 1, 0))] == subset).all()):
            # (a row of no query would get another row's decisions: refused, one small host read)
            raise ValueError("TopPQueries.bounds: subset holds a row that asks no top-p decisions")
        keys = (at[:, None] * V + self.first[at]).reshape(-1)  # row * V + column
        if only is not None:
            asked = flat_nonzero(rows_of(only, rows if subset is None else subset))
            if subset is not None:
                asked = at[asked // V] * V + asked % V
            keys = torch.cat([asked, keys]).unique()
        ri, ci = keys // V, keys % V
        live = (self.yhi[rows[ri], ci] > -math.inf) & self.usable[ri]
        ri, ci = ri[live], ci[live]
        heavy = torch.bincount(ri, minlength=r) > QUERY_MAX
        light = ~heavy[ri]
        ri, ci = ri[light], ci[light]
        qlo, qhi = self.ylo[rows[ri], ci].double(), self.yhi[rows[ri], ci].double()
        qel, qeh = self._mass(qlo, ri), self._mass(qhi, ri)
        covered = (self.kth[ri] < qlo) | (self.listed == V)  # (every token listed: nothing unlisted)
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        uh, ul = self.unl_h[ri], self.unl_l[ri]
        at_h = torch.searchsorted(self.neg_th[ri], -qlo[:, None], right=True)[:, 0]  # #{th >= qlo}
        at_l = torch.searchsorted(self.neg_tl[ri], -qhi[:, None], right=False)[:, 0]  # #{tl > qhi}
        over = self.pre_eh[ri, at_h]
        # i itself out of n_hi (a listed i is counted: th_i = yhi_i >= ylo_i); the subtraction's
        # rounding, at most ~K 2^-53 of the sum, covered by 2^-40 of it (an upper bound stays one)
        n_hi0 = (over - torch.where(self.is_listed[ri, ci], qeh, zero)).clamp_min(0) + over * 2.0**-40
        r_lo0 = self.suf_el[ri, at_h] + qel
        n_lo0 = self.pre_el[ri, at_l]
        r_hi0 = self.suf_eh[ri, at_l]
        pk, pd = self.p_keep[ri], self.p_drop[ri]
        k, d = _decide(n_hi0 + torch.where(covered, zero, uh), r_lo0 + torch.where(covered, ul, zero),
                       n_lo0, r_hi0 + uh, qlo, pk, pd)
        if settle is not None:
            # A token of settle left undecided that exact sums might decide (the unlisted tokens
            # put where they help the decision: then it holds) is decided on its whole row's sums:
            # this path decides it wherever the full computation (with no tail) would.
            exact = self.kth[ri] <= qhi  # the drop side's sums are exact (module docstring)
            k_may, _ = _decide(n_hi0, r_lo0 + ul, n_lo0, r_hi0, qlo, pk, pd)
            _, d_may = _decide(n_hi0, r_lo0, n_lo0 + torch.where(exact, zero, ul),
                               r_hi0 + torch.where(exact, uh, zero), qlo, pk, pd)
            unsure = ~(k | d) & ((k_may & ~covered) | (d_may & ~exact)) & settle[rows[ri], ci]
            if bool(unsure.any()):
                u = unsure.nonzero().squeeze(1)
                k[u], d[u] = self._decide_whole(ri[u], ci[u], pk[u], pd[u])
        out = rows if subset is None else subset  # the output's rows (of R), each a row of rows
        if out.numel() == self.ylo.shape[0]:  # every row: undecided (-inf) unless kept below
            out_lo = torch.full_like(self.ylo, -math.inf)
        elif subset is not None:
            out_lo = torch.full((out.numel(), V), -math.inf, dtype=self.ylo.dtype, device=dev)
        else:
            out_lo = self.ylo.clone()
            out_lo[rows] = -math.inf
        out_hi = self.yhi.index_select(0, subset) if subset is not None else self.yhi.clone()  # (a copy either way)
        # (output row of a query row: the row itself, or its place in subset)
        orow = rows if subset is None else torch.zeros(r, dtype=torch.long, device=dev).index_copy_(
            0, at, torch.arange(at.numel(), device=dev))
        kr, kc = rows[ri[k]], ci[k]
        out_lo[orow[ri[k]], kc] = self.ylo[kr, kc]
        out_hi[orow[ri[d]], ci[d]] = -math.inf
        if bool(heavy.any()):
            h = heavy.nonzero().squeeze(1)
            out_lo[orow[h]], out_hi[orow[h]] = top_p_bounds(rows_of(self.ylo, rows[h]), rows_of(self.yhi, rows[h]),
                                                            self.top_p[rows[h]])
        return out_lo, out_hi
