"""Learned-head fixtures: small Llama-style models trained here, cached between runs.

    python -m vllm_csv.testing.fixtures --hidden 256 512 1024        # prints the model directories

Same recipe as the demo model (vllm_csv.demo_model): a byte-level BPE vocabulary of
32768 trained on the Python standard library, a LlamaForCausalLM with an untied head,
trained deterministically on the CPU. Larger hidden sizes train fewer, smaller steps so
that each fixture takes minutes on two cores. With ``--device cuda`` the same architecture
trains longer (more steps, larger batches, TF32 matmuls) in about a minute a fixture, for
the larger hidden sizes (2048 to 4096) that a GPU benchmark needs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..demo_model import Recipe, ensure_model

VOCAB = 32768


def recipe(hidden: int, device: str = "cpu") -> Recipe:
    """The training recipe of the fixture of hidden size ``hidden`` trained on ``device``."""
    if device != "cpu":
        return Recipe(vocab_size=VOCAB, hidden_size=hidden, layers=2, heads=max(4, hidden // 128),
                      seq_len=256, batch=32, steps=400, lr=1e-3, corpus_bytes=6_000_000)
    # The 32k-way softmax dominates a step: few tokens a step, more steps for small models.
    return Recipe(vocab_size=VOCAB, hidden_size=hidden, layers=2, heads=max(4, hidden // 64),
                  seq_len=128, batch=8, steps=max(60, 30_000 // hidden), lr=2e-3, corpus_bytes=6_000_000)


def fixture(hidden: int, cache_dir: str | None = None, device: str = "cpu") -> Path:
    """The model directory of the fixture of hidden size ``hidden``: trained on ``device`` the
    first time, then taken from ``cache_dir`` (default: the vllm-csv cache)."""
    tag = "" if device == "cpu" else f"-{device}"
    if device != "cpu":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True  # training only; the benchmark turns it off again
    try:
        return ensure_model(recipe(hidden, device), cache_dir, name=f"fixture-v{VOCAB}-d{hidden}{tag}",
                            device=device)
    finally:
        if device != "cpu":
            torch.backends.cuda.matmul.allow_tf32 = False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--out", default=None, help="cache directory (default: the vllm-csv cache)")
    p.add_argument("--device", default="cpu", help="train on this device (cpu: deterministic)")
    args = p.parse_args(argv)
    for h in args.hidden:
        print(fixture(h, args.out, args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
