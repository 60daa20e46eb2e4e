"""Certify the sampler's draw under tensor parallelism: one decision, from gathered numbers.

:func:`~.rows.certify_rows` over a vocabulary-sharded head (:class:`~vllm_csv.sharded.ShardedHead`).
Each rank bounds only its shard; the draw must be decided identically on every rank (the
ranks then sample from the same logits with the same seeds, so vLLM's unchanged sampler draws
the same token everywhere). A round, run by every rank in the same order (the number of rounds
is itself decided from gathered numbers):

1. per rank, on its shard's real rows (padding excluded): bounds of the values the dense head
   hands to the sampler (:class:`.HeadAdapter` over the shard: screen bounds, or the exact
   scores' rounding intervals once scored), then the caller's ``process`` (vLLM's logits
   processors, penalties and temperature, run on a ``[R, V]`` copy whose other ranks' columns
   are ``-inf``: every such step is elementwise per (row, token) and maps ``-inf`` to
   ``-inf``, so the shard's columns come out as on the full row);
2. per rank and row, the tokens that min-p drops whatever the other ranks hold are left out
   (:func:`~.nucleus.min_p.min_p_drops_on_part`: the rank's own largest lower bound is at most the
   row's maximum; min-p's ``-inf`` is then exactly what the dense row has for them). Of the
   others, the :data:`EXPLICIT` tokens of highest processed upper bound ``yhi`` and
   :data:`EXPLICIT` more of highest noisy upper bound ``yhi + g`` (sampled rows; ``g`` the
   Gumbel noise of the token's *global* id) are sent one by one: ``(id, ylo, yhi, value)``
   (``value`` the exact score, NaN while unscored). Every other token of the shard goes into
   one of ``L = len(LEVELS) + MASS_BLOCKS`` blocks, each a range of ``yhi``
   (:func:`_block_of`): cut where the gap below the rank's largest ``yhi`` crosses one of
   :data:`LEVELS` and where the upper mass ahead crosses one of :data:`MASS_BLOCKS` equal
   shares (on a grid of ``1 / FINE``). Each block is summed up in
   :class:`~.outside.Outside` summaries (largest ``yhi``, largest ``fl64(yhi + g)`` rounded
   up, log-masses rounded outwards, largest ``|bound|``, smallest ``ylo``). Any partition is
   sound; this one keeps what a token's top-p decision cannot place (the block its lower
   bound falls in) within one share of the mass and one bin;
3. **one all-gather** of ``[R, 2 EXPLICIT, 4] + [R, L, 6] + R + 1`` numbers per rank (fp32;
   token ids are exact below ``2^24``; ``771 R + 1`` with the defaults): ``O(R (k + L) tp)``;
   the first round's also carries the seeds (``2 R``) and the shared off-switch's pending step
   time (``1``);
4. every rank builds the same ``[R, V]`` bounds (the explicit tokens; ``-inf`` elsewhere), the
   same outside blocks (every rank's), applies min-p and top-p (:mod:`.nucleus`) and the draw
   certificate (:func:`~.certificate.certify_draw`), all with the blocks. A row is certified
   when its winner is explicit and scored, every rank could
   bound the row (``finite``) and the certificate holds. The contenders not yet scored are
   scored exactly by their owners (the same list on every rank; each scores its own columns)
   and the round repeats, up to :data:`~.scoring.MAX_ROUNDS` more times and the budget.

The decision is a function of the gathered tensor only, computed by the same code on every
rank: the ranks cannot split, whatever their local numbers are (each rank's local numbers are
only *inputs* to the gather). The seeds are among them: vLLM keeps the ranks' RNGs in step,
and a row whose seeds differ between ranks would go dense on every rank rather than split. A certified row is handed to the sampler as the exact values of
its explicit scored tokens and ``-inf`` elsewhere (and where min-p / top-p certainly drop):
every finite value lies within its token's bounds and was beaten by the winner, every other
token (explicit or in the block) was compared through its bounds, so vLLM's draw returns the
winner (the argument of :mod:`.rows` and :mod:`vllm_csv.vllm_plugin.v1.sampler`). Rows
that are not certified are dense on every rank (the caller's collective dense path).
"""

from __future__ import annotations

import math
import torch

