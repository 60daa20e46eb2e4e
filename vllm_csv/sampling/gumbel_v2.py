"""vLLM's Model Runner V2 Gumbel draw (CUDA): its noise, recomputable for any token, and a
certificate of the token it picks from bounds on the logits.

vLLM 0.32's V2 sampler (``vllm/v1/worker/gpu/sample/gumbel.py``, ``gumbel_sample`` without
fp64) returns, per row, ``argmax_i fl32(x_i + g_i)`` over the processed fp32 logits ``x`` (ties:
the lowest index, within a block of 1024 by ``tl.max``'s left tie-break and across blocks by
``torch.argmax``), ``-inf`` where masked, with

    r_i = murmur3_32(seed, pos, i)            (uint32; the request's seed, the token's position)
    u_i = fl32(hi16(r_i) 2^-16 + (lo16(r_i) + 0.5) 2^-32)      (exact operands, one rounding)
    g_i = -log(-L(u_i)),  L(u) = -u (1 + u/2 + ... + u^7/8)   for u < 0.25 (a series, fp32 Horner)
                                 log(max(1 - u, 2^-24))         otherwise

Token ``i``'s noise depends only on ``(seed, pos, i)``: no per-step random state is drawn, so
nothing has to be peeked or kept in step. ``r`` and ``u`` are integer and exactly rounded
arithmetic, replayed here bit for bit (:func:`uniform`). ``g`` is computed on the GPU with
Triton's fp32 ``log`` and a truncated series, so it is bounded, not replayed: :func:`noise_bounds`
gives ``[g - eps, g + eps]`` around the real ``g(u)`` (float64), ``eps = 1e-5 (1 + |g|)``: the
series' truncation is below ``2.4e-6`` relative to ``L``, its fp32 evaluation about ``1e-6``,
and an fp32 ``log`` a few ulps; each moves ``g = -log(-L)`` by about the relative error of
``L``, at most ``4e-6``, or, through the outer ``log``, ``4e-7 |g|``: ``eps`` is 2.5x the sum.
(``tests/test_sampling_gumbel_v2.py`` checks ``r`` and ``u`` bit for bit and ``g`` within the
bounds against vLLM's own Triton functions, run by Triton's interpreter on the CPU;
``tests/test_sampling_gumbel_v2_cuda.py`` does the same with the kernels compiled for a GPU, over
512 x 262144 tokens: on an H200 (torch 2.11, Triton 3.6) the GPU's noise stayed within 0.09 of
``eps`` from the real ``g(u)``.)

Temperature (:func:`temperature_bounds`): V2 divides by ``T`` with Triton's fp32 ``/``, which on
that H200 returned a quotient other than the correctly rounded one for 28% of the logits tried
(at most 2 ulps off), so the bounds are widened by 2 ulps, not replayed.

Min-p (:func:`min_p_bounds`): V2's ``_min_p_kernel`` sets ``x_i`` to ``-inf`` where
``x_i < fl32(max_j x_j + log(min_p))``, after the temperature, with Triton's fp32 ``log``: bounded
(:data:`LOG_ABS`, :data:`LOG_REL`), not replayed.

``u`` lies in ``[2^-33, 1]`` (its largest values round to 1.0, where ``1 - u`` is clamped to
``2^-24``), so ``g`` lies in ``[-log(16.64), -log(2^-33 ln 2 ...)] = [-2.82, 23.3]``:
:data:`GUMBEL_MIN`, :data:`GUMBEL_MAX`, rounded outwards.
"""

from __future__ import annotations

import math

import torch

from ..fp import quotient_bounds
from ..gumbel_noise import (_M32, DIV_ABS, DIV_REL, DIV_T_MAX, DIV_T_MIN, EPS_ABS, EPS_REL, GUMBEL_MAX,  # noqa: F401
                            GUMBEL_MIN, LOG_ABS, LOG_REL, TOP_K_A_MAX, comparison_margin, finite_abs_max,
                            min_p_thresholds, murmur3, noise, noise_bounds, top_k_keep_margin, top_mask_margin,
                            uniform)



