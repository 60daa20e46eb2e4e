"""Certify rows of vLLM's V2 sampler (the V2 runner's ``Sampler.__call__``, wrapped in
:mod:`..patches`).

The V2 runner (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``, CUDA): its ``Sampler.__call__``
is wrapped as V1's ``Sampler.forward`` is (:mod:`..v1.sampler`), for temperature-sampling rows with min-p, vLLM's native processors,
structured output, a top-k or a top-p, or none of these, and greedy rows with processors or structured output
(:func:`resolve`; the plan defers no other row there, :func:`.plan.row_entry`).
V2 draws such a row with ``gumbel_sample`` from ``fl32(x / T)`` after its processors and min-p,
and noise hashed from (request seed, position, token), no random state drawn at sampling time,
so nothing is peeked; the certificate is :func:`~vllm_csv.sampling.rows_v2.certify_rows_v2`, the
processors vLLM's own run on the bounds (:func:`_processors`).

On CUDA (the head's backend, bound once when the head was built, runs the fused Triton step) rows
(with min-p, a grammar, vLLM's native processors, any or none) are drawn on the device instead
(:func:`fused_draw_for`, :meth:`vllm_csv.gpu.step.FusedStep.draw_v2`: candidate scoring and the
Gumbel replay in kernels, no per-row Python loop, no ``[B, V]`` float64 pass); the CPU path is
unchanged.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ... import clock
from ...sampling.rows_v2 import certify_rows_v2
from ...sampling.types import RowsResult
from ...sampling.sharded_rows import ShardedAdapter
from ..fill import finish, upstream_mask, write_certified
from ..step import Deferred, DeferredStats, take_handoff
from .known import v2_draw_known, v2_masks_known


@functools.cache
def _native_processors() -> dict:
    """vLLM V2's native logits processors (the only ones :func:`certifiable_sampler` admits), each
    class with whether an instance ``p`` changes any row of requests ``req`` (slots): its ``apply``
    returns its input untouched when its own flag is off for every request of the context
    (``LogitBiasState``: ``use_logit_bias``, allowed ids and min_tokens' stop tokens included;
    ``PenaltiesState``: ``use_penalty``; ``BadWordsState``: ``num_bad_words``; read in 0.32.0 and
    0.33.0). Raises ``ImportError`` where vLLM has no V2 sampler."""
    from vllm.v1.worker.gpu.sample.bad_words import BadWordsState
    from vllm.v1.worker.gpu.sample.logit_bias import LogitBiasState
    from vllm.v1.worker.gpu.sample.penalties import PenaltiesState

    return {LogitBiasState: lambda p, req: bool(np.any(p.use_logit_bias[req])),
            PenaltiesState: lambda p, req: bool(np.any(p.use_penalty[req])),
            BadWordsState: lambda p, req: bool(np.any(p.num_bad_words.np[req] > 0))}


def certifiable_sampler(sampler) -> bool:
    """Whether ``sampler`` is the V2 runner's own ``Sampler`` (not a subclass: the watermarking
    sampler draws otherwise) drawing with V2's fp32 Gumbel kernel (no fp64 noise, no trace replay,
    no sampling mask) after vLLM's native logits processors only (no custom ones): the draw
    :mod:`vllm_csv.sampling.gumbel_v2` replays, in a vLLM whose V2 sampling code is that of a
    release the replica was checked against (:func:`.known.v2_draw_known`: 0.32.0, 0.33.0)."""
    try:
        from vllm.v1.worker.gpu.sample.sampler import Sampler

        native = _native_processors()
    except ImportError:
        return False
    return type(sampler) is Sampler and not sampler.use_fp64_gumbel and sampler.trace_replay_state is None and \
        not sampler.return_sampling_mask and all(type(p) in native for p in sampler.logits_processors) and \
        v2_draw_known()


def _unsupported(sampler, d: Deferred, logits: torch.Tensor, input_batch) -> str | None:
    if not certifiable_sampler(sampler):
        return "the sampler is not V2's fp32 Gumbel sampler"
    if isinstance(d.adapter, ShardedAdapter):
        return "tensor parallelism (the V2 sampler's certificate is not sharded)"
    if logits.shape[0] != input_batch.num_reqs:
        return "speculative decoding"
    req = input_batch.idx_mapping_np[d.rows.numpy()]  # the deferred rows' request slots
    if not bool(np.all(sampler.sampling_states.temperature.np[req] >= 0)):
        return "a negative temperature"
    if has_top_masks(sampler, input_batch.idx_mapping_np):
        if fused_sampler(sampler, input_batch.idx_mapping_np):
            return "top-k or top-p rows drawn by a fused sampler (FlashInfer's)"
        if not v2_masks_known():
            return "top-k or top-p rows masked by kernels of no release checked"
    return thinking_budget(sampler, req)


def has_top_masks(sampler, batch: np.ndarray) -> bool:
    """Whether a request of the batch (slots ``batch``) has a top-k or a top-p: V2 then masks
    every row with its own (``SamplingStates.get_top_k_top_p``; a row with neither is left as it
    is), or draws the whole batch with a fused sampler (:func:`fused_sampler`)."""
    return bool(top_rows(sampler, batch).any())


def fused_sampler(sampler, batch: np.ndarray) -> bool:
    """Whether V2 draws a batch with top-k or top-p rows (slots ``batch``) with its fused sampler
    (FlashInfer's ``top_k_top_p_sampling_from_logits``, or XPU's), whose random numbers are not the
    Gumbel noise the certificate replays: ``Sampler.sample``'s rule in 0.32.0 and 0.33.0 (the
    sampler has one, and the batch has no greedy request, no explicit seed and no processed
    logprobs). Where any of what it reads is missing: True (the batch dense)."""
    from vllm.config.model import PROCESSED_LOGPROBS_MODES

    try:
        if not (sampler.use_flashinfer or getattr(sampler, "use_xpu_sampler", False)):
            return False
        ss = sampler.sampling_states
        processed = sampler.logprobs_mode in PROCESSED_LOGPROBS_MODES and sampler.get_logprobs_dims(batch) is not None
        return not (processed or ss.any_greedy(batch) or ss.any_explicit_seed(batch))
    except AttributeError:
        return True


def top_rows(sampler, req: np.ndarray) -> np.ndarray:
    """``[R]`` bool: which of the rows (request slots ``req``) V2 masks with a top-k or a top-p."""
    ss = sampler.sampling_states
    return (ss.top_k.np[req] != ss.vocab_size) | (ss.top_p.np[req] != 1.0)


def top_codes(sampler, req: np.ndarray) -> np.ndarray:
    """``[R]`` int64, how V2 masks each row (request slots ``req``) before its draw, as
    :func:`~vllm_csv.sampling.rows_v2.certify_rows_v2` reads its ``top``: ``0`` not at all;
    ``k >= 2`` a top-k ``k`` alone (a top-p of 1: the kernel's top-k path; a ``k`` not below
    the row's width, where the kernel masks nothing, is left to the maximum's rule); ``1`` a
    top-p (with a top-k or not) or a top-k of 1."""
    ss = sampler.sampling_states
    k = ss.top_k.np[req].astype(np.int64)
    alone = (ss.top_p.np[req] == 1.0) & (k >= 2)
    return np.where(top_rows(sampler, req), np.where(alone, k, 1), 0)


def thinking_budget(sampler, req: np.ndarray) -> str | None:
    """``"a thinking budget"`` where one is on for a request of ``req`` (it runs after the
    processors and is not replayed), else None."""
    tb = sampler.thinking_budget_state
    if getattr(tb, "enabled", False) and bool(np.any(tb.use_thinking_budget[req])):
        return "a thinking budget"
    return None


def drawn_otherwise(sampler, batch: np.ndarray, req: np.ndarray) -> str | None:
    """Why V2's verification would draw the deferred rows (request slots ``req``, of the batch's
    slots ``batch``) otherwise than its certificates replay, or None (:mod:`.verify`): a top-k or
    top-p row anywhere in the batch (the verification's certificates model no mask), a thinking
    budget on a deferred request."""
    if has_top_masks(sampler, batch):
        return "top-k or top-p rows in the batch"
    return thinking_budget(sampler, req)


def _processors(sampler, input_batch, dev_rows: torch.Tensor, rows_np: np.ndarray, req: np.ndarray):
    """vLLM's own V2 logits processors (logit bias, allowed ids and min_tokens; penalties; bad
    words: :func:`certifiable_sampler` admits no other) as a map of ``[R, V]`` float32 bounds
    of the deferred rows, out of place, with the batch's context cut down to those rows (each
    kernel reads a row's request slot, position, input id and local position by row, and skips
    requests by slot on the host; the penalties read a request's earlier draft tokens from the
    rows before it, so a speculative step's rows must be whole requests, in order). ``rows_np``:
    each row's index into the batch's per-request arrays (its request's: the rows themselves
    without draft tokens), ``req`` its request slot. Each is monotone non-decreasing per token: a mask to
    ``-inf``, an fp32 addition, the repetition penalty's multiplication by ``r`` or ``fl(1/r)``
    by sign, subtractions of fixed amounts. The thinking budget, which runs after them, is
    refused (:func:`_unsupported`). None where no processor has work on these rows
    (:func:`_native_processors`; not ``Sampler.needs_logits_processing``, which V2 also sets for a
    temperature other than 1 or a min-p: with it, every tempered row would seem processed and
    miss the device draw)."""
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

    native = _native_processors()  # (the sampler is certifiable: its processors are these)
    if not any(native[type(p)](p, req) for p in sampler.logits_processors):
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


def fused_draw_for(adapter, masked):
    """The head's fused GPU step (:meth:`vllm_csv.head.CertifiedHead.fused_step`: the CUDA backend
    only, chosen when the head was built) when it may draw these rows on the device, else None:
    another backend (the CPU path), a sharded adapter, a head with soft-cap or scale, or a
    grammar's mask narrower or wider than the head's rows. (Min-p, the mask and vLLM's processors
    it bounds: :mod:`vllm_csv.gpu.gumbel_draw`, :mod:`vllm_csv.gpu.processed`.)"""
    if isinstance(adapter, ShardedAdapter):
        return None
    fused_step = getattr(adapter.head, "fused_step", None)
    fused = fused_step() if fused_step is not None else None
    if fused is None or not fused.supports_draw() or (masked is not None and masked.shape[-1] != fused.V):
        return None  # (a mask as wide as the head's rows: the kernel reads it by token id)
    return fused


# the device draw's codes (vllm_csv.gpu.gumbel_draw) as the fallback reasons the account counts
_DRAW_REASONS = {1: "nonfinite", 2: "nonfinite", 3: "uncertified"}


def draw_rows(fused, hidden: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor, temp: torch.Tensor,
              min_p: torch.Tensor | None = None, masked: torch.Tensor | None = None, process=None,
              top: torch.Tensor | None = None) -> RowsResult:
    """:meth:`~vllm_csv.gpu.step.FusedStep.draw_v2` as the rows' ``RowsResult``: a certified row's
    values are ``-inf`` but at its token (0 there): V2's temperature keeps the one finite value
    finite and its ``gumbel_sample`` (or, at ``T = 0``, its argmax) returns it (V2's min-p keeps a
    row's maximum). One host read of
    the codes and counts, for the reasons and the account (the writing of the rows reads the
    certified flags on the host anyway)."""
    # (the device draw keeps the maximum's rule for every masked row: top_k_bounds needs a lower
    # bound on every value of the row, which its outside blocks do not carry)
    token, code, count = fused.draw_v2(hidden, seeds, pos, temp, min_p=min_p, masked=masked, process=process,
                                       top=None if top is None else top != 0)
    values = torch.full((hidden.shape[0], fused.V), -math.inf, dtype=fused.dtype, device=hidden.device)
    values.scatter_(1, token[:, None], 0.0)
    code_h, count_h = code.cpu(), fused.scored(count).cpu()
    reasons = [_DRAW_REASONS.get(int(c)) for c in code_h]
    return RowsResult(values, code == 0, token, reasons, int(count_h.sum()))


def resolve(sampler, d: Deferred, logits: torch.Tensor, input_batch) -> DeferredStats:
    """Fill ``logits``' deferred rows (certified or dense) in place before V2's ``Sampler`` draws.

    The rows are temperature sampling, with min-p, vLLM's native processors, structured output
    or none of these, or greedy with processors or structured output
    (:func:`~.plan.row_entry`): the grammar's ``-inf`` are read off the placeholders and
    kept (:mod:`..fill`); V2 runs the processors, divides by
    ``T`` (``T`` 0 or 1: not at
    all), applies min-p, masks rows with a top-k or a top-p (vLLM's Triton kernels; a row with
    neither is left as it is) and draws with ``gumbel_sample``, so
    :func:`~vllm_csv.sampling.rows_v2.certify_rows_v2` certifies each row from the processors run
    on its bounds (:func:`_processors`), its min-p, the request's seed
    (``SamplingStates.seeds``, kept per request), the row's position
    (``input_batch.positions[logits_indices]``) and temperature, read the way the kernels read
    them (through ``expanded_idx_mapping``); a greedy row (``T = 0``, deferred for its
    processors) by V2's argmax; a top-k or top-p row where the masks certainly keep its winner:
    its certain maximum, or on a row with a top-k alone the draw among the tokens it surely keeps
    (``top``, :func:`top_codes`, :func:`~vllm_csv.sampling.gumbel_v2.top_k_bounds`). Batches
    where vLLM could draw otherwise (top-k or top-p rows drawn by a fused sampler,
    :func:`fused_sampler`; speculative decoding; another sampler) and rows with a thinking budget
    are dense. (Host reads: the
    per-request states' numpy mirrors, which vLLM keeps on the host.)"""
    t0 = clock.now()
    rows = d.rows
    st = DeferredStats(rows=rows.numel())
    dev = logits.device
    dev_rows = rows.to(dev)
    masked, holds = upstream_mask(d, logits, dev_rows)
    why = _unsupported(sampler, d, logits, input_batch)
    if why is None and not holds:  # (V2 channels get no suppressed tokens: patches.bind)
        why = "the model's suppressed tokens changed"
    certified = torch.zeros(rows.numel(), dtype=torch.bool)
    if why is None:
        ss = sampler.sampling_states
        rows_np = rows.numpy()
        req = input_batch.idx_mapping_np[rows_np]
        slot = input_batch.expanded_idx_mapping[dev_rows].long()
        pos = input_batch.positions[input_batch.logits_indices[dev_rows]].long()
        min_p = ss.min_p.gpu[slot].float() if bool(np.any(ss.min_p.np[req] != 0)) else None
        process = _processors(sampler, input_batch, dev_rows, rows_np, req)
        seeds, temp = ss.seeds.gpu[slot].long(), ss.temperature.gpu[slot].float()
        top = top_codes(sampler, req)
        top = torch.from_numpy(top).to(dev) if bool(top.any()) else None
        fused = fused_draw_for(d.adapter, masked)
        if fused is not None:
            res = draw_rows(fused, d.hidden, seeds, pos, temp, min_p, masked, process, top)
        else:
            res = certify_rows_v2(d.adapter, d.hidden, seeds, pos, temp, process=process, min_p=min_p, masked=masked,
                                  top=top)
        certified = write_certified(logits, dev_rows, res, st)
    finish(d, logits, dev_rows, certified, masked, st, why, t0)
    return st



def sample(orig, sampler, logits: torch.Tensor, input_batch, *a, **k):
    """The wrapped ``Sampler.__call__`` (:mod:`..patches`): the step's deferred rows resolved
    (:func:`resolve`) and their account settled, then vLLM's own ``orig``. (The layer leaves no
    dense-step account on CUDA: no sync to time it.)"""
    d = take_handoff(sampler, logits)
    if isinstance(d, Deferred):
        d.account.settle(resolve(sampler, d, logits, input_batch))
    return orig(sampler, logits, input_batch, *a, **k)
