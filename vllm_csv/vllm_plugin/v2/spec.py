"""Speculative decoding on the V2 runner (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``, vLLM
0.32 and 0.33 on CUDA): greedy requests' target rows certified in the head, where the V2
rejection sampler reads them only through their argmax.

Layout, read in 0.32.0 and 0.33.0. With draft tokens in the step (``input_batch.num_draft_tokens
> 0``) the runner scores ``cu_num_logits[i + 1] - cu_num_logits[i]`` rows for request ``i``, its
draft tokens' target rows then its bonus row, request after request in the batch's order, and
hands all of them to its ``RejectionSampler`` (``spec_decode/rejection_sampler.py``), which runs
the sampler's ``apply_sampling_params`` on them (vLLM's processors, temperature, min-p, top-k /
top-p) and ``rejection_sample`` (``spec_decode/rejection_sampler_utils.py``). There a request of
temperature 0 is greedy: its rows' per-block maxima and their first argmax
(``_compute_local_logits_stats_kernel``, ``_compute_global_target_argmax``: the first index of
the largest value), a draft token accepted if and only if it equals its row's argmax, the argmax
of the first rejected row (or of the bonus row) as the next token (``_rejection_kernel``,
``_insert_resampled_kernel``: "greedy rows retain the stock draw"). ``apply_sampling_params``
leaves such a row as it is where no processor acts on it (the plan's ``k = 1`` requests have
none: :func:`~..plan.plan_row`) and divides no row of temperature 0 or 1. So a greedy request's
rows certified with ``k = 1`` (the dense value on the argmax, ``-inf`` elsewhere; ties never
certified) give the dense run's accepted tokens, recovered token and bonus token; each request
is verified by its own temperature (``is_greedy = temp == 0.0`` per request), so a batch with
sampled requests needs no check of an expansion (V1's :func:`~..v1.spec.mixed_batches_ok`). A
temperature-sampling request's rows (with min-p, vLLM's processors or neither) are deferred to
the verification hook (:mod:`.verify`); other sampled requests' rows stay dense. The plan is
:func:`~..plan.target_plan`, as V1's, kept while the batch and its draft counts hold.

Dense instead (:func:`verification_ok`): any rejection method but ``standard`` (``synthetic``
accepts by rates, ``block`` verifies blocks from probabilities, 0.33's ``fly`` reads the target
rows' entropy), adaptive verification, a watermarking sampler, a sampler that returns sampling
masks (they read the processed rows), and a sampler the V2 hook does not know
(:func:`~.sampler.certifiable_sampler`: custom processors, fp64 noise).
"""

from __future__ import annotations

import numpy as np

from ..plan import Plan, kept_target_plan
from .known import v2_verify_known
from .sampler import certifiable_sampler


def verification_ok(rejection_sampler) -> bool:
    """Whether the V2 ``rejection_sampler`` verifies greedy requests by their rows' argmax alone
    (module docstring), with the code of a release the verification certificate was checked
    against (:func:`.known.v2_verify_known`)."""
    if rejection_sampler is None:
        return False
    return (getattr(rejection_sampler, "synthetic_conditional_rates", None) is None
            and not getattr(rejection_sampler, "use_block_verification", False)
            and not getattr(rejection_sampler, "fly_window_size", 0)
            and not getattr(rejection_sampler, "enable_adaptive_verification", False)
            and getattr(rejection_sampler, "watermark_key", None) is None
            and certifiable_sampler(getattr(rejection_sampler, "sampler", None))
            and v2_verify_known())


def draft_counts(input_batch) -> tuple[int, ...]:
    """Each request's draft tokens this step: its rows (``cu_num_logits_np``) less its bonus row."""
    cu = np.asarray(input_batch.cu_num_logits_np[: input_batch.num_reqs + 1], dtype=np.int64)
    return tuple(int(n) - 1 for n in np.diff(cu))


def spec_plan(runner, base: Plan, input_batch) -> Plan | None:
    """The plan of a V2 step under speculative decoding from the batch's per-request ``base``
    plan (:func:`..plan.target_plan`, kept on ``runner`` while ``base`` and the draft counts
    hold): greedy requests' rows in the head, temperature-sampling requests' rows deferred
    to the verification hook (:mod:`.verify`); None (dense) where the rows are not one request's after another's as read above (a
    request without its bonus row, a row count that is not theirs)."""
    counts = draft_counts(input_batch)
    if len(counts) != len(base.req_ids) or min(counts, default=0) < 0:
        return None
    return kept_target_plan(runner, base, counts, sampled=True)
