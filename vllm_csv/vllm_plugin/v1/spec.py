"""Speculative decoding on the V1 runner (``GPUModelRunner``, also vLLM-CPU's): the target's
verification rows and the drafter's head, certified where their readers need only the argmax.

Target rows. With ``--speculative-config`` the runner scores ``1 + n_i`` rows for request ``i``
(``n_i``: its draft tokens this step, ``scheduler_output.scheduled_spec_decode_tokens``), request
after request in the batch's order: its ``n_i`` target rows, then its bonus row
(``_calc_spec_decode_metadata``'s ``logits_indices``, read in vLLM 0.32.0). vLLM's
``RejectionSampler`` reads a *greedy* request's rows only through ``argmax``: a target row's
``target_logits.argmax(-1)`` decides whether the draft token is accepted (equal) and is the
recovered token where it is not (``_rejection_greedy_sample``); the bonus row goes through the
ordinary ``Sampler`` (greedy: argmax of the row). Between the head and that argmax it casts the
row to fp32, applies the logits processors and sampling constraints, which are the identity on
a plain greedy request's rows (no penalties, bias, min-tokens or top-p: those requests are not
planned ``k = 1``, :func:`~..plan.plan_row`), and in a batch that is not all greedy divides by a
temperature of 1 and runs the random path on every row, whose results it keeps only for the
sampled requests (``is_greedy``) and whose random draws depend on shapes, not values. A row
certified in the head with ``k = 1`` holds the dense value on its argmax and ``-inf`` elsewhere
(:meth:`~vllm_csv.head.CertifiedHead.sampler_logits`; ties are never certified), so its argmax is
the dense row's: the request's accepted tokens, recovered token and bonus token are those of the
dense run, step for step. Those rows are counted under the mode ``spec_greedy``. This is the
``standard`` verification; under another ``rejection_sample_method`` every row stays dense
(:func:`standard_verification`).

Where the head certified every row of an all-greedy step, the wrapped
``RejectionSampler.forward`` (:func:`verify`) skips vLLM's passes over the rows (copies of the
bonus and target rows, their fp32 cast and clone, and torch's argmax over ``[N, V]``: on the
demo at eight sequences a fifth of the step, more than the model's forward) and hands the
certified tokens (:class:`~..step.Top1`) to vLLM's own greedy verification kernel
(``_rejection_greedy_sample``), as its ``rejection_sample`` does for an all-greedy batch
(:func:`greedy_verification`): accepted drafts, recovered and bonus tokens are the kernel's on the
dense run's argmaxes. Only where nothing else reads the rows (:func:`~.sampler.argmax_decides`:
no logprobs, no processor acting) and vLLM verifies plainly (no synthetic or FLy acceptance:
:func:`plain_verifier`); otherwise vLLM's own ``forward`` runs on the rows.

A batch that is not all greedy takes that random path only where vLLM expands each request's
temperature to its rows correctly (:func:`mixed_batches_ok`). vLLM-CPU 0.32.0 does not: its C++
stand-in for the expansion kernel (``vllm.utils.cpu_triton_utils._expand_kernel_impl``) writes an
int64 copy of the float output and leaves the output uninitialised, so every row of such a
batch, a greedy request's included, is divided by whatever that memory held (the dense runs are
not reproducible either). There the greedy requests of a mixed batch stay dense too: the plugin
makes nothing worse, and certifies what it can prove equal.

Every other request's rows stay dense in a speculative step (sampled verification compares
``target_prob / draft_prob`` with a uniform draw and draws recovered tokens from the residual:
not certified yet), with the reason ``unsupported``; so does a request asking for logprobs,
which reads the values (the plan's rule). A step whose row count is not ``sum(1 + n_i)`` gets no
plan (dense).

Drafter heads (a draft model, EAGLE, MTP). ``SpecDecodeBaseProposer._greedy_sample`` computes the
drafter's logits and takes their argmax: the draft tokens. Wrapped (:mod:`..patches`), it opens
a step on the proposer's own channel with every row planned ``k = 1`` (mode ``draft``), so the
drafter's CSV layer certifies those argmaxes: the drafts, hence acceptance and outputs, are the
dense run's; where it certified every row, its tokens are the argmax (:func:`draft_tokens`). Not
where the proposer post-processes the logits before the argmax (a heterogeneous draft vocabulary:
``constrain_draft_logits``; a local argmax reduction), nor for probabilistic drafts
(``_sample_draft_tokens`` draws from the logits without ``_greedy_sample``): those calls get no
plan and stay dense.
"""

from __future__ import annotations

import torch

from ..plan import DRAFT_MODE, TARGET_MODE, Plan, kept_target_plan, target_plan  # noqa: F401  (shared with v2/spec.py)
from ..step import step_of
from .sampler import argmax_decides


def spec_config(runner):
    """The V1 ``runner``'s ``SpeculativeConfig`` (a ``--speculative-config``), or None."""
    cfg = getattr(runner, "speculative_config", None)
    return cfg if cfg is not None else getattr(getattr(runner, "vllm_config", None), "speculative_config", None)


def standard_verification(cfg) -> bool:
    """Whether the rejection sampler verifies as read above (``rejection_sample_method``
    ``standard``, the default). Not the others: ``synthetic`` accepts by calibrated rates, vLLM
    0.33's ``fly`` accepts greedy drafts by the target rows' entropy (it reads their
    probabilities), ``block`` verifies blocks of drafts from their probabilities."""
    return getattr(cfg, "rejection_sample_method", "standard") == "standard"


