"""The replacement for vLLM's ``LogitsProcessor``: certified rows on the CSV path.

Registered with ``LogitsProcessor.register_oot``. At construction it reads
``additional_config["csv_decode"]``; when CSV is off it turns itself back into
vLLM's own class, so the layer is exactly what vLLM would have built. When on, the
first ``forward`` builds a :class:`~vllm_csv.head.CertifiedHead` from the layer's
weights, and each step's rows take the certified path or vLLM's dense code
(``super()._get_logits`` + soft-cap + scale, unchanged) as the runner's plan says.
With tensor parallelism the head is a :class:`~vllm_csv.sharded.ShardedHead` over this
rank's shard: every rank reaches the same decision, and dense rows take vLLM's all-gather.
"""

from __future__ import annotations

import time

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.logits_processor import LogitsProcessor

from .. import head as csv_head
from . import step_plan
from .config import CSVDecodeConfig, from_additional_config

logger = init_logger("vllm.csv_decode")


class CSVLogitsProcessor(LogitsProcessor):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from vllm.config import get_current_vllm_config

        vc = get_current_vllm_config()
        cfg = from_additional_config(getattr(vc, "additional_config", None))
        reason = _unsupported(vc, self) if cfg.enabled else None
        if not cfg.enabled or reason:
            if reason:
                logger.warning("CSV-Decode is off for this LM head: %s; using the dense head.", reason)
            self.__class__ = LogitsProcessor  # exactly vLLM's layer
            return
        self.csv_config: CSVDecodeConfig = cfg
        self.csv_model_name = getattr(getattr(vc, "model_config", None), "served_model_name", None) or \
            getattr(getattr(vc, "model_config", None), "model", "")
        self.csv_head = None  # CertifiedHead, or ShardedHead under tensor parallelism
        self.csv_metrics = None
        self._csv_logged = False

    def _dense(self, lm_head, hidden: torch.Tensor, embedding_bias) -> torch.Tensor:
        return super().forward(lm_head, hidden, embedding_bias)

    def forward(self, lm_head, hidden_states: torch.Tensor, embedding_bias: torch.Tensor | None = None,
                skip_gather: bool = False):
        # The head (and its index) is built at the first call, which vLLM makes during
        # start-up (profiling / warm-up): a bad index stops the server there.
        t0 = time.perf_counter()  # the off-switch charges this layer's whole step, plan included
        head = self._get_head(lm_head, embedding_bias)
        plan = step_plan.take_plan(hidden_states.shape[0])
        if plan is None or skip_gather or hidden_states.dim() != 2 or not any(plan.topk):
            return super().forward(lm_head, hidden_states, embedding_bias, skip_gather)
        topk = torch.tensor(plan.topk, dtype=torch.long)
        logits, stats = head.sampler_logits(hidden_states, topk,
                                            lambda h: self._dense(lm_head, h, embedding_bias), t0=t0)
        if not self._csv_logged:
            logger.info("CSV-Decode active: screen=%s V=%d d=%d, first step %d/%d rows certified",
                        stats.screen, head.vocab_size, head.hidden_size, stats.certified, stats.rows)
            self._csv_logged = True
        if self.csv_metrics is not None:  # under TP: the global decision (rank 0) and per-rank counts
            sw = head.off_switch
            self.csv_metrics.record(stats, None if sw is None else sw.dense_seconds.get(stats.rows))
        return logits

    def _get_head(self, lm_head, embedding_bias):
        if self.csv_head is None:
            from .index_loader import load_or_build_index

            weight = lm_head.weight
            bias = embedding_bias if embedding_bias is not None else getattr(lm_head, "bias", None)
            V = self.org_vocab_size
            if getattr(lm_head, "tp_size", 1) > 1:  # vocab-sharded head: one decision on every rank
                from ..sharded import Shard, ShardedHead, VllmTPGroup

                self.csv_head = ShardedHead(
                    weight, bias, Shard.of_lm_head(lm_head, V), VllmTPGroup(),
                    config=self.csv_config.head_config(), softcap=self.soft_cap, scale=self.scale)
                self.csv_metrics = _metrics(self.csv_model_name, self.csv_head, None, lm_head.tp_rank)
                return self.csv_head
            index = None
            if self.csv_config.screen == "ball" or self.csv_config.index:  # a given index is always checked
                index = load_or_build_index(weight[:V], None if bias is None else bias[:V], self.csv_config)
            self.csv_head = csv_head.CertifiedHead(
                weight, bias, vocab_size=V, config=self.csv_config.head_config(), index=index,
                softcap=self.soft_cap, scale=self.scale)
            self.csv_metrics = _metrics(self.csv_model_name, self.csv_head, index)
        return self.csv_head


def _unsupported(vc, layer) -> str | None:
    if getattr(vc, "speculative_config", None) is not None:
        return "speculative decoding (draft and target heads stay dense)"
    mc = getattr(vc, "model_config", None)
    if mc is not None and getattr(mc, "logits_processors", None):
        return "custom --logits-processors"
    if getattr(layer, "logits_as_input", False):
        return "the model passes logits, not hidden states"
    if getattr(layer, "head_dtype", None) is not None and mc is not None and layer.head_dtype != mc.dtype:
        return "a head_dtype override"
    return None


def _metrics(model_name: str, head, index, rank: int | None = None):
    from ..metrics import CSVMetrics

    screen = getattr(head, "screen_name", None) or head.screen.name
    info = {"screen": screen, "vocab_size": head.vocab_size, "hidden_size": head.hidden_size}
    if index is not None:
        info.update(clusters=index.num_clusters, fingerprint=index.fingerprint)
    return CSVMetrics(model_name, info, rank=rank)
