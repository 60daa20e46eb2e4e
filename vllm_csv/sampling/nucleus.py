"""Bounds on the draw's inputs after vLLM's min-p and top-p masks.

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
``m`` lies in ``[max ylo, max yhi]``.

top-p (``apply_top_k_top_p_pytorch``): sorted ascending, token ``i`` is dropped iff the
fp32 cumulative sum of probabilities up to and including it is ``<= 1 - p`` (the largest is
always kept). In real arithmetic that sum is ``1 - A_i``, ``A_i`` the mass of the tokens
sorted after ``i``: ``A_i = N / (N + R)`` with ``N = sum_{after} e^{y_j}``, ``R`` the rest
(``i`` included); ``A`` increases with ``N`` and decreases with ``R``. Tokens that may sort
after ``i`` are those with ``yhi_j >= ylo_i`` (ties included), those that must are those with
``ylo_j > yhi_i``; so ``A_hi = N_hi / (N_hi + R_lo)`` with ``N_hi`` the upper masses of the
first set and ``R_lo`` the lower masses of the others (``i`` included), and
``A_lo = N_lo / (N_lo + R_hi)`` likewise. fp32 softmax and a sequential cumulative sum of
``n <= V`` terms in ``[0, 1]`` are within ``2 gamma_V + 4u`` of the real sums: kept if
``A_hi < p - eps``, dropped if ``A_lo > p + eps``, ``eps = 2 gamma_V + 1e-6``.
"""

from __future__ import annotations

import math

import torch

from ..fp import gamma

_U = 2.0**-24
MIN_P_FLOOR = 1e-20


def min_p_bounds(ylo: torch.Tensor, yhi: torch.Tensor, min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply min-p (``[R]`` float32, ``0`` = off) to bounds; see the module docstring."""
    on = min_p > 0
    if not bool(on.any()):
        return ylo, yhi
    mlo = ylo.amax(1, keepdim=True)
    mhi = yhi.amax(1, keepdim=True)
    logmp = torch.log(min_p.double().clamp_min(MIN_P_FLOOR))[:, None]
    ym = torch.maximum(mlo.abs(), mhi.abs()).double()
    eps = 1e-5 + 2.0**-21 * (torch.maximum(ylo.abs(), yhi.abs()).double() + ym)
    keep = (ylo.double() - mhi.double()) >= logmp + eps
    drop = (yhi.double() - mlo.double()) < logmp - eps
    usable = on & (min_p >= MIN_P_FLOOR)
    new_lo = torch.where(keep, ylo, -math.inf)
    new_lo = torch.where(usable[:, None], new_lo, torch.full_like(ylo, -math.inf))
    new_hi = torch.where(drop & usable[:, None], -math.inf, yhi)
    return torch.where(on[:, None], new_lo, ylo), torch.where(on[:, None], new_hi, yhi)


def _prefix_before(sorted_vals: torch.Tensor, cums: torch.Tensor, thr: torch.Tensor, right: bool) -> torch.Tensor:
    """Per row, the sum of the sorted weights whose value is ``< thr`` (``<= thr`` if ``right``)."""
    k = torch.searchsorted(sorted_vals, thr, right=right)
    padded = torch.cat([torch.zeros_like(cums[:, :1]), cums], 1)
    return padded.gather(1, k)


def top_p_bounds(ylo: torch.Tensor, yhi: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply top-p (``[R]`` float32, ``1`` = off) to bounds; see the module docstring."""
    on = top_p < 1.0
    if not bool(on.any()):
        return ylo, yhi
    rows = on.nonzero().squeeze(1)
    lo, hi = ylo[rows].double(), yhi[rows].double()
    V = lo.shape[1]
    c = hi.masked_fill(hi == math.inf, -math.inf).amax(1, keepdim=True)
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    el, eh = torch.exp(lo - c), torch.exp(hi - c)  # -inf -> 0
    tot_h = eh.sum(1, keepdim=True)
    # sorted by yhi: masses of tokens with yhi_j < t
    hs, oh = hi.sort(1)
    cum_h_by_h, cum_l_by_h = eh.gather(1, oh).cumsum(1), el.gather(1, oh).cumsum(1)
    below_h = _prefix_before(hs, cum_h_by_h, lo, right=False)  # sum eh over yhi_j < ylo_i
    below_l = _prefix_before(hs, cum_l_by_h, lo, right=False)  # sum el over yhi_j < ylo_i
    n_hi = (tot_h - below_h - eh).clamp_min(0)
    r_lo = el + below_l
    a_hi = torch.where(n_hi == 0, 0.0, n_hi / (n_hi + r_lo))  # nothing can sort after i: A = 0
    # sorted by ylo: masses of tokens with ylo_j > t
    ls, ol = lo.sort(1)
    cum_l_by_l, cum_h_by_l = el.gather(1, ol).cumsum(1), eh.gather(1, ol).cumsum(1)
    tot_l = el.sum(1, keepdim=True)
    n_lo = (tot_l - _prefix_before(ls, cum_l_by_l, hi, right=True)).clamp_min(0)
    r_hi = _prefix_before(ls, cum_h_by_l, hi, right=True)  # eh over ylo_j <= yhi_i (i included)
    a_lo = torch.where(n_lo == 0, 0.0, n_lo / (n_lo + r_hi))
    eps = 2 * gamma(V) + 1e-6
    p = top_p[rows].double()[:, None]
    keep = (a_hi < p - eps) & (lo > -math.inf)
    drop = a_lo > p + eps
    out_lo, out_hi = ylo.clone(), yhi.clone()
    out_lo[rows] = torch.where(keep, ylo[rows], -math.inf)
    out_hi[rows] = torch.where(drop, -math.inf, yhi[rows])
    return out_lo, out_hi