def temperature_bounds(ylo: torch.Tensor, yhi: torch.Tensor, temp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on what V2's kernels make of ``x / T`` for ``ylo <= x <= yhi``.

    Parameters
    ----------
    ylo, yhi : torch.Tensor
        ``[R, n]`` float32 bounds on the logits before temperature (``-inf`` where masked).
    temp : torch.Tensor
        ``[R]`` the rows' temperatures, ``T > 0``.

    Returns
    -------
    (qlo, qhi) : tuple of torch.Tensor
        ``[R, n]`` float32 with ``qlo <= fl(x / T) <= qhi`` for Triton's fp32 division
        (``DIV_REL``/``DIV_ABS`` above): ``q - DIV_REL |q| - DIV_ABS`` is increasing in the real
        quotient ``q``, so its value at ``ylo / T`` bounds every ``x`` of the box from below
        (likewise above), computed in float64 and rounded outwards. ``-inf`` stays ``-inf``;
        rows whose ``T`` lies outside ``[2^-126, 2^126]`` (or is NaN) get NaN bounds, which no
        certificate accepts.
    """
    return quotient_bounds(ylo, yhi, temp[:, None])


def min_p_bounds(qlo: torch.Tensor, qhi: torch.Tensor, min_p: torch.Tensor,
                 m: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bounds on what V2's min-p leaves of ``qlo <= x <= qhi`` (the tempered logits).

    The kernel (``vllm/v1/worker/gpu/sample/min_p.py``) reads a row's fp32 ``min_p``; at 0 it
    leaves the row alone, else it computes ``thr = fl32(m + c)`` with ``m = max_j x_j`` and
    ``c`` its fp32 ``log(min_p)``, and sets every ``x_i < thr`` to ``-inf``. With ``m`` in
    ``[max qlo, max qhi]`` and ``c`` within :data:`LOG_ABS` + :data:`LOG_REL` ``|log min_p|`` of
    the real logarithm, ``thr`` lies in ``[thr_lo, thr_hi]`` (the real sums' bounds rounded
    outwards to fp32: rounding to nearest is monotone). A token with ``qhi < thr_lo`` is
    certainly dropped; one with ``qlo >= thr_hi`` certainly kept; any other may go either way.

    Parameters
    ----------
    qlo, qhi : torch.Tensor
        ``[R, n]`` float32 bounds of the tempered logits over the whole row (``n = V``: the
        maximum is the row's), or over some of its tokens where ``m`` is given.
    min_p : torch.Tensor
        ``[R]`` float32, each row's ``min_p`` (0: none).
    m : tuple of torch.Tensor, optional
        ``(m_lo, m_hi)``, ``[R]`` float64 bounds of the whole row's maximum, for columns that are
        not the whole row (:mod:`.verify_v2_fused`'s candidates); None: taken from ``qlo, qhi``.

    Returns
    -------
    (lo, hi, dropped) : tuple of torch.Tensor
        ``lo, hi [R, n]`` float32: bounds of the values after min-p, ``-inf`` for a dropped token,
        so ``lo`` is ``-inf`` wherever the token may be dropped and ``hi`` wherever it surely
        is; ``dropped [R, n]`` bool, the tokens certainly dropped. A certificate over ``lo, hi``
        holds for the row V2 draws from; written back as a partial row, the dropped tokens must
        be ``-inf`` too (its maximum, hence its threshold, may be lower than the full row's).
    """
    on = (min_p > 0)[:, None]
    m_lo, m_hi = (qlo.double().amax(1), qhi.double().amax(1)) if m is None else m
    thr_lo, thr_hi = min_p_thresholds(m_lo[:, None], m_hi[:, None], min_p[:, None])
    dropped = on & (qhi < thr_lo)
    kept = ~on | (qlo >= thr_hi)
    return qlo.masked_fill(~kept, -math.inf), qhi.masked_fill(dropped, -math.inf), dropped


def certify_draw_v2(ylo: torch.Tensor, yhi: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                    ids: torch.Tensor | None = None, noise: tuple[torch.Tensor, torch.Tensor] | None = None,
                    greedy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Certify the token V2's ``gumbel_sample`` picks in each row from ``ylo <= x <= yhi``.

    Parameters
    ----------
    ylo, yhi : torch.Tensor
        ``[R, n]`` float32 bounds of the processed logits the kernel sees (``-inf`` on both for
        masked tokens).
    seeds, pos : torch.Tensor
        ``[R]`` int64, each row's request seed and position.
    ids : torch.Tensor, optional
        ``[n]`` or ``[R, n]`` int64 token ids of the columns (default: the column is the token).
    noise : tuple of torch.Tensor, optional
        :func:`noise_bounds` of these rows and columns, when the caller already has them.
    greedy : torch.Tensor, optional
        ``[R]`` bool: rows drawn at temperature 0, where the kernel adds no noise and returns the
        argmax of ``x``: no noise and no margin on them (the comparison is of the values
        themselves), so the winner's lower bound must exceed every other upper bound strictly
        (the kernel's tie-break among equal values is not replayed).

    Returns
    -------
    (winner [R] int64 (a column), certified [R] bool, contenders [R, n] bool)
        With ``w = argmax(ylo + g_lo)`` and ``best`` that value, a row is certified when every
        other column has ``yhi + g_hi < best - 2 m`` (``m`` :func:`comparison_margin` of the row's
        largest finite ``|y|``): then ``fl32(x_w + g_w) > fl32(x_j + g_j)`` strictly, whatever the
        kernel's order of comparison. Rows with NaN or ``+inf`` bounds, or nothing finite, are
        never certified; ``contenders`` are the columns to score exactly to decide the others.
    """
    R, n = ylo.shape
    if noise is None:
        noise = noise_bounds(seeds, pos, torch.arange(n, device=ylo.device) if ids is None else ids)
    g_lo, g_hi = noise
    if greedy is not None:
        g_lo, g_hi = g_lo.masked_fill(greedy[:, None], 0.0), g_hi.masked_fill(greedy[:, None], 0.0)
    lo, hi = ylo.double(), yhi.double()
    finite_lo = lo > -math.inf
    usable = finite_lo.any(1) & ~torch.isnan(lo).any(1) & ~torch.isnan(hi).any(1) & ~(hi == math.inf).any(1)
    m = comparison_margin(finite_abs_max(hi, lo))
    if greedy is not None:
        m = m.masked_fill(greedy, 0.0)
    nlo = torch.where(finite_lo, lo + g_lo, -math.inf)
    nhi = torch.where(hi > -math.inf, hi + g_hi, -math.inf)
    best, winner = nlo.max(1)
    contenders = nhi >= (best - 2 * m)[:, None]
    contenders.scatter_(1, winner[:, None], True)
    certified = usable & (contenders.sum(1) == 1)
    return winner, certified, contenders & usable[:, None]


def top_k_bounds(qlo: torch.Tensor, qhi: torch.Tensor, k: torch.Tensor,
                 pre: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Bounds on what V2's top-k kernel leaves of ``qlo <= x <= qhi`` on rows with a top-k ``k``
    alone (no top-p), as :func:`min_p_bounds` has it for min-p.

    With ``x_(k)`` the row's ``k``-th largest value and ``m`` the margin
    :func:`~vllm_csv.gumbel_noise.top_k_keep_margin` of the row's largest ``|x|``, the kernel
    (Qrita, 0.32.0 / 0.33.0) keeps every token ``x >= x_(k) + m`` with its value, and, where it
    masks at all (more than ``k`` finite values and ``x_(k+1) + m`` below the row's maximum),
    drops every token ``x < x_(k) - m``: its pivot lies above ``x_(k) - 2^-18 A`` (a run-out
    search's interval holds ``x_(k)``; a found pivot's smallest larger value is within ``2e-9`` of
    it), and it keeps only values above its pivot (the argument: ``top_k_keep_margin``'s
    docstring). ``x_(k)`` lies between the ``k``-th largest ``qlo`` and ``qhi``.

    Parameters
    ----------
    qlo, qhi : torch.Tensor
        ``[R, V]`` float32 bounds of the tempered logits after min-p (what the mask reads), the
        whole row.
    k : torch.Tensor
        ``[R]`` int64, each row's top-k where it has one alone (``2 <= k < V``), else 0.
    pre : (torch.Tensor, torch.Tensor), optional
        ``[R, V]`` bounds of the same logits before min-p (None: ``qlo, qhi``). A row is taken
        only where every value the kernel may see is bounded, ``|x| <= A``: each token ``-inf``
        on both sides or finite on both (not a one-sided screen's unscored tokens), no ``+inf``
        or NaN bound, ``A`` at most :data:`~vllm_csv.gumbel_noise.TOP_K_A_MAX`.

    Returns
    -------
    (lo, hi, dropped, near, on)
        ``lo, hi [R, V]`` float32: bounds of the values after the mask (``lo`` ``-inf`` wherever
        a token may be dropped, ``hi`` wherever it surely is), as ``qlo, qhi`` on rows not
        ``on``; ``dropped [R, V]`` bool, the tokens surely dropped (written back as a partial row
        they must be ``-inf`` too: a partial row's pivot may be lower); ``near [R, V]`` bool,
        the tokens whose bounds straddle the band ``x_(k) +- m`` may lie in (to score: that
        narrows it); ``on [R]`` bool, the rows taken. A certificate over ``lo, hi`` holds for the
        row V2 draws from, and for the partial row written back: its finite values are exact,
        its ``k``-th largest at most the full row's (min-p there keeps a superset of the full
        row's tokens, none above its ``qhi``), so it keeps every token the full row surely keeps.
    """
    R, V = qlo.shape
    lo, hi = qlo.double(), qhi.double()
    plo, phi = (lo, hi) if pre is None else (pre[0].double(), pre[1].double())
    A = finite_abs_max(plo, phi)
    two_sided = (torch.isfinite(plo) & torch.isfinite(phi)) | ((plo == -math.inf) & (phi == -math.inf))
    on = (k >= 2) & (k < V) & two_sided.all(1) & ~(torch.isnan(hi) | (hi == math.inf)).any(1) & (A <= TOP_K_A_MAX)
    if not bool(on.any()):  # (one sync: rows the top-k bounds take)
        none = torch.zeros_like(qlo, dtype=torch.bool)
        return qlo, qhi, none, none, on
    kk = k.clamp(1, V - 1)
    top = int(kk.max()) + 1
    hi_s, lo_s = hi.topk(top, 1).values, torch.where(torch.isnan(lo), -math.inf, lo).topk(top, 1).values
    t_hi = hi_s.gather(1, (kk - 1)[:, None])  # >= x_(k)
    t1_hi = hi_s.gather(1, kk[:, None])  # >= x_(k+1)
    t_lo = lo_s.gather(1, (kk - 1)[:, None])  # <= x_(k)
    m = top_k_keep_margin(A)[:, None]
    kept = lo >= t_hi + m
    masks = ((lo > -math.inf).sum(1, keepdim=True) > kk[:, None]) & (t1_hi + m < lo.amax(1, keepdim=True))
    dropped = on[:, None] & masks & (hi < t_lo - m)
    near = on[:, None] & (hi >= t_lo - m) & ~kept
    return (torch.where(on[:, None] & ~kept, -math.inf, qlo), qhi.masked_fill(dropped, -math.inf), dropped, near,
            on)


def certain_maximum(qlo: torch.Tensor, qhi: torch.Tensor, winner: torch.Tensor,
                    on: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether each row's ``winner`` is its maximum by :func:`~vllm_csv.gumbel_noise.top_mask_margin`,
    so that V2's top-k / top-p masks keep it, values unchanged, whatever they keep besides.

    A row V2 masks with a top-k or a top-p is certified by the draw's certificate on its bounds
    before the mask (the winner beats every token, kept or not) and this: the winner is kept,
    and a mask only sets other tokens to its mask value, so the winner still wins. Where the
    winner is not the row's certain maximum the row is not certified (never a guess at what the
    mask keeps). (A row with a top-k alone takes :func:`top_k_bounds` instead, where it can.)

    Parameters
    ----------
    qlo, qhi : torch.Tensor
        ``[R, V]`` float32 bounds of the tempered logits after min-p (what the mask reads).
    winner : torch.Tensor
        ``[R]`` int64, each row's certified column.
    on : torch.Tensor
        ``[R]`` bool, the rows V2 masks with a top-k or a top-p.

    Returns
    -------
    (ok [R] bool, near [R, V] bool)
        ``ok``: not ``on``, or ``qlo[winner]`` above every other ``qhi`` by the margin; ``near``:
        on rows ``on``, the other tokens within the margin (to score, which may settle the row).
    """
    lo, hi = qlo.double(), qhi.double()
    bar = lo.gather(1, winner[:, None]) - top_mask_margin(qlo.shape[1], finite_abs_max(lo, hi))[:, None]
    near = on[:, None] & (hi >= bar) & ~torch.isnan(bar)
    near.scatter_(1, winner[:, None], False)
    return ~on | (~near.any(1) & (bar[:, 0] > -math.inf)), near
