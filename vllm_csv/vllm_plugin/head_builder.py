"""Building the certified head of a :class:`~.logits_processor.CSVLogitsProcessor` from vLLM's
LM-head layer, and what decides whether one can be built.

- :func:`unsupported_config` (at the layer's construction) and :func:`unsupported_head` (at its
  first call): why CSV stays off for this layer (None: it can run);
- :func:`build_head`: the index (loaded, checked, or built), then a
  :class:`~vllm_csv.head.CertifiedHead` over the whole head, or under tensor parallelism a
  :class:`~vllm_csv.sharded.ShardedHead` over this rank's shard, with vLLM's own GEMM as the
  dense engine the head probes (:func:`vllm_linear`);
- :func:`metrics_for`: the head's metrics (:mod:`vllm_csv.metrics`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.logger import init_logger

from .. import head as csv_head
from ..errors import CSVError

logger = init_logger("vllm.csv_decode")


def build_head(layer, lm_head, embedding_bias, drafter: bool = False) -> tuple[object, Callable[[], object]]:
    """The certified head for ``layer`` (a :class:`~.logits_processor.CSVLogitsProcessor`) called
    with ``lm_head`` and ``embedding_bias``, and a function that makes its metrics (called where
    the layer has none yet: a rebuild keeps them). ``drafter``: a speculative drafter's layer,
    which a given ``--csv-index`` (the target's head's) does not describe: the cache serves it.

    Raises
    ------
    CSVError
        The index cannot be loaded or built (a bad ``--csv-index``; under tensor parallelism
        raised on every rank by the :class:`~vllm_csv.sharded.ShardedHead`, after its first
        collective).
    """
    from .index_loader import load_or_build_index

    cfg = layer.csv_config.model_copy(update={"index": None}) if drafter else layer.csv_config
    weight = lm_head.weight
    # vLLM's head adds ``embedding_bias`` alone (``quant_method.apply(..., bias=embedding_bias)``),
    # never ``lm_head.bias`` (PhiMoE and Moondream 3 build one and do not pass it)
    bias = embedding_bias
    V = layer.org_vocab_size
    cache = not layer._csv_stale  # (a rebuild after the weights changed is not cached)
    if getattr(lm_head, "tp_size", 1) > 1:  # vocab-sharded head: one decision on every rank
        from ..sharded import Shard, ShardedHead, VllmTPGroup

        shard = Shard.of_lm_head(lm_head, V)
        index = failed = None
        if (cfg.screen == "ball" or cfg.index) and shard.real:
            n = shard.real  # the shard's real rows: its index is fingerprinted on them
            try:
                index = load_or_build_index(weight[:n], None if bias is None else bias[:n], cfg, shard, cache=cache)
            except CSVError as e:  # (raised on every rank by ShardedHead, after its first collective)
                failed = e
        head = ShardedHead(weight, bias, shard, VllmTPGroup(), config=layer.csv_config.head_config(),
                           softcap=layer.soft_cap, scale=layer.scale, index=index, engine_linear=vllm_linear(),
                           failed=failed)
        return head, lambda: metrics_for(layer.csv_model_name, head, index, lm_head.tp_rank)
    index = None
    if cfg.screen == "ball" or cfg.index:  # a given index is always checked
        index = load_or_build_index(weight[:V], None if bias is None else bias[:V], cfg, cache=cache)
    head = csv_head.CertifiedHead(
        weight, bias, vocab_size=V, config=layer.csv_config.head_config(), index=index,
        softcap=layer.soft_cap, scale=layer.scale, engine_linear=vllm_linear())
    logger.info("CSV dense engine probed (vLLM's own GEMM): %s", head.engine_probe.describe())
    return head, lambda: metrics_for(layer.csv_model_name, head, index)


def vllm_linear():
    """``linear(h, w)``: vLLM's own unquantized GEMM, as its LM head's ``UnquantizedEmbeddingMethod``
    runs it (on a CPU through ``dispatch_cpu_unquantized_gemm``'s kernel, oneDNN where it packs),
    on weights ``w`` of a probe layer: what :func:`vllm_csv.dense_engine.probe_engine` runs on the
    worker. None where vLLM's helpers are missing (the head then probes ``F.linear``)."""
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm, dispatch_unquantized_gemm
        from vllm.platforms import current_platform
    except ImportError:
        return None
    gemm = dispatch_unquantized_gemm()

    def linear(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
        if current_platform.is_cpu():
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        return gemm(layer, h, layer.weight, None)

    return linear


def logits_processor_plugins() -> list[str]:
    """The installed logits-processor plugins (entry points of vLLM's group
    ``vllm.logits_processors``), which vLLM's ``build_logitsprocs`` loads beside
    ``--logits-processors`` without being asked: custom processors driven by ``extra_args``
    that no sampling field shows."""
    from importlib.metadata import entry_points

    try:
        from vllm.v1.sample.logits_processor import LOGITSPROCS_GROUP as group
    except ImportError:
        group = "vllm.logits_processors"
    return sorted(ep.name for ep in entry_points(group=group))


def unsupported_head(lm_head) -> str | None:
    """Why the screens cannot bound this ``lm_head``'s logits (None: they can)."""
    qm = getattr(lm_head, "quant_method", None)
    if qm is not None and type(qm).__name__ not in ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod"):
        return f"a quantized LM head ({type(qm).__name__})"
    w = getattr(lm_head, "weight", None)
    if not isinstance(w, torch.Tensor) or not w.dtype.is_floating_point or w.element_size() < 2:
        return "an LM head without a 16- or 32-bit float weight"
    if getattr(lm_head, "tp_size", 1) > 1 and getattr(lm_head, "num_added_embeddings", 0):
        # (the same on every rank: each switches off; PLaMo 3 rounds its head's rows up this way)
        return "an added vocabulary (LoRA extra tokens, or head rows past the vocabulary) under tensor parallelism"
    return None


def unsupported_config(vc, layer) -> str | None:
    # (speculative decoding: the runners' plans certify greedy requests' target rows, v1/spec.py
    # and v2/spec.py, and V1's drafters' greedy heads)
    mc = getattr(vc, "model_config", None)
    if mc is not None and getattr(mc, "logits_processors", None):
        return "custom --logits-processors"
    plugins = logits_processor_plugins()
    if plugins:  # (vLLM loads every one into every V1 batch: they act on rows the plan cannot see)
        return f"logits-processor plugins installed ({', '.join(plugins)})"
    if getattr(layer, "logits_as_input", False):
        return "the model passes logits, not hidden states"
    if getattr(layer, "head_dtype", None) is not None and mc is not None and layer.head_dtype != mc.dtype:
        return "a head_dtype override"
    return None


def metrics_for(model_name: str, head, index, rank: int | None = None):
    from ..metrics import create_metrics

    screen = getattr(head, "screen_name", None) or head.screen.name
    info = {"screen": screen, "vocab_size": head.vocab_size, "hidden_size": head.hidden_size}
    if index is not None:
        info.update(clusters=index.num_clusters, fingerprint=index.fingerprint)
    return create_metrics(model_name, info, rank=rank)  # None (one warning) if its files cannot be made
