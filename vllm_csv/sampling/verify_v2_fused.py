"""V2's verification of sampled requests certified on the device (CUDA; the kernels' torch
references elsewhere): :mod:`.verify_v2`'s certificate for temperature sampling, one-hot or
probabilistic drafts, with min-p and vLLM's V2 processors or without, as a fixed sequence of the
fused step's kernels and torch passes over ``[N, nb]`` and ``[N, CAP * SUB]`` (``[N, V]`` for the
drafter's log-probabilities), instead of rounds over ``[N, V]``.

Pipeline, for ``N`` rows of ``R`` requests (each request's rows contiguous, its bonus row last)::

    screen_rows    h [N, d]                 -> umax, lmax [N, nb], ok [N]    (FusedStep, once)
    draw_select    block bounds, the draft's block first -> cand [N, CAP]   (where the mass is)
    score_blocks   h, W, cand               -> lower, upper [N, CAP * SUB]  (dense intervals)
    (processors    vLLM's own, on the block bounds and the intervals: gpu.processed; then min-p's
                   threshold bounds from them, as the device draw takes them)
    lse_bounds_blocks / decide_from (torch, float64) -> each row's decision [N]
                   (probabilistic drafts: with the draft's log-probability, draft_logprob_bounds)
    first_rows     decisions                -> row_a [R]                    (segment sums)
    draw_v2        rows a, the rejected draft masked, the screen reused -> token, code [R]
                   (probabilistic drafts: a rejected row's residual, residual_process)

Each row's lse is bounded from its candidates' exact intervals and, for every other block, its
token count times the exponential of its bound (:func:`lse_bounds_blocks`); the draft's block is
always a candidate, so the draft's value is an exact interval. The decisions are
:func:`~.verify_v2_bounds.decide_from`'s, the rule of the reference path; the draw after the
first row not accepted is the device draw (:meth:`~vllm_csv.gpu.step.FusedStep.draw_v2`) on that
row with its draft ``removed`` (in the row when min-p takes its threshold, then out of the draw,
as V2 has it) or on the bonus row. With probabilistic drafts a rejected row is drawn from its
residual at ``T = 1`` (:func:`residual_process`: the map the draw runs on its blocks' bounds and
its candidates' intervals, with the lse, the row's maximum and min-p's threshold taken from the
acceptance's bounds). What is handed to V2's kernels: accepted rows the draft alone, row ``a``
the certified token alone (its draft ``-inf``: rejected; then the draw returns the one finite
token; a residual's winner where :func:`~.verify_v2_bounds.residual_alone_ok` holds), later rows
``-inf``, as :mod:`.verify_v2` hands a probabilistic row's residual.

Host syncs: the results read once at the end (the hook writes the dense rows of the requests
left after reading them). The uniforms are V2's ``tl.rand`` on the device
(:func:`vllm_csv.gpu.philox.philox_uniform`), so nothing before waits on the host.
"""

from __future__ import annotations

import math

import torch

from ..gpu.common import SUB, slot_ids
from ..gpu.draw_bounds import block_upper, draw_select
from ..gpu.philox import philox_uniform
from ..gpu.processed import processed_block_hi, processed_candidates
from ..gpu.score import score_blocks
from .gumbel_v2 import min_p_bounds, temperature_bounds
from .rows_v2 import Bounds
from .verify_v2 import Verified, process_rows
from .verify_v2_bounds import (REJECT, UNDECIDED, decide_from, draft_logprob_bounds, first_rows, residual_alone_ok,
                               shifted_residual_bounds)

_DRAW_REASONS = {1: "nonfinite", 2: "nonfinite"}  # (gpu.gumbel_draw's codes; the rest: "uncertified")


