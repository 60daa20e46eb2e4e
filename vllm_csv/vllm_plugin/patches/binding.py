"""A runner's (or a speculative proposer's) step channel bound to its model's CSV layers and its
sampler, and the model's ``compute_logits`` watched for what it does to the head's logits
(:func:`watch_logits`). Applied at each runner's first step by :mod:`vllm_csv.vllm_plugin.patches`."""

from __future__ import annotations

import torch

from ...fp import same_bits
from ..logits_processor import CSVLogitsProcessor
from ..step import StepChannel, over_mask_tokens, suppressed_tokens
from .weights import invalidate_heads, invalidate_layers, root_model, watch_load_weights


def bind(runner) -> StepChannel:
    """The runner's channel, bound to the CSV layers of its model and to its sampler (once; again
    if the runner's model object changed)."""
    channel = runner.__dict__.get("_csv_channel")
    if channel is None:
        channel = runner._csv_channel = StepChannel()
    model = getattr(runner, "model", None)
    if model is not None and channel.model is not model:
        root = root_model(runner)
        _bind_layers(root, channel)
        channel.forget_model()  # (another model: its first call shows what it does to the logits)
        watch_logits(model, channel, type(root).__name__)
        watch_load_weights(root, lambda: invalidate_heads(runner))  # (its drafter's too: EAGLE shares the head)
        channel.model = model
    sampler = getattr(runner, "sampler", None)
    if sampler is not None and sampler.__dict__.get("csv_channel") is not channel:  # (per step: skip
        sampler.csv_channel = channel  # nn.Module.__setattr__ unless the runner's sampler is new)
        from vllm.v1.sample.sampler import Sampler

        # V1's sampler hook certifies deferred rows over the -inf a model writes on them
        # (StepChannel.suppressed); V2's does not: its rows other than greedy ones are then dense
        channel.masks_ok = isinstance(sampler, Sampler)
    return channel


def bind_drafter(proposer) -> StepChannel:
    """A speculative proposer's own channel, bound to the CSV layers of its drafter model (once;
    again if its model object changed). A layer already bound to another channel (a module the
    drafter shares with the target model) is left to that channel: its calls from the drafter
    then find no plan (the target's is closed when its step method returns) and stay dense."""
    channel = proposer.__dict__.get("_csv_channel")
    if channel is None:
        channel = proposer._csv_channel = StepChannel()
        channel.drafter = True
    model = getattr(proposer, "model", None)
    if model is not None and channel.model is not model:
        _bind_layers(model, channel, keep_bound=True)
        channel.forget_model()
        watch_logits(model, channel, type(model).__name__)
        watch_load_weights(model, lambda: invalidate_layers(model))
        channel.model = model
    return channel


def _bind_layers(root, channel: StepChannel, keep_bound: bool = False) -> None:
    """Every CSV layer under ``root`` to ``channel`` (``keep_bound``: not one bound elsewhere)."""
    for m in root.modules() if isinstance(root, torch.nn.Module) else ():
        if isinstance(m, CSVLogitsProcessor):
            if keep_bound and m.__dict__.get("csv_channel") not in (None, channel):
                continue
            m.csv_channel = channel


def watch_logits(model, channel: StepChannel, name: str) -> None:
    """Wrap ``model.compute_logits`` (on the instance the runner or proposer calls) so that a model
    which changes the head's logits after the head (:class:`~..step.Returned`) gets the dense head.

    The channel's first call that reaches the layer runs dense and the layer keeps a copy of
    its output: a model that returns another tensor, or the same one with other bits, changes
    them (one warning; no plan for this channel again). Every later call checks the identity
    alone (a copy and a comparison of ``[B, V]`` once per runner, then nothing: vLLM runs its
    steps in inference mode, where a tensor's in-place writes leave no version counter to
    compare): a call that returns another tensor than the layer's, with rows the head certified
    or deferred, is made again dense (its hand-off dropped), so that step's tokens are vLLM's
    too. ``name``: the model's class, for the warning. The first call's comparison reads the
    result on the host once (a device sync, once per runner).

    A model whose change is only to set the same tokens to ``-inf`` on every row, in place
    (:func:`~..step.suppressed_tokens`: Gemma 4's ``suppress_tokens``, Moondream 3's answer
    token), keeps CSV: its tokens become :attr:`~..step.StepChannel.suppressed`; greedy and draft
    rows are certified in the head over the other tokens (:meth:`~..plan.Plan.over_mask`; each
    call here then checks, on those rows, that the model set at least those tokens to ``-inf``
    and not the rows' own, else makes the call again dense: :func:`~..step.over_mask_tokens`),
    and every other row goes to the sampler where it certifies rows over such masks
    (``channel.masks_ok``, V1's), which reads the tokens off the placeholders as it reads a
    grammar's (and checks, every step, that the model wrote exactly those:
    :func:`~..fill.upstream_mask`), else is dense."""
    orig = getattr(model, "compute_logits", None)
    if orig is None or getattr(orig, "_csv_channel", None) is channel:
        return

    def compute_logits(*args, **kwargs):
        step = channel.step
        first = not channel.logits_checked
        if first:
            step.plan, step.snapshot = None, True  # (this call dense: its bits show what the model does)
        step.returned, step.over_mask = None, None
        try:
            out = orig(*args, **kwargs)
        finally:
            step.snapshot = False
        r, step.returned = step.returned, None
        if r is None:  # (the layer was not called: nothing to compare)
            return out
        if first and r.logits.dim() == 2 and not r.logits.shape[0]:
            return out  # (a call with no row shows nothing: the next call is the first again)
        if first:
            channel.logits_checked = True
        if out is r.logits and (r.copy is None or same_bits(out, r.copy)):
            over, step.over_mask = step.over_mask, None
            if over is None or over_mask_tokens(out, over[0], step.suppressed_ids, over[1]) is not None:
                return out  # (a Top1 hand-off the layer left holds: the check passed)
            if not channel.warned_over_mask:
                channel.warned_over_mask = True
                from vllm.logger import init_logger

                init_logger("vllm.csv_decode").warning(
                    "CSV-Decode: %s.compute_logits suppressed other tokens than its first call did (a "
                    "row's certified token, or not every token seen then); such a step is made again "
                    "without CSV.", name)
            step.plan = step.handoff = None
            return orig(*args, **kwargs)  # (no plan: the layer computes vLLM's logits, the model masks them)
        if first and out is r.logits:
            tokens = suppressed_tokens(r.copy, out)
            if tokens is not None:
                channel.suppressed, channel.suppressed_ids = tokens, tokens.nonzero().squeeze(1)
                from vllm.logger import init_logger

                init_logger("vllm.csv_decode").info(
                    "CSV-Decode: %s.compute_logits sets %d tokens to -inf after the head; greedy rows are "
                    "certified in the head over the other tokens, the others in the sampler.", name,
                    channel.suppressed_ids.numel())
                return out
        if channel.post_processing is None:
            channel.post_processing = name
            from vllm.logger import init_logger

            init_logger("vllm.csv_decode").warning(
                "CSV-Decode is off for this model: %s.compute_logits changes the head's logits after the head "
                "(suppressed tokens, a scale, a soft-cap or a vocabulary map the certificate does not cover); "
                "using the dense head.", name)
        if not r.csv:
            return out
        step.plan = step.handoff = None
        return orig(*args, **kwargs)  # (no plan: the layer computes vLLM's logits)

    compute_logits._csv_channel, compute_logits._csv_orig = channel, orig
    model.compute_logits = compute_logits
