"""The certified V2 Gumbel draw on the device: the token vLLM's Model Runner V2 sampler
(``gumbel_sample``, fp32 noise) draws from a row, decided from exact intervals of a few candidate
blocks and an upper bound on every other block, or the row refused. Three custom ops
(``torch.ops.vllm_csv_gpu.<op>``, each a Triton kernel beside its torch reference ``<op>_ref``,
fixed shapes, no host sync), which :meth:`vllm_csv.gpu.step.FusedStep.draw_v2` runs after the
step's quantize and screen kernels and around its scoring kernel:

1. :func:`~.draw_bounds.block_bounds` (:mod:`.draw_bounds`, with the argument) ``[B, ceil(nb /
   BPP)]`` programs: for every block of ``SUB`` tokens, an upper bound of every token's noisy
   score ``fl32(x_i / T) + g_i`` there, ``qhi(ub_b) + g_hi(min hash)``: the block's logit bound
   through V2's temperature, plus the largest noise of the block (its smallest hash's); with
   ``|qhi|``.
2. :func:`~.draw_bounds.draw_select` ``[B]`` programs: the row's candidates, the ``cap`` blocks
   of largest bound, laid out as :func:`~vllm_csv.gpu.select.select_blocks` does (what
   :mod:`.score` scores exactly); the largest bound and ``|qhi|`` of the other blocks; the
   step's ``ok``.
3. :func:`gumbel_draw` ``[B]`` programs (here): the candidates' own noise (hash and uniform
   replayed bit for bit as vLLM's ``murmur3_hash32`` / ``murmur3_uniform32``, then bounded in
   float64 as :func:`~vllm_csv.gumbel_noise.noise_bounds`; :mod:`.gumbel_jit`) on their exact
   intervals ``lower <= x <= upper``, and the decision: ``token [B]`` int64 and ``code [B]``
   int32 (0 certified, 1 not ``ok``/``live``, 2 an unusable temperature, 3 not certified).

The rule is :func:`vllm_csv.sampling.gumbel_v2.certify_draw_v2`'s (its module has the argument),
with the outside blocks as one column each: ``best = max qlo + g_lo`` over the candidates, ``m =
2^-23 (A + 24)`` (:func:`~vllm_csv.gumbel_noise.comparison_margin`); certified when the winner is
the only candidate with ``qhi + g_hi >= best - 2 m`` and the outside blocks' largest bound is
below ``best - 2 m``. ``A`` is the largest finite ``|qlo|, |qhi|`` of the candidates and
``|qhi(ub_b)|`` of the outside blocks: the margin covers the rounding of the winner's sum
(``|x_w| <= A``) and of a competitor's, which is at most ``fl(hi + g_hi)`` (rounding is
monotone), within ``2^-24 (|hi| + 24)`` of it, so no competitor's lower bound enters (the CPU rule
takes them into ``A`` as well, which only widens it). A row certified here is certified by the
CPU rule on the same bounds spread over every token (``tests/test_gpu_gumbel_draw.py``). Ties and
near-ties are never certified: the comparison is strict with the margin on both sides. A NaN or
``+inf`` bound of an outside block makes its bound ``+inf`` (the row is refused unless that block
is a candidate, scored exactly); NaN or ``+inf`` among the candidates refuses the row. ``T = 0``:
a greedy row, no noise and no margin (V2's argmax); ``T`` negative, NaN or outside ``[2^-126,
2^126]``: refused.

Min-p (V2's ``_min_p_kernel``, after the temperature: a token below ``fl32(m + log(min_p))`` becomes
``-inf``, ``m`` the row's largest tempered logit): ``m`` lies between the candidates' largest
``qlo`` and the larger of their largest ``qhi`` and the outside blocks' (``out_q``), which bounds
the threshold (:func:`~vllm_csv.gumbel_noise.min_p_thresholds`). A candidate not surely kept
(``qlo < thr_hi``) loses its lower bound (it cannot be the winner), one surely dropped (``qhi <
thr_lo``) loses its upper bound, and the outside blocks do not compete when all are surely dropped
(``out_q < thr_lo``), as :func:`~vllm_csv.sampling.gumbel_v2.min_p_bounds` has it on the CPU: the
winner is then a token V2 keeps, ahead of every token it may keep. A min-p of 0, negative or NaN
is none (the kernel masks nothing there); greedy rows ignore it (min-p keeps the maximum),
except where a token is removed after min-p took its threshold (below): the maximum may be that
token, and V2 then masks every token below its threshold, the whole row possibly (token 0), so
such a greedy row is not certified (found by review; V2's verification hook plans no greedy row
with a removed token: latent).

Grammar (structured output: the runner writes ``-inf`` on the tokens its bitmask forbids before
V2's sampler, ``masked [B, V]``): a forbidden candidate is no candidate (``-inf`` on both sides,
so it neither wins nor competes, nor bounds min-p's maximum from below); the outside blocks'
bounds stay upper bounds (masking only lowers a value), and min-p's maximum over the allowed
tokens is at most theirs. :func:`~.draw_bounds.draw_select`'s early min-p drop is not used there
(its lower bound of the maximum is a token the grammar may forbid).

Top-k / top-p (``top``: rows V2 masks with either after min-p, with vLLM's Triton kernels): such
a row is certified only where its winner is also its certain maximum, ``qlo`` of the winner above
the ``qhi`` of every other candidate and of the outside blocks (``out_q``, those min-p surely
drops left out) by :func:`~vllm_csv.gumbel_noise.top_mask_margin` of the row's ``A``; the masks
keep such a token with its value (:func:`vllm_csv.sampling.gumbel_v2.certain_maximum` has the
argument), and the winner beat every token, kept or not. (The CPU certificate also draws, under
a top-k alone, among the tokens the mask surely keeps, :func:`~vllm_csv.sampling.gumbel_v2.top_k_bounds`;
that needs every value of the row bounded below, which the outside blocks' bounds are not, so
here every masked row takes the maximum's rule: ``top`` is read as a flag.)

Removed (V2's verification, :mod:`vllm_csv.sampling.verify_v2_fused`: after a rejection, V2 draws
from the row processed whole, min-p included, with the rejected draft then set to ``-inf``): a
candidate named in ``removed`` enters min-p's maximum as any other token, then has ``-inf`` on both
sides (it neither wins nor competes). Left among the outside blocks, it only raises their bound.
"""

