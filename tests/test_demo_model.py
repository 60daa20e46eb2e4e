"""The locally trained model: cached, deterministic, atomic, loadable by transformers."""

import hashlib

import pytest
import torch

from vllm_csv import demo_model
from vllm_csv.demo_model import Recipe, ensure_model

TINY = Recipe(vocab_size=300, hidden_size=32, layers=1, heads=2, seq_len=32, batch=4, steps=3,
              corpus_bytes=200_000)


def digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_model_trains_caches_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = ensure_model(TINY, tmp_path / "a", name="tiny", progress=False)
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(TINY, tmp_path / "a", name="tiny", progress=False) == p
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime  # cache hit: not retrained
    q = ensure_model(TINY, tmp_path / "b", name="tiny", progress=False)
    assert digest(p) == digest(q)  # deterministic
    model = AutoModelForCausalLM.from_pretrained(p)
    tok = AutoTokenizer.from_pretrained(p)
    ids = tok("def f(x):\n    return x", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape[-1] == TINY.vocab_size
    assert not model.config.tie_word_embeddings
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_failed_training_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(demo_model, "_token_stream", boom)
    with pytest.raises(RuntimeError):
        ensure_model(TINY, tmp_path, name="tiny", progress=False)
    assert [x.name for x in tmp_path.iterdir() if not x.name.endswith(".lock")] == []
