"""The index at start-up (screen 'ball'): the given file, else the cache, else build it."""

from __future__ import annotations

import torch
from vllm.logger import init_logger

from ..cache import index_path
from ..errors import CSVError
from ..index import CSVIndex, build_index, default_num_clusters, fingerprint_weights

logger = init_logger("vllm.csv_decode")


def load_or_build_index(weight: torch.Tensor, bias: torch.Tensor | None, cfg) -> CSVIndex:
    fp = fingerprint_weights(weight.cpu(), None if bias is None else bias.cpu())
    if cfg.index:
        return CSVIndex.load(cfg.index, expect_fingerprint=fp)  # mismatch or corruption: CSVError
    C = cfg.clusters or default_num_clusters(weight.shape[0])
    path = index_path(fp, C)
    if path.is_file():
        try:
            return CSVIndex.load(path, expect_fingerprint=fp)
        except CSVError as e:
            logger.warning("cached CSV index unusable (%s); rebuilding", e)
    logger.info("building the CSV index (%d clusters) for this LM head; cached at %s", C, path)
    idx = build_index(weight.float().cpu(), None if bias is None else bias.float().cpu(), C, progress=True)
    idx.save(path)
    return idx
