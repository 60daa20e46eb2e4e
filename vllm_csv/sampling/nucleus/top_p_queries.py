"""vLLM's top-p on bounds, deciding chosen tokens only (:class:`TopPQueries`): the draw's
certificate reads the decisions of a few tokens a row.

Bounds in and out as :mod:`vllm_csv.sampling.nucleus` says; the sums, the cuts and the decision
rule are :mod:`.top_p`'s (its docstring: the four masses, top-p's rounding, underflow).

Deciding some tokens only (:class:`TopPQueries`). Leaving a token undecided is always sound
(``ylo = -inf``, ``yhi`` kept), and the draw's certificate needs decisions only for its winner and
for the tokens whose noisy upper bound reaches the winner's noisy lower bound (:mod:`~vllm_csv.sampling.rounds` asks
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
per token, the masses ``e^(y - c)`` in float64 as :func:`~.top_p.top_p_bounds` takes them): the
decision the full computation makes with no tail, and no other token of the row is touched.
(Before, such a row was decided again on a list 8x longer, then in full: a sort of ``2V``
bounds per row, about 19 ms a row at ``V`` 65536 on 2 cores, where the sums take about 25 us a
token.) From one round of :mod:`~vllm_csv.sampling.rounds` to the next the bounds only
tighten (checked: :meth:`TopPQueries.narrowed`), so the next round keeps the list's tokens and the
unlisted masses (still bounds of what they bound; the ``K``-th ``yhi`` of the old list still bounds
every unlisted ``yhi``, even where a listed token's exact value fell below it) and re-sorts the
listed bounds only: no top-``K`` and no ``exp`` pass over the row.
"""

from __future__ import annotations

import math

import torch

from ...fp import FP32_UNIT_ROUNDOFF as _U
from ...ops.bools import all_
from ...ops.gather import rows_of
from ...ops.masks import PER_CALL, MaskOps
from .top_p import decide_on_sums, has_top_p, top_p_bounds, top_p_cuts

DECIDE_FIRST = 16  # TopPQueries: each row's listed tokens of highest lower bound are always decided
QUERY_LIST = 256  # TopPQueries: tokens listed per row (highest upper bounds)
QUERY_MAX = 1024  # TopPQueries: a row asking for more tokens is decided in full (top_p_bounds)
STALE_SHIFT = 16.0  # TopPQueries.narrowed: a row's shift this far above its new highest yhi: build anew


