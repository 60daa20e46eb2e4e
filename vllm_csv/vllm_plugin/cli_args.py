"""``--enable-csv-decode`` and ``--csv-*`` flags for ``vllm serve``, mapped onto
``additional_config["csv_decode"]``.

The flags, their types, choices, help and defaults are generated from the fields of
:class:`.config.CSVDecodeConfig`, the one place for each setting (flag names: :func:`.config.flag_of`).

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
import types
import typing

from .config import SECTION, CSVDecodeConfig, default_text, flag_of, from_additional_config

GROUP = "CSV-Decode (vllm-csv)"
ENABLE = "enabled"  # the field whose flag turns CSV on; any other flag given implies it


def flags() -> dict[str, str]:
    """Config field -> its ``vllm serve`` flag, for every field that has one (in field order)."""
    return {name: f for name in CSVDecodeConfig.model_fields if (f := flag_of(name)) is not None}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def help_of(name: str) -> str:
    """Field ``name``'s flag help: its description and its default."""
    desc = CSVDecodeConfig.model_fields[name].description or ""
    # The trailing ``%(default).0s`` prints nothing; it tells argparse's ArgumentDefaultsHelpFormatter
    # (vLLM's) that the help shows its default, so it does not add "(default: None)": the
    # namespace's default stays None, meaning "not given".
    return f"{desc.rstrip('.')} (default {default_text(name)}).".replace("%", "%%") + "%(default).0s"


def _argument(name: str) -> dict:
    """``add_argument`` keywords for field ``name``, from its annotation."""
    ann = CSVDecodeConfig.model_fields[name].annotation
    if typing.get_origin(ann) in (typing.Union, types.UnionType):  # X | None
        ann = next(a for a in typing.get_args(ann) if a is not type(None))
    kw: dict = {"default": None, "help": help_of(name)}
    if ann is bool:
        kw["action"] = "store_true"
    elif typing.get_origin(ann) is typing.Literal:
        kw["choices"] = typing.get_args(ann)
    elif ann in (int, float):
        kw["type"] = ann
    elif ann is not str:
        raise TypeError(f"no flag type for csv_decode.{name}: {ann!r}")
    return kw


def add_csv_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(GROUP, "Certified sub-vocabulary decoding of the LM head.")
    for name, flag in flags().items():
        g.add_argument(flag, **_argument(name))


def apply_csv_args(args: argparse.Namespace, additional: dict | None) -> dict:
    """Merge the flags present in ``args`` into a copy of ``additional`` and validate."""
    out = dict(additional or {})
    section = out.get(SECTION)
    if section is not None and not isinstance(section, dict):
        from_additional_config(out)  # (its one-line error)
    section = dict(section or {})
    given = {name: v for name, flag in flags().items() if (v := getattr(args, _dest(flag), None)) is not None}
    section.update(given)
    if section:
        if any(name != ENABLE for name in given):
            section.setdefault(ENABLE, True)
        out[SECTION] = from_additional_config({SECTION: section}).model_dump(exclude_none=True)
    return out


def check_index_file(cfg, tensor_parallel_size: int = 1) -> None:
    """A given ``--csv-index`` must exist and load (format, consistent clusters) before any
    engine process starts: a deleted or corrupt file is then one line, not the worker's
    traceback relayed by the engine core and the API server. Whether it was built for the
    served weights needs the weights as loaded: the worker checks that (``index_loader``).
    Under tensor parallelism the ranks read their shards' files (``cache.shard_index_path``:
    what ``vllm-csv build-index --tensor-parallel-size N`` writes), not the path itself."""
    if cfg.enabled and cfg.index:
        from ..cache import shard_index_path
        from ..index import CSVIndex

        n = max(1, int(tensor_parallel_size or 1))
        for path in [cfg.index] if n == 1 else [shard_index_path(cfg.index, r, n) for r in range(n)]:
            CSVIndex.load(path)
