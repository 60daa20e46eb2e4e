"""vLLM's top-k / top-p / min-p masks around a V1 draw that holds certified rows: left out where
no row needs them, run on the rows that have them only otherwise (:func:`draw_with_masks`)."""

from __future__ import annotations

import contextvars
import dataclasses
from typing import NamedTuple

import torch

from ...vocabulary import SAMPLING_EPS as _SAMPLING_EPS

# True inside draw_with_masks(): vLLM's top-k / top-p run on the rows that have one only (masks_on_rows). A
# context variable scoped to that call (the masks function is vLLM's module global, called by
# forward_cpu without any argument of ours), not step state.
_rows_only: contextvars.ContextVar[bool] = contextvars.ContextVar("csv_masks_rows_only", default=False)


def _min_p_processor(md):
    """vLLM's min-p processor of the batch where some row has a min-p, else None."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    return next((p for p in md.logitsprocs.argmax_invariant if isinstance(p, MinPLogitsProcessor) and p.min_p_count),
                None)


def min_p_of(md, rows: torch.Tensor) -> torch.Tensor:
    """``[len(rows)]`` float32: the batch rows' min-p (0: none)."""
    p = _min_p_processor(md)
    if p is None:
        return torch.zeros(rows.numel())
    return torch.tensor([p.get_min_p_by_index(int(i)) for i in rows], dtype=torch.float32)


def wants_logprobs(md) -> bool:
    """Whether this draw returns logprobs (vLLM's ``Sampler.forward`` then reads the logits)."""
    return md.max_num_logprobs is not None or bool(getattr(md, "logprob_token_ids", None))


class RowParams(NamedTuple):
    """What vLLM's draw does with some of the batch's rows (host tensors, ``[R]`` each)."""

    greedy: torch.Tensor  # bool: temperature below vLLM's SAMPLING_EPS (every row where all greedy)
    min_p: torch.Tensor  # float32, 0: none
    top_k: torch.Tensor  # int64, V: none (and V on greedy rows, which never read it)
    top_p: torch.Tensor  # float32, 1: none
    logprobs: bool  # the draw returns logprobs (:func:`wants_logprobs`)


def row_params(md, rows: torch.Tensor, V: int) -> RowParams:
    """The draw's parameters of the batch rows ``rows`` (``[R]`` int64, CPU) from the sampling
    metadata ``md`` of a vocabulary of ``V`` tokens (host reads: the CPU sampler's, where they live)."""
    R = rows.numel()
    if md.all_greedy or md.temperature is None:
        greedy = torch.ones(R, dtype=torch.bool)
    else:
        greedy = md.temperature.cpu()[rows] < _SAMPLING_EPS
    top_p = md.top_p.cpu()[rows].float() if md.top_p is not None else torch.ones(R)
    top_k = md.top_k.cpu()[rows].long() if md.top_k is not None else torch.full((R,), V)
    return RowParams(greedy, min_p_of(md, rows), top_k.masked_fill(greedy, V), top_p, wants_logprobs(md))



def _masks_off(sampler, md, V: int, settled: torch.Tensor) -> dict:
    """Which of vLLM's masks may be skipped for this draw once the certified rows ``settled``
    (batch indices) have ``top_k`` ``V`` and ``top_p`` 1 (:func:`.sampler.resolve`), as replacements of
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
        on = min_p_of(md, torch.arange(B)) > 0
        if not md.all_random:
            on &= md.temperature.cpu() >= _SAMPLING_EPS
        on[settled] = False
        if not bool(on.any()):
            off["logitsprocs"] = LogitsProcessors([p for p in md.logitsprocs.all if p is not min_p])
    return off


def _processed_logprobs(sampler, md) -> bool:
    """Whether this draw returns processed logprobs or logits (read after vLLM's masks)."""
    return wants_logprobs(md) and \
        sampler.topk_topp_sampler.logprobs_mode in ("processed_logits", "processed_logprobs")


def masks_on_rows(apply_top_k_top_p):
    """vLLM's ``apply_top_k_top_p`` (the CPU sampler's masks), run during :func:`draw_with_masks` on the rows
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
    where processed logprobs are returned (:func:`draw_with_masks`: they read the masked values)."""

    def apply(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, **kw) -> torch.Tensor:
        # (kw: vLLM 0.33's ``has_topp_only_rows``, passed by V2's sampler where it binds this function; a
        # hint that must be True if any row has top-p only: it still holds for a subset of the rows)
        if not _rows_only.get() or (k is None and p is None):
            return apply_top_k_top_p(logits, k, p, **kw)
        # (host reads of k and p: the CPU sampler's, where they live)
        need = torch.zeros(logits.shape[0], dtype=torch.bool)
        if p is not None:
            need |= p.cpu() < 1.0
        if k is not None:
            need |= k.cpu() < logits.shape[1]
        if bool(need.all()):
            return apply_top_k_top_p(logits, k, p, **kw)
        rows = need.nonzero().squeeze(1).to(logits.device)
        if rows.numel():
            sub = apply_top_k_top_p(logits.index_select(0, rows), None if k is None else k[rows],
                                    None if p is None else p[rows], **kw)
            logits.index_copy_(0, rows, sub)
        return logits

    apply._csv_wrapped = True
    return apply


def draw_with_masks(sampler, orig, logits: torch.Tensor, md, settled: torch.Tensor, predict_bonus_token: bool,
                    logprobs_mode_override, rows_only: bool):
    """vLLM's own ``Sampler.forward`` (``orig``) on the filled ``logits``, with the certified rows
    ``settled`` drawn without top-p and top-k (:func:`.sampler.resolve`), the masks no row needs left
    out (:func:`_masks_off`) and, where ``rows_only`` (vLLM-CPU's Gumbel sampler), the others
    run on the rows that have them only (:func:`masks_on_rows`); vLLM's own values are restored
    after."""
    masks = [(t, v) for t, v in ((md.top_p, 1.0), (md.top_k, logits.shape[1])) if t is not None]
    idx = [settled.to(t.device) for t, _ in masks]
    saved = [t[i].clone() for (t, _), i in zip(masks, idx)]
    for (t, v), i in zip(masks, idx):
        t[i] = v
    token = _rows_only.set(rows_only and not _processed_logprobs(sampler, md))
    try:
        off = _masks_off(sampler, md, logits.shape[1], settled) if settled.numel() else {}
        return orig(sampler, logits, dataclasses.replace(md, **off) if off else md, predict_bonus_token,
                    logprobs_mode_override)
    finally:
        _rows_only.reset(token)
        for (t, _), i, old in zip(masks, idx, saved):
            t[i] = old