class TopPQueries:
    """vLLM's top-p on bounds, deciding chosen tokens only (module docstring, "deciding some
    tokens only"); what a row's decisions read is prepared once, for several sets of tokens.

    Parameters
    ----------
    ylo, yhi : torch.Tensor
        ``[R, V]`` float32 bounds of the values top-p sees (after temperature, min-p, top-k).
    top_p : torch.Tensor
        ``[R]`` float32, ``1`` = off.
    ops : MaskOps, optional
        The passes bound once (:attr:`.HeadAdapter.masks`); default: each call picks kernel or
        reference.
    """

    def __init__(self, ylo: torch.Tensor, yhi: torch.Tensor, top_p: torch.Tensor, ops: MaskOps = PER_CALL):
        self.ylo, self.yhi, self.top_p, self.ops = ylo, yhi, top_p, ops
        V = ylo.shape[1]
        self.rows = has_top_p(top_p).nonzero().squeeze(1)
        lo, hi = rows_of(ylo, self.rows), rows_of(yhi, self.rows)
        c = hi.amax(1, keepdim=True)
        # rows with NaN or +inf bounds ask for nothing (never certified: every token undecided)
        # (amax propagates NaN: one reduction instead of an isnan pass)
        self.usable = (torch.isfinite(c) | (c == -math.inf))[:, 0] & ~torch.isnan(lo.amax(1))
        self.c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
        K = self.listed = min(QUERY_LIST, V)
        th, self.ih = ops.row_topk(hi, K)
        # every unlisted token's yhi is at most kth (what "covered" reads: module docstring)
        self.kth = th[:, -1].double()
        self.is_listed = torch.zeros_like(hi, dtype=torch.bool).scatter_(1, self.ih, True)
        # masses off the list, summed directly (fp32 exp, float64 sum, widened: docstring)
        self.unl_h, self.unl_l = self._unlisted(lo, hi)
        self.p_keep, self.p_drop = top_p_cuts(top_p[self.rows].double(), V)
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
        :mod:`~vllm_csv.sampling.rounds` to the next changes the bounds of the tokens it scored only."""
        rows = has_top_p(top_p).nonzero().squeeze(1)
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
        # decide on masses near underflow (:mod:`.top_p`'s docstring): built anew
        top = torch.maximum(hi.gather(1, self.ih[pos]).amax(1).double(), self.kth[pos])
        if not bool((self.c[pos, 0].double() - top <= STALE_SHIFT).all()):
            return None
        q = TopPQueries.__new__(TopPQueries)
        q.ylo, q.yhi, q.top_p, q.rows, q.listed, q.ops = ylo, yhi, top_p, rows, self.listed, self.ops
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
        e_lo, e_hi = self.ops.unlisted_masses(lo, hi, self.c, self.ih).unbind(1)
        tiny = lo.shape[1] * 2.0**-126
        return e_hi * (1 + 512 * _U) + tiny, (e_lo * (1 - 512 * _U) - tiny).clamp_min(0)

    def _decide_whole(self, ri: torch.Tensor, ci: torch.Tensor, p_keep: torch.Tensor,
                      p_drop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keep, drop)`` ``[Q]`` bool of the tokens ``ci`` of the rows ``ri`` (``[Q]`` int64,
        ``ri`` into :attr:`rows`, row-major), each on the four sums over its whole row
        (:func:`~vllm_csv.ops.masks.top_p_sums`), the masses ``e^(y - c)`` float64 as
        :func:`~.top_p.top_p_bounds` forms them (``c`` at least every ``yhi`` of the row)."""
        held, qrow = torch.unique_consecutive(ri, return_inverse=True)
        lo, hi = rows_of(self.ylo, self.rows[held]), rows_of(self.yhi, self.rows[held])
        c = self.c[held].double()
        el, eh = torch.exp(lo.double() - c), torch.exp(hi.double() - c)  # -inf -> 0
        n_hi, r_lo, n_lo, r_hi = self.ops.top_p_sums(lo, hi, el, eh, qrow, ci).unbind(1)
        r_lo = r_lo + el[qrow, ci]  # i's own lower mass (r_lo counts i)
        return decide_on_sums(n_hi, r_lo, n_lo, r_hi, lo[qrow, ci].double(), p_keep, p_drop)

    def bounds(self, only: torch.Tensor | None = None, settle: torch.Tensor | None = None,
               subset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ylo, yhi)`` with top-p applied to the tokens ``only`` (``[R, V]`` bool; None: none)
        and each row's :data:`DECIDE_FIRST` listed tokens of highest lower bound; the others
        undecided. A token of ``settle`` (``[R, V]`` bool, within ``only``; None: none) that the
        list leaves undecided where exact sums might decide it is decided on its whole row's sums
        (:meth:`_decide_whole`). A row asking for more than :data:`QUERY_MAX` tokens is decided
        in full (:func:`~.top_p.top_p_bounds`). ``subset`` (``[n]`` int64, ascending, rows of
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
            asked = self.ops.flat_nonzero(rows_of(only, rows if subset is None else subset))
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
        k, d = decide_on_sums(n_hi0 + torch.where(covered, zero, uh), r_lo0 + torch.where(covered, ul, zero),
                       n_lo0, r_hi0 + uh, qlo, pk, pd)
        if settle is not None:
            # A token of settle left undecided that exact sums might decide (the unlisted tokens
            # put where they help the decision: then it holds) is decided on its whole row's sums:
            # this path decides it wherever the full computation (with no tail) would.
            exact = self.kth[ri] <= qhi  # the drop side's sums are exact (module docstring)
            k_may, _ = decide_on_sums(n_hi0, r_lo0 + ul, n_lo0, r_hi0, qlo, pk, pd)
            _, d_may = decide_on_sums(n_hi0, r_lo0, n_lo0 + torch.where(exact, zero, ul),
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
