"""Read only the LM head (and its bias, where vLLM adds it: :data:`BIAS_ADDED`) from a Hugging
Face model directory.

Looks for ``lm_head.weight``; when the model ties its head to the input embedding
(``tie_word_embeddings``) or has no ``lm_head.weight``, takes the embedding matrix.
Only that tensor is read from the safetensors shards (``safe_open`` is lazy).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import CSVError

HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight", "output.weight")
EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embeddings.weight")
QUANT_SUFFIXES = ("qweight", "weight_scale", "weight_packed", "scales", "qzeros", "weight_zero_point")
# the architectures whose vLLM model adds its lm_head.bias to the logits (it passes it to the
# LogitsProcessor as embedding_bias; vLLM 0.32: GPT-J alone): the others' bias, if their
# checkpoint holds one (PhiMoE, Moondream 3), is not part of the head vLLM serves
BIAS_ADDED = ("GPTJForCausalLM",)


@dataclass
class LMHead:
    weight: torch.Tensor  # [V, d]
    bias: torch.Tensor | None
    softcap: float | None  # Gemma-2 final_logit_softcapping
    scale: float  # e.g. Cohere logit_scale
    vocab_size: int
    source: str  # tensor name it came from


def _config(model_dir: Path) -> dict:
    cfg = model_dir / "config.json"
    if not cfg.is_file():
        raise CSVError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    try:
        c = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise CSVError(f"cannot read {cfg}: {e}") from None
    return {**c, **(c.get("text_config") or {})}  # multimodal configs keep the LM's fields here


def _key_to_shard(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CSVError(f"cannot read {index}: {e}") from None
        return {k: model_dir / v for k, v in wm.items()}
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise CSVError(f"no .safetensors weights in {model_dir}")
    out = {}
    for s in shards:
        try:
            with safe_open(str(s), framework="pt") as f:
                out.update({k: s for k in f.keys()})
        except Exception as e:
            raise CSVError(f"corrupt safetensors shard {s}: {e}") from None
    return out


def _get(shard: Path, key: str) -> torch.Tensor:
    try:
        with safe_open(str(shard), framework="pt") as f:
            return f.get_tensor(key)
    except Exception as e:
        raise CSVError(f"cannot read {key} from {shard}: {e}") from None


def load_lm_head(model_dir: str | Path, bias: str = "auto") -> LMHead:
    """Return the head of the model in ``model_dir``, or raise :class:`CSVError`. ``bias``:
    ``"auto"`` reads ``lm_head.bias`` where vLLM's own model of the architecture adds it
    (:data:`BIAS_ADDED`), ``"yes"`` wherever the checkpoint holds one (vLLM's Transformers
    backend, ``--model-impl transformers`` or an architecture vLLM has no model of, adds it
    always), ``"no"`` never."""
    if bias not in ("auto", "yes", "no"):
        raise CSVError(f"bias must be auto, yes or no, got {bias!r}")
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CSVError(f"model directory not found: {model_dir}")
    cfg = _config(model_dir)
    keys = _key_to_shard(model_dir)
    head = next((k for k in HEAD_KEYS if k in keys), None)
    if head is None:  # tied head (tie_word_embeddings): the input embedding is the head
        head = next((k for k in sorted(keys) if k.endswith(EMBED_SUFFIXES)), None)
    if head is None:
        raise CSVError(f"no LM head in {model_dir}: none of {HEAD_KEYS} nor a tied embedding")
    prefix = head.rsplit(".", 1)[0]
    if any(k.startswith(prefix + ".") and k.endswith(QUANT_SUFFIXES) for k in keys):
        raise CSVError(f"the LM head {prefix} of {model_dir} is quantized; vllm-csv needs a floating-point head")
    weight = _get(keys[head], head)
    if weight.dim() != 2 or not weight.is_floating_point() or weight.element_size() < 2:
        raise CSVError(f"the LM head {head} of {model_dir} is {weight.dtype} {tuple(weight.shape)}; "
                       "vllm-csv needs a 2-D fp16/bf16/fp32 head (quantized heads are not supported)")
    bias_key = prefix + ".bias"
    adds_bias = bias == "yes" or bias == "auto" and any(a in BIAS_ADDED for a in cfg.get("architectures") or ())
    bias = _get(keys[bias_key], bias_key) if bias_key in keys and head in HEAD_KEYS and adds_bias else None
    return LMHead(weight, bias, cfg.get("final_logit_softcapping"), float(cfg.get("logit_scale", 1.0) or 1.0),
                  int(cfg.get("vocab_size") or weight.shape[0]), head)
