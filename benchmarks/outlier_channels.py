"""Outlier channels and the int8 screen (issue 45): what a few channels far above the rest of the
hidden state do to the int8 screen's pruning, and what splitting them off costs.

    python benchmarks/outlier_channels.py --model DIR --json results/outlier_channels.json

On held-out hidden states of the model (``lm_head.hidden_states``), bf16 head, two channels (the
most frequent argmax channels of the rows) multiplied by each ``--factors`` value, as trained
models grow massive activations: per screen (int8 with its outlier split, int8 with the split
off, fp16) and batch size, the share of the vocabulary scored exactly (a row that falls back
counts as V) and the certified rows, through ``CertifiedHead.topk``; and, on the unmodified rows,
the certified step's time (``sampler_logits``, greedy, median of rounds, the two int8 variants
interleaved) with and without the split, so that its cost where it does not trigger is seen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lm_head import hidden_states  # (benchmarks/lm_head.py)
from provenance import machine

import vllm_csv.screens.fbgemm as fb
from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.hf_head import load_lm_head

SPLIT = fb.OUTLIER_RATIO


def variant(name: str) -> None:
    fb.OUTLIER_RATIO = float("inf") if name == "int8-nosplit" else SPLIT


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--factors", type=float, nargs="+", default=[1.0, 4.0, 16.0, 64.0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--positions", type=int, default=256)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = Path(a.model)
    W = load_lm_head(model).weight.bfloat16()
    V = W.shape[0]
    h = hidden_states(model, a.positions, "cpu").float()
    chans = h.abs().argmax(1).bincount(minlength=h.shape[1]).topk(2).indices.tolist()
    heads = {"int8": CertifiedHead(W, config=HeadConfig(screen="int8", off_switch=False)),
             "fp16": CertifiedHead(W, config=HeadConfig(screen="fp16", off_switch=False))}
    rows = []
    for factor in a.factors:
        hh = h.clone()
        hh[:, chans] *= factor
        rest = hh.abs().sort(1, descending=True).values[:, fb.MAX_OUTLIERS:]
        ratio = float((hh.abs().amax(1) / rest.pow(2).mean(1).sqrt()).median())
        hb16 = hh.bfloat16()
        for name in ("int8", "int8-nosplit", "fp16"):
            variant(name)
            head = heads[name.split("-")[0]]
            for B in a.batches:
                scored = cert = 0
                for i in range(0, hb16.shape[0], B):
                    r = head.topk(hb16[i:i + B], 1, values=False)
                    scored += int(r.scored.sum())
                    cert += int(r.certified.sum())
                rows.append({"factor": factor, "max_over_rest_rms_p50": round(ratio, 2), "screen": name, "B": B,
                             "scored_share": scored / (hb16.shape[0] * V), "certified": cert,
                             "rows": hb16.shape[0]})
                print(f"x{factor:g} (max/rest-rms {ratio:.1f}) {name:13s} B={B:3d}: "
                      f"{100 * rows[-1]['scored_share']:.3f}% scored, {cert}/{hb16.shape[0]} certified", flush=True)
    variant("int8")
    hb16 = h.bfloat16()
    head = heads["int8"]
    for B in a.batches:
        batches = [hb16[i:i + B] for i in range(0, hb16.shape[0], B)][:16]
        k = torch.ones(B, dtype=torch.long)
        times = {"int8": [], "int8-nosplit": []}
        for _ in range(a.rounds):
            for name in times:
                variant(name)
                t0 = time.perf_counter()
                for hb in batches:
                    head.sampler_logits(hb, k)
                times[name].append((time.perf_counter() - t0) / len(batches))
        s, n = statistics.median(times["int8"]), statistics.median(times["int8-nosplit"])
        rows.append({"factor": 1.0, "screen": "int8", "B": B, "step_ms": s * 1e3, "baseline": "int8-nosplit",
                     "baseline_ms": n * 1e3, "speedup_vs_baseline": n / s})
        print(f"unmodified rows, B={B}: step {s * 1e3:.3f} ms with the split, {n * 1e3:.3f} ms without "
              f"({n / s:.3f}x)", flush=True)
    variant("int8")
    out = {"machine": machine(), "model": str(model), "V": V, "d": W.shape[1], "channels": chans, "rows": rows}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    from record import record_run  # one row a measurement in benchmarks/results/results.csv
    record_run("outlier_channels", out, source=a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