def draft_counts(spec_tokens, req_ids) -> tuple[int, ...]:
    """``n_i`` per request of ``req_ids`` (the batch's order): its scheduled draft tokens in
    ``spec_tokens`` (``scheduler_output.scheduled_spec_decode_tokens``: req_id -> token ids)."""
    if not spec_tokens:
        return (0,) * len(req_ids)
    return tuple(len(spec_tokens.get(r, ())) for r in req_ids)


def cached_target_plan(runner, base: Plan, counts: tuple[int, ...]) -> Plan:
    """:func:`~..plan.kept_target_plan`, with whether this runner's mixed batches are certifiable
    (:func:`mixed_batches_ok`, checked once per runner)."""
    mixed = runner.__dict__.get("_csv_spec_mixed_ok")
    if mixed is None:
        mixed = runner._csv_spec_mixed_ok = mixed_batches_ok(getattr(runner, "device", "cpu"))
    return kept_target_plan(runner, base, counts, mixed)


def mixed_batches_ok(device) -> bool:
    """Whether vLLM's rejection sampler expands per-request temperatures to rows correctly on
    ``device`` (module docstring): its ``expand_batch_to_tokens`` run three times on values that
    uninitialised memory does not hold by chance. Once per runner, at its first speculative plan."""
    try:
        from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
    except ImportError:
        return False
    temps = torch.tensor([0.3125, 0.0, 1.75], dtype=torch.float32, device=device)
    cu = torch.tensor([2, 3, 6], dtype=torch.int32, device=device)
    want = torch.tensor([0.3125, 0.3125, 1.0, 1.75, 1.75, 1.75], dtype=torch.float32, device=device)
    try:
        return all(torch.equal(expand_batch_to_tokens(temps, cu, 6, replace_from=0, replace_to=1), want)
                   for _ in range(3))
    except Exception:  # (a kernel that cannot run here: nothing to rely on)
        return False


def draft_plan(proposer, rows: int) -> Plan:
    """Every one of ``rows`` drafter rows planned ``k = 1`` (kept per row count)."""
    plans = proposer.__dict__.setdefault("_csv_draft_plans", {})
    plan = plans.get(rows)
    if plan is None:
        plan = plans[rows] = Plan([""] * rows, [1] * rows, [DRAFT_MODE] * rows, [0.0] * rows)
    return plan


def certifiable_draft(proposer, hidden: torch.Tensor) -> bool:
    """Whether ``_greedy_sample(hidden)`` reads the drafter's logits only through their argmax."""
    return hidden.dim() == 2 and not getattr(proposer, "use_local_argmax_reduction", False) and \
        not getattr(proposer, "use_heterogeneous_vocab", False)


def plain_verifier(rejection_sampler) -> bool:
    """Whether V1's ``rejection_sampler`` verifies greedy drafts by the target rows' argmax alone:
    no synthetic acceptance rates and no FLy (vLLM 0.33: entropy of the target rows; its
    ``rejection_sample`` takes that path where ``fly_window_size`` is set)."""
    return not getattr(rejection_sampler, "synthetic_mode", False) and \
        getattr(rejection_sampler, "fly_window_size", None) is None


def greedy_verification(metadata, tokens: torch.Tensor) -> torch.Tensor:
    """vLLM's ``rejection_sample`` for an all-greedy batch (0.32.0, 0.33.0), on the rows' argmaxes
    ``tokens`` (``[N + B]`` int64, the rows in the logits' order) instead of the rows: its output
    buffer, then its kernel ``_rejection_greedy_sample`` on the target rows' argmaxes and the bonus
    rows' tokens (``[B, 1]`` int32, as ``Sampler.forward`` returns them).

    Returns
    -------
    torch.Tensor
        ``[B, max_spec_len + 1]`` int32: each request's accepted drafts, then its recovered or
        bonus token, then ``PLACEHOLDER_TOKEN_ID``.
    """
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, _rejection_greedy_sample

    target = tokens[metadata.target_logits_indices]
    bonus = tokens[metadata.bonus_logits_indices].to(torch.int32).unsqueeze(-1)
    out = torch.full((len(metadata.num_draft_tokens), metadata.max_spec_len + 1), PLACEHOLDER_TOKEN_ID,
                     dtype=torch.int32, device=tokens.device)
    _rejection_greedy_sample(out, metadata.cu_num_draft_tokens, metadata.draft_token_ids, target, bonus,
                             None, metadata.max_spec_len, None, None)
    return out


def verify(orig, rejection_sampler, metadata, draft_probs, logits: torch.Tensor, md):
    """The wrapped V1 ``RejectionSampler.forward`` (:mod:`..patches`): on a step whose every row
    the head certified ``k = 1`` (the step's :class:`~..step.Top1`, for these very logits) where
    the argmaxes decide (module docstring), :func:`greedy_verification` on its tokens; else
    vLLM's ``orig``."""
    step = step_of(rejection_sampler.sampler)
    tokens = None if step is None else step.take_top1(logits)  # (taken: the bonus rows' sampler call must not read it)
    if tokens is not None and argmax_decides(md) and plain_verifier(rejection_sampler):
        from vllm.v1.outputs import SamplerOutput

        return SamplerOutput(sampled_token_ids=greedy_verification(metadata, tokens), logprobs_tensors=None)
    return orig(rejection_sampler, metadata, draft_probs, logits, md)


def draft_tokens(step, logits: torch.Tensor) -> torch.Tensor:
    """A drafter's greedy draft tokens from its ``logits`` (``[B, V]``): ``logits.argmax(dim=-1)``
    as vLLM's ``_greedy_sample`` takes them, or the certified tokens where the drafter's CSV
    layer certified every row (the step's :class:`~..step.Top1`): ``[B]`` int64 either way."""
    tokens = step.take_top1(logits)
    return logits.argmax(dim=-1) if tokens is None else tokens
