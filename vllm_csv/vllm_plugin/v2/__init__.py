"""vLLM's V2 integration (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``, CUDA, and its
``Sampler``): the interface :mod:`..v1` offers (:class:`~..patches.Integration`), with
:mod:`.plan`, :mod:`.sampler`, :mod:`.spec` (speculative decoding) and :mod:`.verify` (its
rejection sampler's verification of sampled requests)."""

from .plan import build_plan
from .sampler import certifiable_sampler, sample

__all__ = ["build_plan", "certifiable_sampler", "sample"]
