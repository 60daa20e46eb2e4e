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

SUPPORTED_VLLM = ("0.32",)  # major.minor versions this plugin was written and tested against
_registered = False
logger = logging.getLogger("vllm.csv_decode")


def check_vllm_version(version: str) -> str | None:
    """None if supported, else a one-line message."""
    if any(version == v or version.startswith(v + ".") for v in SUPPORTED_VLLM):
        return None
    return (f"vllm-csv supports vLLM {', '.join(SUPPORTED_VLLM)}.x; found {version}. "
            "CSV-Decode stays off (set VLLM_CSV_ALLOW_UNSUPPORTED=1 to try anyway).")


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    import os

    import vllm

    problem = check_vllm_version(getattr(vllm, "__version__", "unknown"))
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