from __future__ import annotations

import math

import torch

from ..gumbel_noise import (LOG_ABS, LOG_REL, comparison_margin, finite_abs_max, min_p_thresholds, top_mask_margin,
                            top_prob_gap, uniform)
from .common import CAP, INTERPRET, LIB, SUB, _launch, _use_triton, slot_ids, tl, triton
from .gumbel_jit import _noise_bounds_ref, _q_bounds, _temp_ref

BPP = 16  # blocks (of SUB tokens) a program of block_bounds hashes: 1024 tokens, vLLM's tile
CODE_CERTIFIED, CODE_NOT_LIVE, CODE_TEMPERATURE, CODE_UNCERTIFIED = 0, 1, 2, 3


# ---- torch reference ------------------------------------------------------------------------
def gumbel_draw_ref(cand, count, lower, upper, out_hi, out_abs, out_q, seeds, pos, temp, min_p, live, V: int,
                    masked=None, removed=None, top=None):
    """``(token [B] int64, code [B] int32)``: the decision (module docstring, 3.) in torch.

    Parameters
    ----------
    cand, count : torch.Tensor
        ``[B, CAP]`` int32 candidate block ids (``-1`` past ``count``), ``[B]`` int32.
    lower, upper : torch.Tensor
        ``[B, CAP * SUB]`` fp32 bounds of the candidate tokens' logits (the slots of
        :func:`~vllm_csv.gpu.score.score_blocks`; slots past ``count`` are not read).
    out_hi, out_abs, out_q : torch.Tensor
        ``[B]`` fp32: the other blocks' largest noisy bound, finite ``|qhi|`` and ``qhi``
        (:func:`~.draw_bounds.draw_select`).
    seeds, pos, temp : torch.Tensor
        ``[B]``: as :func:`~.draw_bounds.block_bounds_ref`.
    min_p : torch.Tensor
        ``[B]`` fp32, each row's min-p (0, negative or NaN: none, as V2's kernel reads it; greedy
        rows: ignored, min-p keeps the maximum).
    masked : torch.Tensor, optional
        ``[B, V]`` bool, the tokens a grammar's bitmask set to ``-inf`` before the sampler (module
        docstring, grammar).
    live : torch.Tensor
        ``[B]`` int8, rows that may be certified.
    removed : torch.Tensor, optional
        ``[B]`` int64, a token each row draws without (``-1``: none) after min-p took its
        threshold with it (V2's verification: the rejected draft; module docstring, removed).
    top : torch.Tensor, optional
        ``[B]`` int8, rows V2 masks with a top-k or a top-p after min-p (module docstring, top).
    """
    dev = lower.device
    ids = slot_ids(cand, count, V)  # [B, S], -1 where empty
    valid = ids >= 0
    if masked is not None:  # the grammar's -inf: not candidates at all
        valid = valid & ~masked.gather(1, ids.clamp_min(0))
    t_div, greedy, t_ok = _temp_ref(temp)
    qlo, qhi = _q_bounds(torch.where(valid, lower.double(), -math.inf),
                         torch.where(valid, upper.double(), -math.inf), t_div, greedy)
    g_lo, g_hi = _noise_bounds_ref(uniform(seeds, pos, ids.clamp_min(0)))
    g_lo, g_hi = g_lo.masked_fill(greedy, 0.0), g_hi.masked_fill(greedy, 0.0)
    bad = (torch.isnan(qlo) | torch.isnan(qhi) | (qhi == math.inf)).any(1)
    o_hi, o_q = out_hi.double(), out_q.double()
    gone = None if removed is None else (ids == removed[:, None]) & (removed[:, None] >= 0) & valid
    on = (min_p > 0) & ~greedy[:, 0]  # (module docstring, min-p)
    if bool(on.any()):
        nan_as = lambda x, v: torch.where(torch.isnan(x), v, x)  # noqa: E731
        m_hi = torch.maximum(nan_as(qhi, math.inf).amax(1), nan_as(out_q.double(), math.inf))
        thr_lo, thr_hi = min_p_thresholds(nan_as(qlo, -math.inf).amax(1), m_hi,
                                          torch.where(on, min_p, 1.0))
        thr_lo, thr_hi = thr_lo.double()[:, None], thr_hi.double()[:, None]
        qlo = torch.where(on[:, None] & ~(qlo >= thr_hi), -math.inf, qlo)
        qhi = torch.where(on[:, None] & (qhi < thr_lo), -math.inf, qhi)
        out_dropped = on & (o_q < thr_lo[:, 0])  # (the outside blocks min-p surely drops)
        o_hi, o_q = o_hi.masked_fill(out_dropped, -math.inf), o_q.masked_fill(out_dropped, -math.inf)
    if gone is not None:  # (after min-p's threshold, which it entered: module docstring, removed)
        qlo, qhi = qlo.masked_fill(gone, -math.inf), qhi.masked_fill(gone, -math.inf)
    nlo = torch.where(qlo > -math.inf, qlo + g_lo, -math.inf)
    nhi = torch.where(qhi > -math.inf, qhi + g_hi, -math.inf)
    best = nlo.amax(1)
    slot = torch.arange(nlo.shape[1], device=dev)
    w = torch.where(nlo == best[:, None], slot, nlo.shape[1]).amin(1).clamp(max=nlo.shape[1] - 1)
    A = torch.maximum(finite_abs_max(qlo, qhi), out_abs.double())
    m = torch.where(greedy[:, 0], 0.0, comparison_margin(A))
    bar = best - 2 * m
    others = ((nhi >= bar[:, None]) & (slot[None] != w[:, None])).sum(1)
    cert = (others == 0) & (o_hi < bar) & (best > -math.inf) & ~bad
    if removed is not None:  # (a greedy row's min-p with a token removed after it: module docstring, min-p)
        cert &= ~(greedy[:, 0] & (min_p > 0) & (removed >= 0))
    if top is not None:  # (the winner must be the row's certain maximum: module docstring, top)
        rest = torch.where(slot[None] != w[:, None], torch.where(torch.isnan(qhi), math.inf, qhi), -math.inf)
        other = torch.maximum(rest.amax(1), torch.where(torch.isnan(o_q), math.inf, o_q))
        gap = top_mask_margin(V, A)
        cert &= ~top.bool() | (qlo.gather(1, w[:, None])[:, 0] - other > gap)
    token = torch.where(best > -math.inf, ids.gather(1, w[:, None])[:, 0], 0).clamp_min(0)
    code = torch.where(live.bool(), torch.where(t_ok, torch.where(cert, CODE_CERTIFIED, CODE_UNCERTIFIED),
                                                CODE_TEMPERATURE), CODE_NOT_LIVE)
    return token, code.to(torch.int32)



