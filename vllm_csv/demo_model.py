"""A small Llama-style model trained here, deterministically, on the CPU.

The corpus is the Python standard library's own source (present on every machine),
the tokenizer a byte-level BPE trained on it with ``tokenizers``, the model a
``LlamaForCausalLM`` with an untied, *learned* LM head. Two recipes are named here:

* :data:`DEMO`, the embedded default that ``vllm-csv serve`` (``bash run.sh``) serves: a
  vocabulary of 65536 and d = 768, so that the head is about 78% of the weights read per
  generated token and CSV pays on a CPU (4 to 7 minutes to train on 2 cores);
* :data:`TEST`, the model of the end-to-end tests: V = 8192, d = 256, small enough that a
  test server starts quickly, too small for CSV to pay (its tests turn the off-switch off).

``vllm_csv.testing.fixtures`` trains more (V = 32768, d = 256 to 4096) with the same code.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .cache import cache_root

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(frozen=True)
class Recipe:
    vocab_size: int = 8192
    hidden_size: int = 256
    layers: int = 2
    heads: int = 4
    seq_len: int = 128
    batch: int = 24
    steps: int = 160
    lr: float = 3e-3
    corpus_bytes: int = 3_000_000
    seed: int = 0
    exclude: tuple[str, ...] = ()  # stdlib packages left out of the corpus

    def key(self) -> str:
        d = asdict(self)
        if not self.exclude:  # recipes from before the field keep their key (and their cache)
            d.pop("exclude")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


TEST = Recipe()
# The head dominates a training step on the CPU: few tokens a step. `encodings` (code-page
# tables) left out, so that the model writes Python rather than character tables.
DEMO = Recipe(vocab_size=65536, hidden_size=768, layers=2, heads=12, seq_len=128, batch=8, steps=60,
              lr=2e-3, corpus_bytes=6_000_000, exclude=("encodings",))


def corpus_files(limit_bytes: int, exclude: tuple[str, ...] = ()) -> list[Path]:
    """Deterministic subset of the stdlib's ``.py`` files (sorted), up to ``limit_bytes``,
    without the top-level packages ``exclude`` (nor ``test`` and ``site-packages``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or p.parts[len(root.parts)] in ("test", *exclude):
            continue
        try:
            n = p.stat().st_size
        except OSError:
            continue
        out.append(p)
        total += n
        if total >= limit_bytes:
            break
    return out


def _train_tokenizer(files: list[Path], vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE}, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}))


def _token_stream(files: list[Path], out: Path):
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch([f.read_text(errors="replace") for f in files]):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def train(recipe: Recipe, out: Path, progress: bool = True, device: str = "cpu") -> dict:
    """Train the tokenizer and the model of ``recipe`` into ``out`` (on ``device``; the CPU
    run is bit-for-bit deterministic, a GPU run is not); returns a summary."""
    import torch
    from tqdm.auto import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(recipe.seed)
    files = corpus_files(recipe.corpus_bytes, recipe.exclude)
    _train_tokenizer(files, recipe.vocab_size, out)
    data = _token_stream(files, out)
    cfg = LlamaConfig(vocab_size=recipe.vocab_size, hidden_size=recipe.hidden_size,
                      intermediate_size=int(recipe.hidden_size * 8 / 3) // 16 * 16,
                      num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads,
                      num_key_value_heads=recipe.heads, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, torch_dtype="float32")
    model = LlamaForCausalLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(recipe.seed)
    n_train = int(len(data) * 0.95)
    warm = max(1, recipe.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, recipe.steps) / recipe.steps)))
    model.train()
    loss_v = float("nan")
    for _ in tqdm(range(recipe.steps), desc="training demo model", disable=not progress, unit="step"):
        starts = torch.randint(0, n_train - recipe.seq_len - 1, (recipe.batch,), generator=g)
        x = torch.stack([data[s : s + recipe.seq_len] for s in starts.tolist()]).to(device)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_v = float(loss.detach())
    model.eval()
    with torch.no_grad():  # held-out loss on the last 5% of the token stream
        held = data[n_train:][: 8 * recipe.seq_len].view(8, recipe.seq_len).to(device)
        val = float(model(input_ids=held, labels=held).loss)
    model.cpu().save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    summary = {"recipe": asdict(recipe), "train_loss": round(loss_v, 4), "val_loss": round(val, 4),
               "tokens": int(len(data)), "device": device, "seconds": round(time.perf_counter() - t0, 1)}
    (out / "vllm_csv_recipe.json").write_text(json.dumps(summary, indent=1))
    return summary


# The demo's draft model for speculative decoding (benchmarks, issue 46): the demo's corpus and
# vocabulary, hence the same tokenizer (trained the same way on the same files), a quarter of its
# width and one layer. Its head (65536 x 256) is most of what a draft token reads.
DRAFT = replace(DEMO, hidden_size=256, layers=1, heads=4)

# A small learned model of the class issue 45 measured on AVX2 CPUs (V 16384, d 384, 4 layers: the
# head ~45% of the weights a token reads, ~22% of a step, so at most ~1.28x end to end): where CSV
# must not cost the user anything (benchmarks/run_avx2.sh, certified_share.py). ~130 s on a CPU.
SMALL = Recipe(vocab_size=16384, hidden_size=384, layers=4, heads=6, seq_len=128, batch=8, steps=200, lr=2e-3,
               corpus_bytes=6_000_000)


def ensure_model(recipe: Recipe, cache_dir: str | os.PathLike | None = None, *,
                 name: str = "demo", progress: bool = True, device: str = "cpu") -> Path:
    """Return the model directory of ``recipe``, training it once (atomically, under a
    file lock so that concurrent callers wait instead of training twice)."""
    from filelock import FileLock

    root = Path(cache_dir) if cache_dir else cache_root() / "models"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{name}-{recipe.key()}"
    with FileLock(str(final) + ".lock"):
        if (final / "vllm_csv_recipe.json").is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        try:
            s = train(recipe, tmp, progress, device)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if progress:
            print(f"[vllm-csv] trained {final.name} in {s['seconds']}s: val loss {s['val_loss']}")
    return final


def ensure_demo_model(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The embedded default model of ``vllm-csv serve`` (:data:`DEMO`)."""
    return ensure_model(DEMO, cache_dir, name="demo", progress=progress)


def ensure_test_model(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The model of the end-to-end tests (:data:`TEST`)."""
    return ensure_model(TEST, cache_dir, name="test", progress=progress)


def ensure_draft_model(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The demo's draft model (:data:`DRAFT`: the demo's tokenizer), for speculative decoding."""
    return ensure_model(DRAFT, cache_dir, name="draft", progress=progress)


def ensure_small_model(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The small learned model of issue 45 (:data:`SMALL`)."""
    return ensure_model(SMALL, cache_dir, name="issue45-v16384-d384-l4", progress=progress)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m vllm_csv.demo_model", description=__doc__)
    p.add_argument("--output", default=None, help="cache directory (default: the vllm-csv cache)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--draft", action="store_true", help="the demo's draft model (speculative decoding) instead")
    which.add_argument("--small", action="store_true", help="the small learned model of issue 45 (V 16384, d 384) instead")
    args = p.parse_args(argv)
    print((ensure_draft_model if args.draft else ensure_small_model if args.small else ensure_demo_model)(args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