from ..fp import round_down32, round_up32
from ..ops.noise import noise_bits_ref as noise_bits, noise_of_bits
from ..ops.topk import row_topk
from .certificate import certify_draw
from .head_adapter import HeadAdapter
from .nucleus.min_p import min_p_bounds, min_p_drops_on_part
from .nucleus.top_p import top_p_bounds
from .outside import Outside
from .scoring import FIRST_GUESS, MAX_ROUNDS, within_budget
from .types import Process, RowsResult
from ..vocabulary import reasons

EXPLICIT = 16  # tokens a rank sends per row and key (highest yhi; highest yhi + g)
NOISY_KEY = True  # the second key: yhi + g on sampled rows (False: yhi again; sound, certifies less)
# A rank's other tokens in blocks (_block_of), cut where yhi lies this far below the rank's largest,
LEVELS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)
MASS_BLOCKS = 96  # and where the upper mass ahead crosses each 1 / MASS_BLOCKS of the blocks' total
FINE = 16  # (both on a grid of 1 / FINE below the largest yhi, up to the last level)
BLOCKS = len(LEVELS) + MASS_BLOCKS  # blocks a rank sends per row
_SUMMARIES = 6  # a block's hi, noisy, lel, leh, absmax, lo


def _lse_pad(x: torch.Tensor) -> torch.Tensor:
    """An upper bound on the error of a float64 ``logsumexp`` of at most ``2^24`` terms with
    value ``x``: each ``exp`` within ``2^-52`` relative, the positive sum within
    ``gamma_(2^24) <= 2^-28`` relative (``log`` turns that into ``<= 2^-27`` absolute), the
    final ``m + log(.)`` and the ``log`` within ``2^-51 |x|``; ``1e-8 + 1e-15 |x|`` covers it."""
    return 1e-8 + 1e-15 * x.abs().nan_to_num(posinf=0.0, neginf=0.0)


class ShardedAdapter:
    """The sampler's view of a :class:`~vllm_csv.sharded.ShardedHead`: its shard's
    :class:`.HeadAdapter` (global ids ``start ... start + n``), the group, and the head's
    shared off-switch, whose pending step time rides on the step's first gather (so every
    rank keeps the same ledger)."""

    def __init__(self, head):
        self.head = head
        self.local = None if head.local is None else HeadAdapter(head.local)
        self.vocab_size, self.dtype = head.vocab_size, head.dtype
        self.budget_columns = head.config.budget_columns(head.vocab_size)  # a batch's rounds together
        self.start, self.n = head.shard.start, head.shard.real
        self.comm = head.comm

    def gather(self, x: torch.Tensor, first: bool) -> torch.Tensor:
        """``[size, len(x)]``; the off-switch's pending time folded in on the step's first gather."""
        sw = self.head.off_switch
        if not first or sw is None:
            return self.comm.all_gather(x)
        g = self.comm.all_gather(torch.cat([x, sw.pending_tensor().to(x.device)]))
        sw.fold(g[:, -1:].cpu())
        return g[:, :-1]