# ---- Triton ---------------------------------------------------------------------------------
if triton is not None:
    from .common import _pdl_wait, _slots
    from .gumbel_jit import _hash, _min_p_thresholds, _noise_bounds, _prefix, _q_hi, _q_lo, _temp, _uniform

    @triton.jit
    def _gumbel_draw_kernel(cand_ptr, count_ptr, lo_ptr, up_ptr, ohi_ptr, oabs_ptr, oq_ptr, seed_ptr, pos_ptr,
                            temp_ptr, minp_ptr, live_ptr, token_ptr, code_ptr, V, log_abs, log_rel, mask_ptr,
                            removed_ptr, top_ptr, top_prob, HAS_MASK: tl.constexpr, HAS_REMOVED: tl.constexpr,
                            HAS_TOP: tl.constexpr, SUBC: tl.constexpr, CAPC: tl.constexpr, PDL: tl.constexpr):
        _pdl_wait(PDL)  # (common._launch: PDL launches wait for the kernel before)
        b = tl.program_id(0).to(tl.int64)
        S: tl.constexpr = CAPC * SUBC
        sl, ids, valid = _slots(cand_ptr, count_ptr, b, V, SUBC, CAPC)
        if HAS_MASK:  # the grammar's -inf: not candidates at all
            gone = tl.load(mask_ptr + b * V + tl.where(valid, ids, 0), mask=valid, other=0)
            valid = valid & (gone == 0)
        lo = tl.where(valid, tl.load(lo_ptr + b * S + sl), float("-inf"))  # (slots past the count
        hi = tl.where(valid, tl.load(up_ptr + b * S + sl), float("-inf"))  # were never written)
        t, greedy, t_ok = _temp(temp_ptr, b)
        qlo = _q_lo(lo, t, greedy)
        qhi = _q_hi(hi, t, greedy)
        g_lo, g_hi = _noise_bounds(_uniform(_hash(_prefix(tl.load(seed_ptr + b), tl.load(pos_ptr + b)),
                                                  tl.where(valid, ids, 0))))
        g_lo = tl.where(greedy, 0.0, g_lo)
        g_hi = tl.where(greedy, 0.0, g_hi)
        nbad = tl.sum(tl.where((qlo != qlo) | (qhi != qhi) | (qhi == float("inf")), 1, 0), 0)
        o_hi = tl.load(ohi_ptr + b).to(tl.float64)
        # min-p (module docstring): the winner must surely be kept;
        # tokens and outside blocks surely dropped do not compete
        mp = tl.where(greedy, 0.0, tl.load(minp_ptr + b))
        on = mp > 0.0
        o_q = tl.load(oq_ptr + b).to(tl.float64)
        o_q = tl.where(o_q != o_q, float("inf"), o_q)
        m_hi = tl.maximum(tl.max(tl.where(qhi != qhi, float("inf"), qhi), 0), o_q)
        m_lo = tl.max(tl.where(qlo != qlo, float("-inf"), qlo), 0)
        thr_lo, thr_hi = _min_p_thresholds(m_lo, m_hi, tl.where(on, mp, 1.0), log_abs, log_rel)
        qlo = tl.where(on, tl.where(qlo >= thr_hi, qlo, float("-inf")), qlo)
        qhi = tl.where(on, tl.where(qhi < thr_lo, float("-inf"), qhi), qhi)
        out_dropped = on & (o_q < thr_lo)  # (the outside blocks min-p surely drops)
        o_hi = tl.where(out_dropped, float("-inf"), o_hi)
        o_q = tl.where(out_dropped, float("-inf"), o_q)
        if HAS_REMOVED:  # (after min-p's threshold, which it entered: module docstring, removed)
            rm = tl.load(removed_ptr + b)
            gone = valid & (ids == rm) & (rm >= 0)
            qlo = tl.where(gone, float("-inf"), qlo)
            qhi = tl.where(gone, float("-inf"), qhi)
        nlo = tl.where((qlo > float("-inf")) & (qlo == qlo), qlo + g_lo, float("-inf"))
        nhi = tl.where(qhi > float("-inf"), qhi + g_hi, float("-inf"))
        best = tl.max(nlo, 0)
        w = tl.min(tl.where(nlo == best, sl, S), 0)
        w = tl.where(w < S, w, 0)
        abs_lo = tl.where(tl.abs(qlo) < float("inf"), tl.abs(qlo), 0.0)
        abs_hi = tl.where(tl.abs(qhi) < float("inf"), tl.abs(qhi), 0.0)
        A = tl.maximum(tl.maximum(tl.max(abs_lo, 0), tl.max(abs_hi, 0)), tl.load(oabs_ptr + b).to(tl.float64))
        m = tl.where(greedy, 0.0, (A + 24.0) * 1.1920928955078125e-07)
        bar = best - 2 * m
        others = tl.sum(tl.where((nhi >= bar) & (sl != w), 1, 0), 0)
        cert = (others == 0) & (o_hi < bar) & (best > float("-inf")) & (nbad == 0)
        if HAS_REMOVED:  # (a greedy row's min-p with a token removed after it: module docstring, min-p)
            cert = cert & ~(greedy & (tl.load(minp_ptr + b) > 0.0) & (rm >= 0))
        if HAS_TOP:  # (the winner must be the row's certain maximum: module docstring, top)
            rest = tl.max(tl.where(sl != w, tl.where(qhi != qhi, float("inf"), qhi), float("-inf")), 0)
            gap = tl.maximum((A + 64.0) * 9.5367431640625e-07 + 2e-9, top_prob)  # (TOP_LOGIT_REL, TOP_DUP_ABS)
            lo_w = tl.sum(tl.where(sl == w, tl.where(qlo > float("-inf"), qlo, 0.0), 0.0), 0)
            top_ok = lo_w - tl.maximum(rest, o_q) > gap
            cert = cert & ((tl.load(top_ptr + b) == 0) | top_ok)
        tok = tl.sum(tl.where(sl == w, ids, 0), 0)
        tok = tl.where(best > float("-inf"), tl.maximum(tok, 0), 0)
        live = tl.load(live_ptr + b) != 0
        code = tl.where(live, tl.where(t_ok, tl.where(cert, 0, 3), 2), 1)
        tl.store(token_ptr + b, tok)
        tl.store(code_ptr + b, code.to(tl.int32))


