"""How many dimensions a model's final hidden states span: a caution for speed figures on small
learned fixtures.

For each model (a Hugging Face directory, e.g. the demo's under ``~/.cache/vllm_csv/models``) it
collects the hidden states the head sees on held-out text (``lm_head.hidden_states``), fits their
principal directions on the first half (uncentred SVD) and reports, on the second half: the share
of the states' energy in the top ``k`` directions, the median and largest norm of what is left,
and the share of the vocabulary a screen over those ``k`` directions would leave to score (the
tokens whose bound ``<w_i P, h> + ||w_i (I - P)|| ||(I - P) h||`` reaches the row's maximum, an
exact bound). A model whose states live in a few dimensions makes any screen look better than it
would on a real model's; nothing in the product projects onto such a subspace.

Usage: python benchmarks/hidden_rank.py --models demo-79fe395bffd1 [--positions 4096] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from lm_head import hidden_states, load_lm_head
from provenance import machine

KS = (8, 16, 32, 64, 128)


def measure(model_dir: Path, positions: int) -> dict:
    W = load_lm_head(model_dir).weight.float()
    H = hidden_states(model_dir, positions, "cpu").float()
    fit, held = H[: len(H) // 2], H[len(H) // 2:]
    _, S, Vt = torch.linalg.svd(fit, full_matrices=False)
    energy = (S**2).cumsum(0) / (S**2).sum()
    top = (held @ W.T).amax(1)
    out = {"model": model_dir.name, "shape": f"{W.shape[0]}x{W.shape[1]}", "positions": len(H), "k": {}}
    for k in KS:
        if k > Vt.shape[0]:
            break
        U = Vt[:k].T
        Wa, Ha = W @ U, held @ U
        w_rest = (W - Wa @ U.T).norm(dim=1)
        h_rest = (held - Ha @ U.T).norm(dim=1)
        left = ((Ha @ Wa.T + h_rest[:, None] * w_rest[None]) >= top[:, None]).float().mean(1)
        share = h_rest / held.norm(dim=1)
        out["k"][k] = {"energy_fit": float(energy[k - 1]), "rest_norm_median": float(share.median()),
                       "rest_norm_max": float(share.max()), "left_median": float(left.median()),
                       "left_p90": float(left.quantile(0.9))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", required=True, help="directories, or names under ~/.cache/vllm_csv/models")
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    for m in a.models:
        p = Path(m) if Path(m).is_dir() else Path.home() / ".cache/vllm_csv/models" / m
        if not p.is_dir():
            sys.exit(f"{m}: no such model directory")
        r = measure(p, a.positions)
        rows.append(r)
        for k, v in r["k"].items():
            print(f"{r['model']} ({r['shape']}) k={k}: energy {v['energy_fit']:.4f}, rest of ||h|| median "
                  f"{v['rest_norm_median']:.4f} max {v['rest_norm_max']:.4f}, V left median {v['left_median']:.5f} "
                  f"p90 {v['left_p90']:.5f}")
    if a.json:
        report = {"machine": machine(), "positions": a.positions, "command": " ".join(sys.argv), "models": rows}
        Path(a.json).write_text(json.dumps(report, indent=1))
        from record import record_run  # one row a measurement in benchmarks/results/results.csv

        record_run("hidden_rank", report, source=a.json)


if __name__ == "__main__":
    main()