def _explicit_and_block(plo, phi, vals, g, samp, finite, start, min_p):
    """One rank's payload (step 2 of the module docstring): ``[R, 2E, 4]`` explicit tokens,
    ``[R, L, 6]`` block summaries and ``[R]`` finite, flattened (fp32)."""
    R, n = phi.shape
    dead = min_p_drops_on_part(plo, phi, min_p)  # dropped by min-p whatever the other ranks hold
    plo, phi = plo.masked_fill(dead, -math.inf), phi.masked_fill(dead, -math.inf)
    dev = phi.device
    E2, L = 2 * EXPLICIT, BLOCKS
    finite = finite & ~(torch.isnan(plo).any(1) | torch.isnan(phi).any(1))  # (the block maxima skip NaN)
    ex = torch.full((R, E2, 4), -math.inf, device=dev)
    ex[:, :, 0] = -1.0  # no token
    ex[:, :, 3] = math.nan
    block = torch.empty((R, L, _SUMMARIES), device=dev)
    block[..., :4] = -math.inf
    block[..., 4] = 0.0
    block[..., 5] = math.inf
    if n == 0:
        return torch.cat([ex.reshape(-1), block.reshape(-1), finite.float()])
    m1 = min(EXPLICIT, n)
    i1 = row_topk(phi, m1).indices
    key2 = torch.where(samp[:, None] & NOISY_KEY, phi.double() + g, phi.double()).scatter_(1, i1, -math.inf)
    m2 = min(EXPLICIT, n - m1)
    sel = torch.cat([i1, key2.topk(m2, dim=1).indices], 1) if m2 else i1
    m = sel.shape[1]
    ex[:, :m, 0] = (sel + start).float()
    ex[:, :m, 1] = plo.gather(1, sel)
    ex[:, :m, 2] = phi.gather(1, sel)
    ex[:, :m, 3] = vals.gather(1, sel)
    live = torch.ones((R, n), dtype=torch.bool, device=dev).scatter_(1, sel, False) & ~(phi == -math.inf)
    if bool(live.any()):
        # every live token in exactly one block (NaN / inf gaps in block 0)
        gap = phi.masked_fill(~live, -math.inf).amax(1, keepdim=True) - phi
        lvl = _block_of(gap.nan_to_num(nan=0.0), phi, live)
        idx = lvl.masked_fill_(~live, L)  # column L: the tokens in no block (explicit, or -inf)
        block[..., 0] = _seg_max(phi, idx, L)
        noisy = _seg_max(phi.double() + g, idx, L)
        block[..., 1] = round_up32(torch.where(samp[:, None], noisy, -math.inf))
        lel, leh = _seg_logsumexp(plo.double(), idx, L), _seg_logsumexp(phi.double(), idx, L)
        block[..., 2] = round_down32(lel - _lse_pad(lel))
        block[..., 3] = round_up32(leh + _lse_pad(leh))
        mag = torch.maximum(plo.abs(), phi.abs())  # plo = -inf: inf (nothing is known of |y|)
        block[..., 4] = _seg_max(mag, idx, L).clamp_min(0.0)  # an empty block: 0
        block[..., 5] = -_seg_max(-plo, idx, L)  # the smallest ylo (exact: a min of fp32); empty: +inf
    return torch.cat([ex.reshape(-1), block.reshape(-1), finite.float()])


