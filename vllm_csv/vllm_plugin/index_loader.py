"""The index at start-up (screen 'ball'): the given file, else the cache, else build it.

Under tensor parallelism each rank's index covers its shard's real rows only (the ball bound
of a token needs only its own cluster, so a shard's index is the index of a smaller head):
it is fingerprinted on those rows, so the cache keeps one file per shard, and a given
``--csv-index PATH`` is read per rank from :func:`shard_index_path` (``vllm-csv build-index
--tensor-parallel-size N`` writes those files).
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger

from ..cache import index_path, shard_index_path
from ..errors import CSVError
from ..index import CSVIndex, build_index, default_num_clusters, fingerprint_weights

logger = init_logger("vllm.csv_decode")


def _bias_hint(path, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """Where a given index is the head's without the bias vLLM adds here, the ``build-index``
    flag that writes the served head's (else nothing)."""
    if bias is None:
        return ""
    try:
        built = CSVIndex.load(path).fingerprint
    except CSVError:
        return ""
    if built != fingerprint_weights(weight.cpu(), None):
        return ""
    return ("; the file is this head's without the lm_head.bias vLLM adds here (its Transformers backend adds it "
            "always): build it with `vllm-csv build-index MODEL --bias yes`")


def load_or_build_index(weight: torch.Tensor, bias: torch.Tensor | None, cfg, shard=None,
                        cache: bool = True) -> CSVIndex:
    """The index of ``weight`` (``shard``: a :class:`~vllm_csv.sharded.Shard` whose real rows
    ``weight`` are). A given file that does not match these rows is a :class:`CSVError`.
    ``cache``: a built index is written to the cache (not for weights written while serving:
    an RLHF run would leave one file per weight version)."""
    fp = fingerprint_weights(weight.cpu(), None if bias is None else bias.cpu())
    if cfg.index:
        if shard is None:
            try:
                return CSVIndex.load(cfg.index, expect_fingerprint=fp)  # mismatch or corruption: CSVError
            except CSVError as e:
                raise CSVError(f"{e}{_bias_hint(cfg.index, weight, bias)}") from None
        path = shard_index_path(cfg.index, shard.rank, shard.size)
        try:
            return CSVIndex.load(path, expect_fingerprint=fp)
        except CSVError as e:
            raise CSVError(f"{e}. With --tensor-parallel-size {shard.size}, rank {shard.rank} reads the index of "
                           f"its shard (vocabulary rows {shard.real_rows.start}...{shard.real_rows.stop}) from {path}; "
                           f"write those files with `vllm-csv build-index MODEL --output {cfg.index} "
                           f"--tensor-parallel-size {shard.size}`") from None
    C = cfg.clusters or default_num_clusters(weight.shape[0])
    path = index_path(fp, C)
    if path.is_file():
        try:
            return CSVIndex.load(path, expect_fingerprint=fp)
        except CSVError as e:
            logger.warning("cached CSV index unusable (%s); rebuilding", e)
    logger.info("building the CSV index (%d clusters) for this LM head%s; %s", C,
                "" if shard is None else f" shard (rank {shard.rank} of {shard.size})",
                f"cached at {path}" if cache else "not cached (weights written while serving)")
    idx = build_index(weight.float().cpu(), None if bias is None else bias.float().cpu(), C, progress=True)
    if not cache:
        return idx
    try:
        idx.save(path)
    except CSVError as e:  # (a cache that cannot be written: this process keeps the index it built)
        logger.warning("CSV index not cached (%s); set VLLM_CSV_CACHE to a writable directory to keep it "
                       "between starts", e)
    return idx