def min_p_kept(qlo: torch.Tensor, qhi: torch.Tensor, block_q: torch.Tensor, min_p: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """What V2's min-p leaves of the candidates' bounds ``qlo, qhi`` (``[N, S]`` fp32) and the other
    blocks' ``block_q`` (``[N, nb]``; a candidate's block among them is not read):
    :func:`~.gumbel_v2.min_p_bounds` on a row of the candidates and one column per block (its
    tokens' upper bound, no lower bound), so a token not surely kept loses its lower bound and
    one surely dropped (and a block all of whose tokens are) both. Rows with ``min_p`` 0,
    negative or NaN are left alone (V2's kernel does). Returns ``(qlo, qhi, block_q, (m_lo, m_hi))``,
    float64 ``[N]`` bounds of the row's maximum ``m`` (a NaN bound: unknown, ``-inf`` below, ``+inf``
    above), which min-p keeps."""
    S = qlo.shape[1]
    m_lo = torch.where(torch.isnan(qlo), -math.inf, qlo).amax(1).double()
    m_hi = torch.maximum(torch.where(torch.isnan(qhi), math.inf, qhi).amax(1),
                         torch.where(torch.isnan(block_q), math.inf, block_q).amax(1)).double()
    lo, hi, _ = min_p_bounds(torch.cat([qlo, torch.full_like(block_q, -math.inf)], 1), torch.cat([qhi, block_q], 1),
                             min_p, m=(m_lo, m_hi))
    return lo[:, :S], hi[:, :S], hi[:, S:], (m_lo, m_hi)


def lse_bounds_blocks(qlo: torch.Tensor, qhi: torch.Tensor, block_q: torch.Tensor, cand: torch.Tensor, V: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bounds on each row's real ``log sum exp(x)`` from its candidates and its blocks.

    Parameters
    ----------
    qlo, qhi : torch.Tensor
        ``[N, S]`` float32, the candidate slots' bounds on ``x`` (``-inf`` on both sides at an
        empty slot).
    block_q : torch.Tensor
        ``[N, nb]`` float32, an upper bound on ``x`` of every token of each block (NaN: unknown).
    cand : torch.Tensor
        ``[N, CAP]`` int32, the candidate blocks (``-1``: none), whose tokens are the slots.
    V : int
        Tokens in the row (the last block holds ``V - (nb - 1) SUB``).

    Returns
    -------
    (llo, lhi, gmax) : float64 ``[N]`` each
        ``llo <= lse <= lhi`` (the candidates' lower bounds alone below; above, their upper
        bounds and each other block's count times its bound), and ``gmax >= |max x|``. NaN or
        ``+inf`` in a block's bound makes ``lhi`` NaN or ``+inf`` (no decision reads it).
    """
    N, nb = block_q.shape
    is_cand = torch.zeros((N, nb + 1), dtype=torch.bool, device=cand.device)
    is_cand.scatter_(1, torch.where(cand >= 0, cand, nb).long(), True)
    counts = torch.full((nb,), float(SUB), dtype=torch.float64, device=cand.device)
    counts[-1] = V - (nb - 1) * SUB
    other = block_q.double().masked_fill(is_cand[:, :nb], -math.inf)
    # (float64's rounding here is far inside the slack the decision adds: logprob_slack)
    llo = torch.logsumexp(qlo.double(), 1)
    lhi = torch.logsumexp(torch.cat([qhi.double(), other + counts.log()[None]], 1), 1)
    top = torch.maximum(qhi.amax(1), torch.where(torch.isnan(other), math.inf, other).amax(1).float())
    gmax = torch.maximum(qlo.amax(1).double().abs(), top.double().abs())
    return llo, lhi, gmax


def residual_process(process: Bounds | None, residual: torch.Tensor, temp: torch.Tensor, min_p: torch.Tensor | None,
                     m: tuple[torch.Tensor, torch.Tensor] | None, dlp: tuple[torch.Tensor, torch.Tensor],
                     lse: tuple[torch.Tensor, torch.Tensor], gmax: torch.Tensor) -> Bounds:
    """The map the device draw runs on the bounds of ``R`` drawn rows (``[R, V]``, some tokens
    only: a block's bound spread over its tokens, the candidates' intervals): on ``residual``
    rows (``[R]`` bool) vLLM's processors, the temperature, min-p with the whole row's maximum
    within ``m`` and the residual shifted by a constant of the row
    (:func:`~.verify_v2_bounds.shifted_residual_bounds`, which the draw's comparisons do not see) of
    the draft's log-probabilities ``dlp`` (``[R, V]`` float64) with the row's lse within ``lse``
    and ``|G| <= gmax`` (all from the acceptance's bounds, since the rows given hold some tokens
    only: nothing is taken from them but each token's own bounds, so the map is per token and
    monotone); on the other rows (bonus rows, drawn as usual) the processors alone."""
    def run(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if process is not None:
            lo, hi = process(lo, hi)
        qlo, qhi = temperature_bounds(lo, hi, temp)
        if min_p is not None:
            qlo, qhi, _ = min_p_bounds(qlo, qhi, min_p, m=m)
        rlo, rhi = shifted_residual_bounds(qlo, qhi, *dlp, lse, gmax)
        return torch.where(residual[:, None], rlo, lo), torch.where(residual[:, None], rhi, hi)
    return run


def verify_fused(step, hidden: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor, temp: torch.Tensor,
                 drafts: torch.Tensor, cu: list[int], process: Bounds | None = None,
                 min_p: torch.Tensor | None = None, draft_logits: torch.Tensor | None = None) -> Verified:
    """Certify V2's verification of ``R`` requests on the device (module docstring).

    Parameters
    ----------
    step : FusedStep
        The head's fused step (:meth:`~vllm_csv.head.CertifiedHead.fused_step`; plain engine).
    hidden, seeds, pos, temp, drafts, cu, process, min_p, draft_logits
        As :func:`~.verify_v2.certify_verification_v2` (``temp > 0``):
        ``process`` (vLLM's processors on ``[N, V]`` bounds of all the rows) runs on the blocks'
        bounds and the candidates' intervals (:mod:`vllm_csv.gpu.processed`), and on the drawn
        rows' through :func:`~.verify_v2.process_rows`; ``min_p`` (``[N]`` fp32) through
        :func:`min_p_kept`, and in the draw; ``draft_logits`` (``[N, V]``, probabilistic drafts)
        into the acceptance's ratio and a rejected row's residual draw (:func:`residual_process`).

    Returns
    -------
    Verified
        As :func:`~.verify_v2.certify_verification_v2`: the rows to hand to V2 (a certified
        request's accepted rows its drafts alone, its row ``a`` its token alone), per request
        certified, accepted drafts, next token, reason; ``scored`` the tokens scored exactly.
    """
    N, V, R = hidden.shape[0], step.V, len(cu) - 1
    dev = hidden.device
    u = philox_uniform(seeds, pos)
    cu_d = torch.tensor(cu, dtype=torch.long, device=dev)
    umax, lmax, ok = step.screen_rows(hidden)
    c = step.consts
    # the acceptance: each row's blocks of largest bound, the draft's own block first
    bh = block_upper(umax, step.dtype)
    if process is not None:  # (every processed value of a block's tokens below its bound)
        bh = processed_block_hi(process, bh, V)
    target = drafts >= 0
    home = (drafts.clamp(0, V - 1) // SUB)[:, None]  # (a draft past V, which V2 never sends, decides nothing)
    key = bh.scatter(1, home, torch.where(target[:, None], math.inf, bh.gather(1, home)))
    cand, count, _, _, _, ok_rows = draw_select(key, bh, umax, lmax, ok, c["limit"], c["babs_max"], step.cap_for(1))
    _, lower, upper = score_blocks(hidden, step.weight, step.bias, cand, count, step.coef, step.gam, step.tiny32)
    if process is not None:
        lower, upper = processed_candidates(process, cand, count, lower, upper, V)
    ids = slot_ids(cand, count, V)
    valid = ids >= 0
    qlo, qhi = temperature_bounds(lower.masked_fill(~valid, -math.inf), upper.masked_fill(~valid, -math.inf), temp)
    block_q = temperature_bounds(bh, bh, temp)[1]
    m = None
    if min_p is not None:
        qlo, qhi, block_q, m = min_p_kept(qlo, qhi, block_q, min_p)
    llo, lhi, gmax = lse_bounds_blocks(qlo, qhi, block_q, cand, V)
    if min_p is not None:  # (the kept row's maximum is the row's)
        gmax = torch.maximum(gmax, torch.maximum(m[0].abs(), m[1].abs()))
    hit = ids == drafts[:, None]
    xlo = qlo.masked_fill(~hit, -math.inf).amax(1).double()
    xhi = qhi.masked_fill(~hit, -math.inf).amax(1).double()
    d_col = drafts.clamp(0, V - 1)[:, None]
    dlp = None if draft_logits is None else draft_logprob_bounds(draft_logits, temp)
    draft_lp = None if dlp is None else (dlp[0].gather(1, d_col).squeeze(1), dlp[1].gather(1, d_col).squeeze(1))
    dec = decide_from(xlo, xhi, (llo, lhi), gmax, V, drafts, u, draft_lp)
    dec = torch.where(ok_rows.bool(), dec, UNDECIDED)
    # the draw: each request's first row not accepted, its draft removed (the bonus row: none);
    # with probabilistic drafts a rejected row's residual instead (residual_process)
    lead, a = first_rows(dec, cu_d, N)
    row_a = cu_d[:-1] + a
    bonus = row_a == cu_d[1:] - 1
    decided = bonus | (dec[row_a] == REJECT)
    ok_a = (ok[row_a].bool() & ok.bool().all()).to(ok.dtype)
    proc_a = process_rows(process, row_a, N)
    temp_a, min_p_a = temp[row_a], None if min_p is None else min_p[row_a]
    if dlp is None:
        removed = torch.where(bonus, -1, drafts[row_a])
        draw = (temp_a, min_p_a, proc_a)
    else:  # (the residual rows drawn at T = 1, their min-p inside the map)
        removed, residual = torch.full_like(row_a, -1), ~bonus
        draw = (torch.where(residual, 1.0, temp_a), None if min_p_a is None else min_p_a.masked_fill(residual, 0.0),
                residual_process(proc_a, residual, temp_a, min_p_a, None if m is None else (m[0][row_a], m[1][row_a]),
                                 (dlp[0][row_a], dlp[1][row_a]), (llo[row_a], lhi[row_a]), gmax[row_a]))
    token, code, count_a = step.draw_v2(hidden[row_a], seeds[row_a], pos[row_a], draw[0], min_p=draw[1],
                                        process=draw[2], screened=(umax[row_a], lmax[row_a], ok_a), removed=removed)
    certified = decided & (code == 0)
    if dlp is not None:  # (a residual's winner is handed over alone)
        certified &= bonus | residual_alone_ok(token, drafts[row_a], dlp[1][row_a].gather(1, token[:, None]).squeeze(1))
    values = torch.full((N, V), -math.inf, dtype=step.dtype, device=dev)
    values.scatter_(1, drafts.clamp(0, V - 1)[:, None], torch.where(lead, 0.0, -math.inf)[:, None].to(step.dtype))
    values.index_put_((row_a, token), torch.zeros(R, dtype=step.dtype, device=dev))
    scored = step.scored(count).sum() + step.scored(count_a).sum()
    # (the one read of the results: the hook writes the other requests' dense rows after it)
    out = torch.cat([certified.long(), a, token, code.long(), scored[None]]).cpu()
    cert_h, a_h, tok_h, code_h = (out[i * R:(i + 1) * R] for i in range(4))
    reason = [None if bool(ok_) else _DRAW_REASONS.get(int(k), "uncertified")
              for ok_, k in zip(cert_h.tolist(), code_h.tolist())]
    return Verified(values, cert_h.bool(), a_h.tolist(), tok_h.tolist(), reason, int(out[-1]))
