"""Which token vLLM's draw picks, certified from bounds on every token's input to the draw.

A row's draw sees fp32 values ``y_i`` (the dense head's logits after vLLM's logits
processors, and, for a sampled row, divided by the temperature). We know
``ylo_i <= y_i <= yhi_i`` for every token (``-inf`` on both for masked tokens).

Greedy rows (``torch.ops._C.greedy_argmax``: exact fp32 comparisons, ties to the lowest
index). With ``w = argmax ylo``: if ``ylo_w > yhi_j`` for every ``j != w``, then
``y_w >= ylo_w > yhi_j >= y_j``: ``w`` is the unique maximum and the draw returns it.

Sampled rows (``fused_gumbel_argmax``, :mod:`.gumbel`). The draw maximises
``s_i = y_i + g_i`` (``g_i`` known from the seed). With ``nlo_i = ylo_i + g_i``,
``nhi_i = yhi_i + g_i`` (computed in float64, each within ``delta / 16`` of the real sum,
``delta`` = :func:`~vllm_csv.sampling.gumbel.noise_margin` of the row's largest ``|y|``),
``w = argmax nlo`` and ``best = nlo_w``: if ``nhi_j < best - 2 delta`` for every
``j != w``, the real ``s_w - s_j > 2 delta - delta / 8``, more than the kernel's
comparison error (``<= delta / 16``, :func:`~vllm_csv.sampling.gumbel.noise_margin`),
so the kernel returns ``w`` whatever order it compares in.

Noise is turned into ``g`` only where it can matter. ``L`` = the largest ``nlo_i`` over a
few tokens of highest ``ylo`` (``TOP_FIRST``; their noise computed first) is at most
``best``; a token with ``yhi_j + g_j < L - 2 delta`` has ``nhi_j < best - 2 delta``: not a
contender, and not the winner. Every token with ``max yhi - yhi_j >= k LEVEL`` and
``g_j < t + k LEVEL``, ``t := L - 2 delta - max yhi``, is such a token; those are found
from the raw hash bits alone (:func:`~vllm_csv.sampling.gumbel.bits_below`, one threshold per
level ``k``: :data:`LEVEL`, :data:`LEVELS`), and ``g`` is computed for the others. Rows of
at most :data:`DIRECT_BELOW` columns (a later round's, on the contenders) skip the thresholds:
``g`` is computed for every live token.

Rows with ``+inf`` or NaN bounds, or with no finite token, are never certified.

Outside blocks (:class:`~.outside.Outside`, tensor parallelism: tokens known only through
per-row summaries, ``-inf`` on both sides in ``ylo, yhi``) add one condition. Greedy: every
block's ``hi < ylo_w``, so every block token has ``y_j <= hi < ylo_w <= y_w``. Sampled: every
block's ``noisy < best - 2 delta``, with ``delta`` taken over ``max(|y|)`` of the blocks too
(``absmax``); each block token's computed ``yhi_j + g_j`` is at most its block's ``noisy`` and
within ``delta / 16`` of the real sum, which is all the proof above uses of ``nhi_j``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ops.gather import rows_of
from ..ops.live import RowStats
from ..ops.noise import PER_CALL, DrawOps
from .gumbel import noise_margin
from .outside import Outside

TOP_FIRST = 4  # tokens of highest lower bound whose noise sets the first threshold
PACK_BELOW = 0.25  # certify_draw_packed: pack the rows when none has more live tokens than this share of V
LEVEL, LEVELS = 0.5, 48  # noise thresholds by steps of 0.5 below the row's highest upper bound
DIRECT_BELOW = 512  # rows of at most this many columns: every live token's noise, no thresholds


@dataclass
class DrawCertificate:
    winner: torch.Tensor  # [R] int64: the token the draw returns where certified
    certified: torch.Tensor  # [R] bool
    contenders: torch.Tensor  # [R, V] bool: the winner and every token not yet ruled out
    finite: torch.Tensor  # [R] bool: bounds usable (no +inf / NaN, at least one finite token)
    # what ruled the other tokens out (read by :func:`ruled_out`), [R] float64 each:
    bar: torch.Tensor  # greedy rows: lmax (every other token has yhi < bar); sampled: best - 2 delta
    absmax: torch.Tensor  # sampled rows: the max |y| of the noise margin (greedy rows: 0)
    hmax: torch.Tensor  # the largest yhi
    # the tokens it ruled out, summarised for a later round (:func:`ruled_out`), where asked for
    # (certify_draw_packed's ``summary``); None otherwise
    rest: Outside | None = None


def certify_draw(ylo: torch.Tensor, yhi: torch.Tensor, seeds: torch.Tensor, greedy: torch.Tensor,
                 ids: torch.Tensor | None = None, outside: Outside | None = None,
                 stats: RowStats | None = None, ops: DrawOps = PER_CALL) -> DrawCertificate:
    """Certify the token of each row's draw from bounds on its inputs.

    Parameters
    ----------
    ylo, yhi : torch.Tensor
        ``[R, V]`` float32, ``ylo <= y <= yhi`` elementwise, ``-inf`` on both for masked tokens.
    seeds : torch.Tensor
        ``[R]`` int64, the seeds the sampler will pass to ``fused_gumbel_argmax`` (ignored
        for greedy rows).
    greedy : torch.Tensor
        ``[R]`` bool, rows drawn by ``greedy_argmax`` rather than the Gumbel kernel.
    ids : torch.Tensor, optional
        ``[R, V]`` int64, the token id of each column (packed rows, :func:`certify_draw_packed`:
        its noise is that token's); default: the column is the token.
    outside : Outside, optional
        ``[R]`` summaries of the tokens not in ``ylo, yhi`` (module docstring); they are
        never the winner nor listed as contenders: a row they may contend in is not certified.
    stats : RowStats, optional
        ``row_stats(ylo, yhi, min(TOP_FIRST, V))`` where the caller has it already.
    ops : DrawOps, optional
        The passes over the bounds, bound once by the caller's head adapter
        (:attr:`.HeadAdapter.draw`); default: each call picks kernel or reference.

    Returns
    -------
    DrawCertificate
        ``certified[r]`` proves the draw returns ``winner[r]``; otherwise ``contenders[r]`` are
        the tokens whose bounds must be tightened (scored exactly) to decide.
    """
    R, V = ylo.shape
    dev = ylo.device
    st = ops.row_stats(ylo, yhi, min(TOP_FIRST, V)) if stats is None else stats  # one pass for what is read first
    lmax, hmax = st.lmax, st.hmax  # NaN propagates
    finite = (lmax > -math.inf) & (hmax < math.inf)  # (false for NaN too)
    if outside is not None:
        finite &= outside.usable()
    if not bool(finite.all()):
        ylo = ylo.masked_fill(~finite[:, None], -math.inf)
        yhi = yhi.masked_fill(~finite[:, None], -math.inf)
        lmax, hmax = lmax.masked_fill(~finite, -math.inf), hmax.masked_fill(~finite, -math.inf)
    bar = lmax.double()
    absmax_r = torch.zeros(R, dtype=torch.float64, device=dev)
    samp = finite & ~greedy
    if R and bool(samp.all()):  # every row sampled: the greedy passes below would all be overwritten
        winner = torch.zeros(R, dtype=torch.long, device=dev)
        contenders = None
        certified = torch.zeros(R, dtype=torch.bool, device=dev)
    else:
        # greedy rows (and unusable ones): w = the first maximum of ylo (row_stats' top index, ties
        # to the lowest; with the torch reference a tie may go either way, and then a tied token
        # is a contender: never certified); contenders: j with yhi_j >= ylo_w
        winner = st.top_indices[:, 0].clone()
        g = ~samp
        if bool(g.all()):
            contenders = yhi >= lmax[:, None]
            certified = finite & (contenders.sum(1) == 1)  # only w itself (yhi_w >= ylo_w always)
        else:  # on those rows only: the sampled rows' passes below replace theirs
            gr = g.nonzero().squeeze(1)
            cg = yhi[gr] >= lmax[gr, None]
            contenders = torch.zeros((R, V), dtype=torch.bool, device=dev)
            contenders[gr] = cg
            certified = torch.zeros(R, dtype=torch.bool, device=dev)
            certified[gr] = finite[gr] & (cg.sum(1) == 1)
        if outside is not None:  # every block token: y_j <= hi < ylo_w <= y_w
            certified &= outside.max_hi() < bar
    if bool(samp.any()):
        rows = samp.nonzero().squeeze(1)
        every = rows.numel() == R  # the usual batch: no copies of the rows (rows_of)
        lo_r, hi_r = rows_of(ylo, rows), rows_of(yhi, rows)
        tok = None if ids is None else rows_of(ids, rows)
        seeds_r = seeds[rows]
        # max |y| over the finite bounds (no NaN or +inf in these rows; -inf counts as 0):
        # max(|max hi|, -min lo, -min hi), since lo <= hi and the largest value is max hi
        absmax = rows_of(st.absmax, rows)
        if outside is not None:
            absmax = torch.maximum(absmax.double(), rows_of(outside.absmax, rows).amax(1))
        delta = noise_margin(absmax)  # [r] float64
        direct = V <= DIRECT_BELOW  # few columns (a later round's, on the contenders): every live token's noise
        # else: first threshold from the noisy lower bounds of the TOP_FIRST highest lower bounds;
        # token j needs g_j >= t + (max yhi - yhi_j): by levels of LEVEL below the row's max
        # (computed in float64: the difference of two fp32 is exact to 2^-52 relative, so
        # level k means max yhi - yhi_j >= (k - 0.01) LEVEL), each level's threshold from
        # bits alone; the TOP_FIRST tokens are kept whatever their bits (best is over them too)
        c = ops.draw_contenders(lo_r, hi_r, seeds_r, rows_of(hmax, rows), delta, rows_of(st.top_values, rows),
                            rows_of(st.top_indices, rows), tok, direct, LEVEL, LEVELS)
        if contenders is None:  # (else the greedy pass left these rows all False)
            contenders = torch.zeros((R, V), dtype=torch.bool, device=dev)
        contenders[rows[c.rows] if not every else c.rows, c.cols] = True
        w = c.winner.clamp_max(V - 1)  # V: no finite noisy score (never certified)
        cut = c.best - 2 * delta
        ok = (c.count == 1) & (c.best > -math.inf)
        if outside is not None:  # every block token's computed noisy bound is below best - 2 delta
            ok &= rows_of(outside.noisy, rows).amax(1) < cut
        if every:  # (whole-row assignments: the row-indexed writes are a dozen small ops)
            winner, bar, absmax_r, certified = w, cut, absmax.double(), ok & finite
        else:
            winner[rows] = w
            bar[rows] = cut
            absmax_r[rows] = absmax.double()
            certified[rows] = ok & finite[rows]
    if not bool(finite.all()):
        contenders &= finite[:, None]
    return DrawCertificate(winner, certified, contenders, finite, bar, absmax_r, hmax.double())


def certify_draw_packed(ylo: torch.Tensor, yhi: torch.Tensor, seeds: torch.Tensor,
                        greedy: torch.Tensor, ops: DrawOps = PER_CALL, summary: bool = False) -> DrawCertificate:
    """:func:`certify_draw`, on each row's live tokens only when every row has few of them.

    A token whose upper bound is ``-inf`` (masked; dropped by min-p, top-k or top-p) is never the
    winner nor a contender, and adds nothing to the noise margin's ``max |y|``: the certificate
    of the row without it is the same. So when no row has more than :data:`PACK_BELOW` of the
    vocabulary live (top-k rows: about ``k``), each row's live tokens are packed into ``[R, n]``
    in token order (``-inf`` padding) and only their noise is hashed. Ties are broken by the
    lowest column, which is the lowest token id, as in the full row. (NaN bounds stay live: such
    a row is never certified.) Same arguments and result as :func:`certify_draw` (no outside
    blocks; ``ops`` as there); with ``summary``, the result's ``rest`` holds :func:`ruled_out`
    of it (``[R]``-sized work: the rounds ask for it where a later round may go on from it)."""
    cert = _certify_draw_packed(ylo, yhi, seeds, greedy, ops)
    if summary:
        cert.rest = ruled_out(cert, greedy)
    return cert


def _certify_draw_packed(ylo: torch.Tensor, yhi: torch.Tensor, seeds: torch.Tensor, greedy: torch.Tensor,
                         ops: DrawOps) -> DrawCertificate:
    R, V = yhi.shape
    st = ops.row_stats(ylo, yhi, min(TOP_FIRST, V)) if R else None
    n = int(st.live.max()) if R else 0
    if n > PACK_BELOW * V:
        return certify_draw(ylo, yhi, seeds, greedy, stats=st, ops=ops)
    cols = ops.pack_live(ylo, yhi, max(n, 1))  # V: padding
    pad = cols == V
    ids = cols.masked_fill(pad, 0)
    plo = ylo.gather(1, ids).masked_fill_(pad, -math.inf)
    phi = yhi.gather(1, ids).masked_fill_(pad, -math.inf)
    cert = certify_draw(plo, phi, seeds, greedy, ids, ops=ops)
    contenders = torch.zeros((R, V + 1), dtype=torch.bool, device=yhi.device)
    contenders.scatter_(1, cols, cert.contenders & ~pad)
    return DrawCertificate(ids.gather(1, cert.winner[:, None])[:, 0], cert.certified, contenders[:, :V], cert.finite,
                           cert.bar, cert.absmax, cert.hmax)


def certify_columns(ylo: torch.Tensor, yhi: torch.Tensor, seeds: torch.Tensor, greedy: torch.Tensor,
                    cols: torch.Tensor, rest: Outside, V: int, ops: DrawOps = PER_CALL) -> DrawCertificate:
    """:func:`certify_draw` on the columns ``cols`` (``[n]`` int64, ascending: ties still go to
    the lowest token id), whose bounds are ``ylo, yhi`` (``[R, n]``), every other token of the
    ``V`` in ``rest`` (a later round's: :func:`ruled_out`; ``ops``: the adapter's bound passes);
    the result in full-vocabulary coordinates."""
    R = ylo.shape[0]
    cert = certify_draw(ylo, yhi, seeds, greedy, cols.expand(R, -1), rest, ops=ops)
    contenders = torch.zeros((R, V), dtype=torch.bool, device=ylo.device)
    contenders[:, cols] = cert.contenders
    winner = cols[cert.winner] if cols.numel() else cert.winner
    return DrawCertificate(winner, cert.certified, contenders, cert.finite, cert.bar, cert.absmax, cert.hmax)


def ruled_out(cert: DrawCertificate, greedy: torch.Tensor) -> Outside:
    """The tokens ``cert`` ruled out (its non-contenders), as one outside block per row, for
    :func:`certify_draw` on the other columns only in a later round.

    The block promises what ruled those tokens out: greedy rows, ``yhi_j < bar = lmax``;
    sampled rows, computed ``yhi_j + g_j < bar = best - 2 delta`` (the listed tokens by the
    comparison itself, the others by :func:`~.gumbel.bits_below`'s margin), with ``delta`` the
    margin of ``absmax``, and ``yhi_j <= hmax``; as summaries, ``<=`` the largest float64 below
    ``bar`` (the later round's tests are strict). These hold in every later round as long as each
    token's bounds only tighten and the map to the draw's inputs is per token and monotone
    (then ``yhi_j`` only falls): the later round's ``lmax`` / ``best`` is at least this one's,
    its ``delta`` at most (``absmax`` caps it), and the block's strict tests (``hi < lmax``,
    ``noisy < best - 2 delta``) hold unless the bound did not rise at all, where the row just
    stays undecided. Read by :func:`certify_draw` only: no softmax masses (``lel``, ``leh``,
    ``lo`` are the vacuous ``-inf``, ``+inf``, ``-inf``), and ``absmax`` is over finite bounds
    (a ``-inf`` counts as 0, as in the certificate). A row whose certificate was not usable
    (``finite`` false) gets NaN summaries: never certified from them.

    Parameters
    ----------
    cert : DrawCertificate
        ``[R]`` rows.
    greedy : torch.Tensor
        ``[R]`` bool, as passed to the certificate.

    Returns
    -------
    Outside
        ``[R, 1]`` float64 summaries.
    """
    bad = ~cert.finite[:, None]

    def col(x: torch.Tensor) -> torch.Tensor:
        return x.double()[:, None].masked_fill(bad, math.nan)

    g = greedy.to(cert.bar.device)
    vacuous = torch.full((cert.bar.shape[0], 1), -math.inf, dtype=torch.float64, device=cert.bar.device)
    # The promises are strict (< bar) and the later round's tests are too (a block's summaries
    # may be attained, as another shard's are): the largest float64 below bar keeps the promise
    # and passes the test when the later bar equals this one (the best came from a token scored
    # before this round, and nothing rose: the row would stay undecided with bar itself).
    below = torch.nextafter(cert.bar, torch.full_like(cert.bar, -math.inf))
    return Outside(hi=col(torch.where(g, below, cert.hmax)), noisy=col(below.masked_fill(g, -math.inf)),
                   lel=vacuous, leh=-vacuous, absmax=col(cert.absmax), lo=vacuous)