def _block_of(gap: torch.Tensor, phi: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``[R, n]`` int64: each live token's block in ``[0, BLOCKS)``.

    ``gap`` (``>= 0``) is how far the token's ``yhi`` (``phi``) lies below the rank's largest.
    Tokens are first put in bins of ``1 / FINE`` of gap (one bin past the last level); a bin's
    block is the number of :data:`LEVELS` at or below its start plus how many
    ``1 / MASS_BLOCKS`` shares of the live upper mass lie in the bins before it. Both parts
    grow with the gap, so each block is a range of ``yhi`` with every level and share as a
    boundary. (Any partition is sound. This one keeps a block's mass, hence what a token's
    top-p decision cannot place, within one share and one bin, and the deep tail, little mass
    but the largest noise, apart by level.)
    """
    R, n = phi.shape
    dev = phi.device
    nb = int(LEVELS[-1] * FINE) + 1
    fine = (gap * FINE).floor_().clamp_(0, nb - 1).long()
    fine.masked_fill_(~live, nb)
    starts = torch.arange(nb, dtype=torch.float64, device=dev) / FINE
    lpart = torch.bucketize(starts, torch.tensor(LEVELS, dtype=torch.float64, device=dev), right=True)
    key = phi.masked_fill(~live, -math.inf).double()
    w = torch.exp(key - key.amax(1, keepdim=True)).nan_to_num_(nan=0.0)  # live: in (0, 1]
    mass = torch.zeros((R, nb + 1), dtype=torch.float64, device=dev).scatter_add_(1, fine, w)[:, :nb]
    ahead = (mass.cumsum(1) - mass) / mass.sum(1, keepdim=True).clamp_min(1e-300)
    mpart = (ahead * MASS_BLOCKS).floor_().long().clamp_(0, MASS_BLOCKS - 1)
    table = torch.cat([lpart[None] + mpart, torch.zeros((R, 1), dtype=torch.long, device=dev)], 1)
    return table.gather(1, fine)


def _seg_max(x: torch.Tensor, idx: torch.Tensor, L: int) -> torch.Tensor:
    """``[R, L]``: per row, the largest ``x [R, n]`` of each block ``idx [R, n]`` (``L``: none;
    ``-inf`` for an empty block; NaN entries are skipped: rows with NaN are not ``finite``)."""
    out = torch.full((x.shape[0], L + 1), -math.inf, dtype=x.dtype, device=x.device)
    return out.scatter_reduce_(1, idx, x, "amax")[:, :L]


def _seg_logsumexp(x: torch.Tensor, idx: torch.Tensor, L: int) -> torch.Tensor:
    """``[R, L]`` float64 ``log sum exp`` of each block, computed as ``torch.logsumexp`` does
    (shift by the block's maximum, sum, log: :func:`_lse_pad` bounds the error); ``-inf`` for an
    empty block or one of ``-inf`` terms only."""
    m = _seg_max(x, idx, L)
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    shift = torch.cat([shift, torch.zeros_like(shift[:, :1])], 1)
    e = torch.exp(x - shift.gather(1, idx))
    tot = torch.zeros((x.shape[0], L + 1), dtype=x.dtype, device=x.device).scatter_add_(1, idx, e)[:, :L]
    return shift[:, :L] + torch.log(tot)


def _combine(G: torch.Tensor, R: int, V: int):
    """Step 4's inputs from the gathered ``[size, len]``: ``ylo, yhi, val [R, V]`` (val NaN where
    not an explicit scored token), the outside blocks (every rank's: ``[R, size L]``),
    ``finite [R]`` and the scored count."""
    size = G.shape[0]
    E2, L = 2 * EXPLICIT, BLOCKS
    ne = R * E2 * 4
    ex = G[:, :ne].reshape(size, R, E2, 4).permute(1, 0, 2, 3).reshape(R, size * E2, 4)
    ids = ex[:, :, 0].long()
    cols = torch.where(ids >= 0, ids, V)  # column V: the slots without a token
    out = []
    for j, fill in ((1, -math.inf), (2, -math.inf), (3, math.nan)):
        t = torch.full((R, V + 1), fill, device=G.device)
        out.append(t.scatter_(1, cols, ex[:, :, j])[:, :V])
    nb = R * L * _SUMMARIES
    bl = G[:, ne : ne + nb].reshape(size, R, L, _SUMMARIES).permute(1, 0, 2, 3).reshape(R, size * L, _SUMMARIES)
    outside = Outside(*bl.double().unbind(2))
    finite = (G[:, ne + nb : ne + nb + R] > 0.5).all(0)
    return out[0], out[1], out[2], outside, finite, int(G[:, -1].sum())


def certify_rows_sharded(adapter: ShardedAdapter, hidden: torch.Tensor, process: Process,
                         min_p: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor, greedy: torch.Tensor,
                         masked: torch.Tensor | None = None) -> RowsResult:
    """Certify the draw of each row of ``hidden [R, d]`` (module docstring).

    Parameters
    ----------
    adapter : ShardedAdapter
        This rank's view; every rank of the group calls with the same rows, seeds, processing
        and masks (vLLM's ranks run the same sampler on the same metadata).
    hidden : torch.Tensor
        ``[R, d]`` model dtype.
    process : callable
        ``(lo, hi) -> (ylo, yhi)``, ``[R, V]`` float32: vLLM's processors, penalties and
        temperature on bounds (elementwise per token, monotone; **without** min-p / top-p).
    min_p, top_p : torch.Tensor
        ``[R]`` float32 (``0`` / ``1``: off).
    seeds, greedy, masked
        As :func:`~.rows.certify_rows`.

    Returns
    -------
    RowsResult
        The same on every rank; ``values`` exact on the certified rows' explicit scored
        tokens, ``-inf`` elsewhere.
    """
    R, V, dev = hidden.shape[0], adapter.vocab_size, hidden.device
    s0, n = adapter.start, adapter.n
    own = slice(s0, s0 + n)
    if adapter.local is not None:
        lo, hi, hnorm, finite_l = adapter.local.intervals(hidden)
        lo = torch.full_like(hi, -math.inf) if lo is None else lo
        if masked is not None:
            lo.masked_fill_(masked[:, own], -math.inf)
            hi.masked_fill_(masked[:, own], -math.inf)
    else:
        lo = hi = torch.empty((R, 0), device=dev)
        finite_l = torch.ones(R, dtype=torch.bool, device=dev)
    vals = torch.full((R, n), math.nan, device=dev)  # exact scores (model dtype values), NaN: unscored
    scored_here = 0
    samp = ~greedy
    g = torch.zeros((R, n), dtype=torch.float64, device=dev)
    if n and bool(samp.any()):
        g[samp] = noise_of_bits(noise_bits(seeds[samp], torch.arange(s0, s0 + n, device=dev)))
    budget = adapter.budget_columns
    over_budget = torch.zeros(R, dtype=torch.bool, device=dev)
    for rnd in range(MAX_ROUNDS + 1):
        full_lo = torch.full((R, V), -math.inf, device=dev)
        full_hi = full_lo.clone()
        full_lo[:, own], full_hi[:, own] = lo, hi
        plo, phi = (x[:, own] for x in process(full_lo, full_hi))
        payload = _explicit_and_block(plo, phi, vals, g, samp, finite_l, s0, min_p.to(dev))
        if rnd == 0:  # the seeds, in 16-bit halves (exact in fp32): rows whose seeds differ go dense
            payload = torch.cat([payload, (seeds >> 16).float(), (seeds & 0xFFFF).float()])
        G = adapter.gather(torch.cat([payload, torch.tensor([float(scored_here)], device=dev)]), rnd == 0)
        if rnd == 0:
            sd = G[:, -1 - 2 * R : -1]
            same_seeds = (sd == sd[:1]).all(0).reshape(2, R).all(0)  # vLLM keeps the ranks' RNGs in step
            G = torch.cat([G[:, : -1 - 2 * R], G[:, -1:]], 1)
        ylo, yhi, val, outside, finite, total = _combine(G, R, V)  # the same on every rank
        finite &= same_seeds
        ylo, yhi, outside = min_p_bounds(ylo, yhi, min_p.to(dev), outside)
        ylo, yhi, outside = top_p_bounds(ylo, yhi, top_p.to(dev), outside)
        cert = certify_draw(ylo, yhi, seeds, greedy, outside=outside)
        scored = ~torch.isnan(val)  # [R, V]: explicit and scored (a column is scored for every row)
        winner = cert.winner
        certified = cert.certified & finite & scored.gather(1, winner[:, None])[:, 0]
        open_rows = finite & ~certified & ~over_budget
        scored_col = scored.any(0)
        need = (cert.contenders & ~scored)[open_rows].any(0)
        blind = open_rows & ~cert.finite & (yhi > -math.inf).any(1)
        if bool(blind.any()):  # as certify_rows: no token certainly kept yet
            top = row_topk(yhi[blind], min(FIRST_GUESS, V))
            need[top.indices[top.values > -math.inf]] = True
            need &= ~scored_col
            cert.contenders[blind] = False
            cert.contenders[blind.nonzero().squeeze(1)[:, None], top.indices] = top.values > -math.inf
        if not bool(need.any()) or rnd == MAX_ROUNDS:
            break
        new = need.nonzero().squeeze(1)
        room = budget - total
        if new.numel() > room:  # as certify_rows
            take, over_budget = within_budget((cert.contenders & ~scored).sum(1), open_rows, over_budget, room)
            if take.numel() == 0:
                over_budget |= open_rows
                break
            new = (cert.contenders[take].any(0) & ~scored_col).nonzero().squeeze(1)
        ids = new[(new >= s0) & (new < s0 + n)] - s0  # this rank's columns
        if ids.numel():
            v, lower, upper = adapter.local.score(hidden, ids, hnorm)
            vals[:, ids] = v.float()
            lo[:, ids], hi[:, ids] = lower, upper
            if masked is not None:
                m = masked[:, own][:, ids]
                lo[:, ids] = lo[:, ids].masked_fill(m, -math.inf)
                hi[:, ids] = hi[:, ids].masked_fill(m, -math.inf)
            scored_here += ids.numel()
    values = torch.where(scored & (yhi > -math.inf), val, -math.inf).to(adapter.dtype)
    if masked is not None:
        values.masked_fill_(masked, -math.inf)
    open_rows = finite & ~certified & ~over_budget
    over_budget |= open_rows & (cert.contenders & ~scored).any(1)
    return RowsResult(values, certified, winner, reasons(certified, finite, over_budget), total)