def gumbel_draw_triton(cand, count, lower, upper, out_hi, out_abs, out_q, seeds, pos, temp, min_p, live, V: int,
                       masked=None, removed=None, top=None):
    B = lower.shape[0]
    dev = lower.device
    token = torch.empty(B, dtype=torch.int64, device=dev)
    code = torch.empty(B, dtype=torch.int32, device=dev)
    if B:
        _gumbel_draw_kernel[(B,)](cand, count, lower, upper, out_hi, out_abs, out_q, seeds.long().contiguous(),
                                  pos.long().contiguous(), temp.float().contiguous(), min_p.float().contiguous(),
                                  live, token, code, V, LOG_ABS, LOG_REL,
                                  live if masked is None else masked.contiguous().view(torch.uint8),
                                  token if removed is None else removed.long().contiguous(),
                                  live if top is None else (top != 0).to(torch.int8).contiguous(),
                                  top_prob_gap(V),
                                  HAS_MASK=masked is not None, HAS_REMOVED=removed is not None,
                                  HAS_TOP=top is not None, SUBC=SUB, CAPC=CAP,
                                  **_launch(),
                                  **({} if INTERPRET else {"num_warps": 8}))
    return token, code


# ---- custom ops -----------------------------------------------------------------------------
@torch.library.custom_op(f"{LIB}::gumbel_draw", mutates_args=())
def gumbel_draw(cand: torch.Tensor, count: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor,
                out_hi: torch.Tensor, out_abs: torch.Tensor, out_q: torch.Tensor, seeds: torch.Tensor,
                pos: torch.Tensor, temp: torch.Tensor, min_p: torch.Tensor, live: torch.Tensor,
                V: int, masked: torch.Tensor | None = None, removed: torch.Tensor | None = None,
                top: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """V2's Gumbel draw certified on the device (:func:`gumbel_draw_ref`)."""
    args = (cand, count, lower, upper, out_hi, out_abs, out_q, seeds, pos, temp, min_p, live, V, masked, removed, top)
    return (gumbel_draw_triton if _use_triton(lower) else gumbel_draw_ref)(*args)


@gumbel_draw.register_fake
def _(cand, count, lower, *args):
    B = lower.shape[0]
    return lower.new_empty(B, dtype=torch.int64), lower.new_empty(B, dtype=torch.int32)
