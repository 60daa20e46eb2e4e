"""Certify rows of vLLM's V1 sampler with the seeds it is about to draw.

Rows planned :data:`~..plan.DEFER` (plain temperature sampling; greedy or sampled rows
with penalties, ``logit_bias``, ``allowed_token_ids``, bad words, ``min_tokens``, or structured
output; top-p, min-p, and top-k with any of these or above the head's limit) cannot be
certified in the LM head: the Gumbel draw's seed is drawn by the sampler, after the head,
and the processors' inputs (output tokens, biases) live in the sampler's metadata. So the
head leaves those rows as placeholders (0.0) and hands their hidden states to the sampler on
the step (:class:`~..step.Deferred`); the wrapped ``Sampler.forward`` (:func:`sample`) then,
before vLLM's own code runs:

1. peeks the seeds ``TopKTopPSampler.forward_cpu`` will draw (saves the global RNG state and
   each request generator's, replays its ``randint`` calls, restores the states: the draw
   then produces the very same seeds; nothing between the entry of ``Sampler.forward`` and
   that ``randint`` consumes random numbers: logits processors, penalties, greedy argmax,
   temperature, min-p and top-k/top-p masks are deterministic);
2. runs vLLM's own ``Sampler.apply_logits_processors`` and ``apply_temperature`` on lower
   and upper bounds of the rows (every step is monotone non-decreasing per token: masks to
   ``-inf``, additions, the repetition penalty's ``x / r`` or ``x r``, division by ``T > 0``,
   each rounded to nearest in fp32; the penalties on the tokens they touch only, with vLLM's
   own ``apply_penalties``, :mod:`..penalties`), then min-p, top-k and top-p on the bounds
   (:mod:`vllm_csv.sampling.nucleus`, in vLLM's order), and certifies the draw
   (:func:`vllm_csv.sampling.rows.certify_rows`);
3. writes certified rows (exact values on the scored set, ``-inf`` elsewhere) and dense rows
   (the dense head on the whole batch, as without CSV) into the logits, keeping the grammar
   bitmask's ``-inf`` (a placeholder at ``-inf`` is a token the bitmask removed).

vLLM's unchanged sampler then draws from those logits. On a certified row its draw returns
the certified token (every finite value lies within its token's bounds; the tokens outside
the scored set are ``-inf``; a top-p of 1.0 or min-p of 0 that vLLM applies batch-wide
removes no token within 41 of the row's maximum, and the winner is within 41.1, the width of
the noise). When every top-p row of the batch was certified, vLLM's top-p is skipped for the
draw (:mod:`.masks`): its full-vocabulary sort was the dense step's largest cost; so are
vLLM's top-k and min-p when every row with one was certified. So the off-switch times such a
step with vLLM's sampler call, on both sides (:attr:`~..step.StepAccount.with_sampler`; a step it
sends dense leaves its :class:`~..step.StepAccount` alone on the step). Anything this hook cannot reason
about (speculative decoding, fp64 Gumbel, a thinking budget, custom logits processors,
min_tokens with a grammar, a non-CPU sampler) makes every deferred row dense.

A batch whose every row was deferred and certified, or whose other rows are greedy rows no
processor touches (their tokens vLLM's ``greedy_sample`` of their rows, :func:`_with_greedy_rows`),
with no logprobs asked for, is not drawn again (:func:`_drawn`): the certified tokens are the
draw, and the random streams advance as
``forward_cpu`` advances them (the batch's ``randint`` on the global RNG, one on each request
generator), so vLLM's own pass over ``[B, V]`` (the fp32 copy, the temperature, the Gumbel
kernel's scan of the mostly ``-inf`` rows: 2.8 to 4.5 ms at 32 rows of 65536 on one thread here)
and the write of the rows into the logits are skipped; nothing reads the logits after the
sampler in the V1 runner without speculative decoding (``_sample``), which the hook refuses.
Likewise a batch whose every row the head certified ``k = 1`` (plain greedy requests, each
row's token on the step: :class:`~..step.Top1`): when vLLM's draw reads it only through each
row's argmax (:func:`argmax_decides`), those tokens are the draw, with no fp32 copy and no argmax
over ``[B, V]``.

Under tensor parallelism (a :class:`~vllm_csv.sampling.sharded_rows.ShardedAdapter`) step 2
runs vLLM's processors on each rank's shard and the certificate on gathered summaries
(:func:`~vllm_csv.sampling.sharded_rows.certify_rows_sharded`): every rank reaches the same
decision and writes the same rows; rows left dense take vLLM's dense TP path (its
all-gather) on every rank. The seeds are peeked from each rank's own RNG, which vLLM keeps in
step on every rank (every rank samples; nothing here draws from it); they ride on the first
gather, and a row whose seeds differ between ranks goes dense on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ... import clock
from ...sampling.rows import certify_rows
from ...sampling.sharded_rows import ShardedAdapter, certify_rows_sharded
from ...vocabulary import SAMPLING_EPS as _SAMPLING_EPS
from ..fill import finish, upstream_mask, write_certified
from ..penalties import TouchedPenalties
from ..step import Deferred, DeferredStats, StepAccount, Top1, take_handoff
from .masks import draw_with_masks, row_params, wants_logprobs


def draw_seeds(batch_size: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """The seeds ``TopKTopPSampler.forward_cpu`` draws, drawn as it draws them (consumed): one
    ``randint`` of ``batch_size`` on the global RNG, then one on each request generator."""
    seeds = torch.randint(0, 2**31, (batch_size,), dtype=torch.long)
    for i, gen in generators.items():
        seeds[i] = torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long).item()
    return seeds


def peek_seeds(batch_size: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """The seeds ``TopKTopPSampler.forward_cpu`` draws next, without consuming them
    (:func:`draw_seeds` between a save and a restore of every RNG state)."""
    state, gen_states = torch.get_rng_state(), {i: gen.get_state() for i, gen in generators.items()}
    seeds = draw_seeds(batch_size, generators)
    torch.set_rng_state(state)
    for i, gen in generators.items():
        gen.set_state(gen_states[i])
    return seeds


def temperature_copy(x: torch.Tensor, temp: torch.Tensor, all_random: bool) -> torch.Tensor:
    """vLLM 0.32's ``Sampler.apply_temperature(x.clone(), temp, all_random)`` out of place: each
    row divided by its temperature in fp32 (``1.0`` below ``_SAMPLING_EPS`` unless every row is
    random), the same quotients bit for bit.

    Parameters
    ----------
    x : torch.Tensor
        ``[n, c]`` float32.
    temp : torch.Tensor
        ``[n]`` float32.
    all_random : bool

    Returns
    -------
    torch.Tensor
        ``[n, c]`` float32, a new tensor (``x`` unchanged).
    """
    if not all_random:
        temp = torch.where(temp < _SAMPLING_EPS, 1.0, temp)
    return torch.div(x, temp.unsqueeze(dim=1))


def _stock_temperature(sampler) -> bool:
    """Whether ``sampler.apply_temperature`` is vLLM 0.32's own V1 one (``resolve`` then divides
    out of place with the same arithmetic)."""
    from vllm.v1.sample.sampler import Sampler

    return getattr(type(sampler), "apply_temperature", None) is Sampler.apply_temperature


def draws_on_cpu(sampler) -> bool:
    """Whether ``sampler`` (a V1 ``Sampler``) draws with vLLM-CPU's ``TopKTopPSampler.forward_cpu``
    (torch's top-k and top-p masks, then the Gumbel-max draw, in fp32 or fp64)."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    tts = getattr(sampler, "topk_topp_sampler", None)
    return tts is not None and getattr(tts.forward, "__func__", None) is TopKTopPSampler.forward_cpu


def torch_masks() -> bool:
    """Whether vLLM's ``apply_top_k_top_p`` (which ``forward_cpu`` calls) is torch's
    (``apply_top_k_top_p_pytorch``: every token tied with the k-th value kept, top-p by a sort of
    the row), the masks the certificates model. Not where vLLM found a Triton CPU backend
    (triton-cpu installed: ``HAS_TRITON`` on the CPU platform): its Triton top-k (Qrita) keeps
    exactly ``k``, taking values within ``1e-9`` as duplicates and dropping them by position,
    and its top-p searches a pivot; a certified top-k row could then draw a token vLLM drops."""
    from vllm.v1.sample.ops import topk_topp_sampler

    return not topk_topp_sampler.HAS_TRITON


def certifiable_sampler(sampler) -> bool:
    """Whether ``sampler`` (a V1 ``Sampler``) draws with vLLM-CPU's fp32 Gumbel-max
    (:func:`draws_on_cpu`, not in fp64), the draw :mod:`vllm_csv.sampling` replays."""
    return draws_on_cpu(sampler) and not sampler.topk_topp_sampler.use_fp64_gumbel


def _unsupported(sampler, md, predict_bonus_token: bool, rows: torch.Tensor) -> str | None:
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    if not certifiable_sampler(sampler):
        return "the sampler is not vLLM's CPU Gumbel sampler"
    if predict_bonus_token or any(md.spec_token_ids or ()):
        return "speculative decoding"
    if (md.top_k is not None or md.top_p is not None) and not torch_masks():
        return "vLLM's Triton top-k / top-p (a Triton CPU backend), not the masks the certificate models"
    holder = md.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return "a thinking budget (its state advances on every application)"
    for p in md.logitsprocs.argmax_invariant:
        if not isinstance(p, MinPLogitsProcessor):
            return f"logits processor {type(p).__name__}"
    for p in md.logitsprocs.non_argmax_invariant:
        if not isinstance(p, (LogitBiasLogitsProcessor, MinTokensLogitsProcessor)):
            return f"logits processor {type(p).__name__}"
        if isinstance(p, MinTokensLogitsProcessor) and p.min_toks and p.restore_logits_slice[0].numel():
            # Its restore step (stop tokens back when the grammar left a row nothing else) reads
            # and writes only the rows of requests with min_tokens and a grammar (the plan leaves
            # them dense); on every other row the processor is its per-token stop-token mask.
            if bool(torch.isin(rows, p.restore_logits_slice[0].cpu().long()).any()):
                return "min_tokens with structured output (its restore step is not per token)"
    return None


def _processors_idle(md, rows: torch.Tensor | None = None) -> bool:
    """Whether vLLM's ``apply_logits_processors`` leaves every row (``rows``: those batch rows) as
    it is this step (no allowed ids, bad words, penalties, logit bias or min_tokens on them;
    :func:`_unsupported` refused the rest): then the map to the draw's inputs is the temperature
    alone, one division per row, and a greedy row's token is the argmax of its row as it is."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor

    idx = None if rows is None else set(rows.tolist())

    def acts(keys) -> bool:  # a processor keyed by batch row has work on a row asked about
        return bool(keys) if idx is None else bool(idx & set(keys))

    mask = md.allowed_token_ids_mask
    if mask is not None and (rows is None or bool(mask[rows].any())):
        return False
    if acts(md.bad_words_token_ids or ()):
        return False
    if not md.no_penalties and (rows is None or not bool((md.presence_penalties[rows] == 0).all() and
                                                          (md.frequency_penalties[rows] == 0).all() and
                                                          (md.repetition_penalties[rows] == 1).all())):
        return False
    for p in md.logitsprocs.non_argmax_invariant:
        keys = p.biases if type(p) is LogitBiasLogitsProcessor else \
            p.min_toks if type(p) is MinTokensLogitsProcessor else None
        if keys is None or acts(keys):
            return False
    return True


class Resolved(NamedTuple):
    stats: DeferredStats
    settled: torch.Tensor  # [n] int64: the certified rows (batch indices)
    drawn: torch.Tensor | None  # [B] int64: every row's token, where the hook drew the batch (_drawn)


def resolve(sampler, d: Deferred, logits: torch.Tensor, md, predict_bonus_token: bool = False,
            draw: bool = False) -> Resolved:
    """Fill ``logits``' deferred rows (certified or dense) in place; see the module docstring.
    With ``draw``, where every deferred row is certified, every other row is greedy and untouched
    by the processors (:func:`_with_greedy_rows`) and no logprobs are asked for, the rows are
    not written and ``drawn`` holds the batch's tokens (:func:`_drawn`).
    Returns the stats and the certified rows (batch indices), whose top-p and top-k vLLM must
    not apply again: on the partial row (exact on ``S``, ``-inf`` elsewhere) top-p's cumulative
    sums are not the full row's, so the caller sets their ``top_p`` to 1 and their ``top_k`` to
    ``V`` for this draw. The certificate already decided both: the winner is kept, and every
    finite value of the partial row is a token that may be kept (the certainly dropped ones are
    ``-inf`` there), which the winner beat. (Top-k on the partial row would keep the winner too:
    the tokens above it there are among those above it in the full row, fewer than ``k``; setting
    ``V`` lets vLLM skip its ``[B, V]`` top-k pass when every top-k row is certified.) Min-p
    needs no such step on a row: on the partial row the maximum is at most the full row's, so
    min-p keeps the winner, and dropping other tokens cannot change a certified draw; its
    ``[B, V]`` pass is skipped when every sampled row with a min-p is certified
    (:func:`.masks._masks_off`)."""
    t0 = clock.now()
    rows = d.rows
    R = rows.numel()
    st = DeferredStats(rows=R)
    dev_rows = rows.to(logits.device)
    every_row = R == logits.shape[0] and torch.equal(rows, torch.arange(R))  # the batch itself: no scatter / gather
    masked, holds = upstream_mask(d, logits, dev_rows, every_row)
    why = _unsupported(sampler, md, predict_bonus_token, rows)
    if why is None and not holds:
        why = "the model's suppressed tokens changed"
    certified = torch.zeros(R, dtype=torch.bool)
    if why is None:
        B, V = logits.shape
        params = row_params(md, rows, V)
        greedy, min_p, top_k, top_p = params.greedy, params.min_p, params.top_k, params.top_p
        seeds = peek_seeds(B, md.generators)[rows] if bool((~greedy).any()) else torch.zeros(R, dtype=torch.long)

        canvas = None  # [B, V] fp32: vLLM's processors read the batch's layout (made when first needed)
        # vLLM's penalties on the columns they touch only (penalties.py: the same values; vLLM's
        # full call is its dearest [R, V] pass, run here on both bounds every round); the other
        # processors as vLLM runs them, on metadata saying "no penalties"
        pen = TouchedPenalties(md, logits.shape[1])
        md_rest = dataclasses.replace(md, no_penalties=True) if pen.usable else md
        idle = _processors_idle(md)

        def temper(x: torch.Tensor, sel: torch.Tensor | None) -> torch.Tensor:
            # vLLM's temperature (in place, as vLLM does) on the batch rows ``sel`` (None: all),
            # where vLLM applies one; greedy rows are divided by exactly 1.0 (x / 1.0 == x, bit
            # for bit): their values stay those greedy_argmax sees
            if md.all_greedy or md.temperature is None:
                return x
            t = md.temperature.to(x.device)
            return sampler.apply_temperature(x, t if sel is None else t[sel], md.all_random)

        def batch_rows(rows: torch.Tensor | None) -> torch.Tensor | None:
            # the batch rows of the deferred rows ``rows`` (None: all of them); None: the whole batch
            if every_row and rows is None:
                return None
            return dev_rows if rows is None else dev_rows[rows.to(dev_rows.device)]

        stock = _stock_temperature(sampler)

        def tempered(x: torch.Tensor, sel: torch.Tensor | None) -> torch.Tensor:
            # temper on a copy of x. Where the sampler's apply_temperature is vLLM's own (an
            # in-place fp32 division of each row by its temperature, 1.0 on greedy rows unless
            # every row is random), the same division out of place: the same IEEE quotients, in
            # one pass over x instead of a copy and a pass over the copy
            if not stock or md.all_greedy or md.temperature is None:
                return temper(x.clone(), sel)
            t = md.temperature.to(x.device)
            return temperature_copy(x, t if sel is None else t[sel], md.all_random)

        def columns(lo: torch.Tensor, hi: torch.Tensor, rows: torch.Tensor | None = None):
            # some columns of some rows, where no processor acts this step (_processors_idle):
            # vLLM's temperature only, per row, the same division as on the full rows
            sel = batch_rows(rows)
            return tempered(lo, sel), tempered(hi, sel)

        def elementwise(lo: torch.Tensor, hi: torch.Tensor, rows: torch.Tensor | None = None):
            nonlocal canvas
            if idle:
                return columns(lo, hi, rows)
            sel = batch_rows(rows)
            full = []
            for x in (lo, hi):
                if sel is None:
                    f = x.clone()  # vLLM's processors work in place
                else:
                    if canvas is None:  # (the other rows' contents are never read back)
                        canvas = logits.float()
                    f = canvas.clone()
                    f[sel] = x
                full.append(sampler.apply_logits_processors(f, md_rest, predict_bonus_token))
            if pen.usable:  # vLLM applies its penalties last (what follows, a thinking budget, is refused)
                pen.apply(*full)
            ylo, yhi = (temper(f if sel is None else f[sel], sel) for f in full)
            return ylo, yhi

        if isinstance(d.adapter, ShardedAdapter):  # tensor parallelism: one decision from gathered numbers
            res = certify_rows_sharded(d.adapter, d.hidden, elementwise, min_p, top_p, seeds.to(logits.device),
                                       greedy.to(logits.device), masked)
            # top-k is not decided on the gathered summaries (an outside block's tokens are not
            # counted): those rows are dense on every rank (top_k is the same on every rank)
            no_top_k = (top_k >= V).to(res.certified.device)
            res.reason = [r if c or r is not None else "unsupported"
                          for r, c in zip(res.reason, no_top_k.tolist())]
            res.certified &= no_top_k
        else:
            dev = logits.device
            res = certify_rows(d.adapter, d.hidden, elementwise, seeds.to(dev), greedy.to(dev), masked,
                               elementwise=True, min_p=min_p.to(dev), top_k=top_k.to(dev), top_p=top_p.to(dev),
                               columns=columns if idle else None)
        tokens = None
        if draw and not params.logprobs and bool(res.certified.all()):
            tokens = res.winner if every_row else _with_greedy_rows(sampler, logits, md, dev_rows, res.winner)
        if tokens is not None:
            st.scored = res.scored  # (the rows are not written: _finish counts them, writes nothing)
            finish(d, logits, dev_rows, res.certified.cpu(), masked, st, None, t0)
            return Resolved(st, rows, tokens)
        certified = write_certified(logits, dev_rows, res, st, every_row)
    finish(d, logits, dev_rows, certified, masked, st, why, t0)
    return Resolved(st, rows[certified] if why is None else rows[:0], None)


def _with_greedy_rows(sampler, logits: torch.Tensor, md, dev_rows: torch.Tensor,
                      winner: torch.Tensor) -> torch.Tensor | None:
    """Every row's token (``[B]`` int64) where the rows not deferred (``dev_rows`` are) are greedy
    rows no logits processor touches: vLLM draws each as ``greedy_sample`` of its row as the head
    left it (certified in the head, or dense), cast to fp32 as ``Sampler.forward`` casts it, so
    that call on those rows alone gives their tokens; the deferred rows' are ``winner``. None
    where a row not deferred is sampled, or some processor acts on it (:func:`_processors_idle`)."""
    B = logits.shape[0]
    others = torch.ones(B, dtype=torch.bool, device=logits.device)
    others[dev_rows] = False
    others = others.nonzero().squeeze(1)
    if not md.all_greedy and not bool((md.temperature[others.to(md.temperature.device)] < _SAMPLING_EPS).all()):
        return None
    if not _processors_idle(md, others):
        return None
    tokens = torch.empty(B, dtype=torch.long, device=logits.device)
    tokens[dev_rows] = winner
    tokens[others] = sampler.greedy_sample(logits[others].to(torch.float32)).long()
    return tokens


def argmax_decides(md) -> bool:
    """Whether vLLM's draw (``Sampler.forward``; the greedy verification of
    ``RejectionSampler.forward``) reads the batch's logits only through each row's argmax: every
    request greedy, no logprobs, no processor acting (:func:`_processors_idle`). Then the tokens of
    a :class:`~..step.Top1` hand-off are its output, with no pass over ``[B, V]``."""
    return bool(md.all_greedy) and not wants_logprobs(md) and _processors_idle(md)


def _drawn(md, tokens: torch.Tensor):
    """vLLM 0.32's ``Sampler.forward`` output for a batch whose every row was certified, or drawn
    greedily beside the certified ones (:func:`resolve` with ``draw``), without drawing again:
    ``tokens`` (``[B]`` int64, in batch order) as ``sampled_token_ids`` (``[B, 1]`` int32), no logprobs;
    the random streams advanced as ``TopKTopPSampler.forward_cpu`` advances them where some row
    is sampled (``Sampler.sample`` calls it unless every row is greedy): :func:`draw_seeds`."""
    from vllm.v1.outputs import SamplerOutput

    if not md.all_greedy:
        draw_seeds(tokens.numel(), md.generators)
    return SamplerOutput(sampled_token_ids=tokens.to(torch.int32).unsqueeze(-1), logprobs_tensors=None)



def sample(orig, sampler, logits: torch.Tensor, md, predict_bonus_token: bool = False,
           logprobs_mode_override=None):
    """The wrapped ``Sampler.forward`` (:mod:`..patches`): vLLM's own ``orig`` where the step left
    nothing for the sampler; else the step's hand-off resolved first (module docstring) and its
    account settled (:class:`~..step.StepAccount`, with this call's time where it counts)."""
    d = take_handoff(sampler, logits)
    if d is None or isinstance(d, Top1):  # (no hand-off: most switched-off steps)
        if d is not None and d.logits is logits and not predict_bonus_token and argmax_decides(md):
            return _drawn(md, d.tokens)  # every row certified k = 1 in the head
        return orig(sampler, logits, md, predict_bonus_token, logprobs_mode_override)
    if isinstance(d, StepAccount):  # a dense step the off-switch times with this call
        t0 = clock.now()
        out = orig(sampler, logits, md, predict_bonus_token, logprobs_mode_override)
        d.settle(None, clock.now() - t0)
        return out
    st, settled, drawn = resolve(sampler, d, logits, md, predict_bonus_token, draw=True)
    if not d.account.with_sampler:  # (the account holds whether the sampler call's time counts)
        d.account.settle(st)
    t0 = clock.now()
    if drawn is not None:
        out = _drawn(md, drawn)
    else:
        out = draw_with_masks(sampler, orig, logits, md, settled, predict_bonus_token, logprobs_mode_override,
                   rows_only=certifiable_sampler(sampler))
    if d.account.with_sampler:
        d.account.settle(st, clock.now() - t0)
    return out
