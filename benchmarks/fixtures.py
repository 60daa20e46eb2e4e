"""Learned-head fixtures: small Llama-style models trained here, cached between runs.

    python benchmarks/fixtures.py --hidden 256 512 1024        # prints the model directories

Same recipe as the demo model (vllm_csv.demo_model): a byte-level BPE vocabulary of
32768 trained on the Python standard library, a LlamaForCausalLM with an untied head,
trained deterministically on the CPU. Larger hidden sizes train fewer, smaller steps so
that each fixture takes minutes on two cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_csv.demo_model import Recipe, ensure_model  # noqa: E402

VOCAB = 32768


def recipe(hidden: int) -> Recipe:
    # The 32k-way softmax dominates a step: few tokens a step, more steps for small models.
    return Recipe(vocab_size=VOCAB, hidden_size=hidden, layers=2, heads=max(4, hidden // 64),
                  seq_len=128, batch=8, steps=max(60, 30_000 // hidden), lr=2e-3, corpus_bytes=6_000_000)


def fixture(hidden: int, cache_dir: str | None = None) -> Path:
    return ensure_model(recipe(hidden), cache_dir, name=f"fixture-v{VOCAB}-d{hidden}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--out", default=None, help="cache directory (default: the vllm-csv cache)")
    args = p.parse_args(argv)
    for h in args.hidden:
        print(fixture(h, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
