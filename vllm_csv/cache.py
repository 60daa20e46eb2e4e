"""Where vllm-csv keeps what it builds: ``$VLLM_CSV_CACHE`` or ``~/.cache/vllm_csv`` (a
directory under the system's temporary one where the process has no home: a container run
under an arbitrary user id with ``HOME`` unset)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    given = os.environ.get("VLLM_CSV_CACHE")
    if given:
        return Path(given)
    try:
        return Path.home() / ".cache" / "vllm_csv"
    except RuntimeError:  # (no HOME and no passwd entry for the user)
        return Path(tempfile.gettempdir()) / f"vllm_csv-{os.getuid()}"


def index_path(fingerprint: str, num_clusters: int) -> Path:
    """The cached index of the head with this fingerprint, clustered ``num_clusters`` ways."""
    return cache_root() / "index" / f"{fingerprint}-C{num_clusters}.safetensors"


def shard_index_path(path: str | Path, rank: int, size: int) -> Path:
    """The file of rank ``rank``'s shard for the index ``path`` given to a TP=``size`` server:
    ``head.csvindex`` -> ``head.tp2-rank0.csvindex``."""
    p = Path(path)
    return p.with_name(f"{p.stem}.tp{size}-rank{rank}{p.suffix}")
