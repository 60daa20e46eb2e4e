"""``--enable-csv-decode`` and ``--csv-*`` flags for ``vllm serve``, mapped onto
``additional_config["csv_decode"]``.

vLLM loads general plugins inside ``AsyncEngineArgs.add_cli_args`` right before it
calls ``EngineArgs.add_cli_args``; wrapping that static method (:mod:`.patches`) adds our
argument group to the same parser, and wrapping ``EngineArgs.from_cli_args`` (which every
entry point uses to turn the namespace into engine arguments) moves the flags into
``additional_config``, where the engine core and the workers read them. Values are
validated here, so a bad flag, or a ``--csv-index`` file that is missing or corrupt, stops
``vllm serve`` with one line before any model is loaded.
"""

from __future__ import annotations

import argparse

from ..screens import SCREENS
from ..vocabulary import CLUSTER_FRACTION, DEFAULT_BUDGET, DEFAULT_MAX_TOPK
from .config import SECTION, from_additional_config

FLAGS = {  # namespace attribute -> config key
    "enable_csv_decode": "enabled", "csv_screen": "screen", "csv_index": "index",
    "csv_clusters": "clusters", "csv_budget": "budget",
    "csv_max_topk": "max_topk",
}


def add_csv_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("CSV-Decode (vllm-csv)", "Certified sub-vocabulary decoding of the LM head.")
    g.add_argument("--enable-csv-decode", action="store_true", default=None,
                   help="Compute exact logits on a certified sub-vocabulary; dense otherwise.")
    g.add_argument("--csv-screen", choices=SCREENS, default=None,
                   help="Bound used to prune the vocabulary (default auto: int8 with our AVX512-VNNI kernel or "
                        "FBGEMM on x86 CPUs, plus int4 for one-row batches on VNNI CPUs and large heads; cuBLASLt "
                        "on CUDA; fp16 on CPUs without FBGEMM).")
    g.add_argument("--csv-index", default=None, help="Index file for --csv-screen ball (default: cache).")
    g.add_argument("--csv-clusters", type=int, default=None, help=f"Clusters when building an index (default {CLUSTER_FRACTION} x V).")
    g.add_argument("--csv-budget", type=float, default=None,
                   help="Max share of the vocabulary scored exactly before the dense path: per row in the head, "
                        f"per batch (its rows' scored columns together) in the sampler (default {DEFAULT_BUDGET}).")
    g.add_argument("--csv-max-topk", type=int, default=None, help=f"Largest top_k certified (default {DEFAULT_MAX_TOPK}).")


def apply_csv_args(args: argparse.Namespace, additional: dict | None) -> dict:
    """Merge the flags present in ``args`` into a copy of ``additional`` and validate."""
    out = dict(additional or {})
    section = dict(out.get(SECTION) or {})
    for attr, key in FLAGS.items():
        value = getattr(args, attr, None)
        if value is not None:
            section[key] = value
    if section:
        if any(getattr(args, a, None) is not None for a in FLAGS if a != "enable_csv_decode"):
            section.setdefault("enabled", True)
        out[SECTION] = from_additional_config({SECTION: section}).model_dump(exclude_none=True)
    return out


def check_index_file(cfg) -> None:
    """A given ``--csv-index`` must exist and load (format, consistent clusters) before any
    engine process starts: a deleted or corrupt file is then one line, not the worker's
    traceback relayed by the engine core and the API server. Whether it was built for the
    served weights needs the weights as loaded: the worker checks that (``index_loader``)."""
    if cfg.enabled and cfg.index:
        from ..index import CSVIndex

        CSVIndex.load(cfg.index)

