"""V2 top-k / top-p rows on a learned head (issue 46): the share of rows the V2 sampler hook
certifies when V2 masks them with a top-k or a top-p, beside the same rows drawn plainly.

    python benchmarks/v2_top_share.py --model demo --positions 512 \
        --json benchmarks/results/v2_top_share_demo_zen4.json

For each temperature, the same held-out hidden states (``lm_head.py``'s ``hidden_states``) go
through :func:`vllm_csv.sampling.rows_v2.certify_rows_v2` in batches, as the hook calls it (the torch
reference): ``plain`` (no mask: temperature sampling), ``masked`` (``top`` 1: a top-p, with a
top-k or not, or a top-k of 1, where the winner must be the row's certain maximum, at any ``p``),
and ``top_k`` for each ``--top-k`` (a top-k alone: the winner may also be a token certainly
ranked below ``k`` by the top-k margin; the device draw on CUDA keeps the maximum's rule). Also
the share of rows whose drawn token is the dense row's argmax (from the exact logits and the
replayed noise, float64): the ceiling of ``masked``; and the share whose drawn token ranks below
``k`` (the rows whose full-row winner a top-k keeps; where it does not, the certificate draws
among the tokens it surely keeps). Each certified ``top_k`` row's token is checked against the
draw from the dense row masked to its top ``k`` (float64; ``wrong``, which must be 0). What is measured is the certificate's reach,
not speed, and not correctness (``tests/test_v2_top_masks.py``, ``tests/test_sampler_hook_v2.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from certified_share import model_dir  # noqa: E402  (the cached fixtures by name)
from provenance import machine  # noqa: E402


@torch.no_grad()
def measure(model: Path, positions: int, temps, batch: int, screen: str, seed: int, top_ks=()) -> dict:
    from lm_head import hidden_states

    from vllm_csv import CertifiedHead, HeadConfig
    from vllm_csv.gumbel_noise import noise, uniform
    from vllm_csv.hf_head import load_lm_head
    from vllm_csv.sampling.head_adapter import HeadAdapter
    from vllm_csv.sampling.rows_v2 import certify_rows_v2
    from vllm_csv.testing.audit_draw_v2 import replay_top_k

    head_w = load_lm_head(model)
    W = head_w.weight[: head_w.vocab_size].to(torch.bfloat16).contiguous()
    b = None if head_w.bias is None else head_w.bias[: head_w.vocab_size].to(torch.bfloat16)
    H = hidden_states(model, positions, "cpu").to(torch.bfloat16)
    V, d = W.shape
    head = CertifiedHead(W, b, config=HeadConfig(screen=screen, off_switch=False))
    adapter = HeadAdapter(head)
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-2**62, 2**62, (H.shape[0],), generator=g)
    pos = torch.randint(0, 2**20, (H.shape[0],), generator=g)
    dense = head.dense_logits(H).float()
    cells = []
    for T in temps:
        temp = torch.full((H.shape[0],), T, dtype=torch.float32)
        # the token V2 draws from the exact logits (float64 noise: ties and the GPU's rounding aside)
        drawn = torch.cat([((dense[s:s + 64] / T).double() + noise(uniform(seeds[s:s + 64], pos[s:s + 64],
                                                                             torch.arange(V)))).argmax(1)
                           for s in range(0, H.shape[0], 64)])
        at_max = float((drawn == dense.argmax(1)).double().mean())
        rank = (dense > dense.gather(1, drawn[:, None])).sum(1) + 1  # the drawn token's (ties: best)
        for mode, k in [("plain", 0), ("masked", 1)] + [("top_k", k) for k in top_ks]:
            t0, cert, scored, wrong = time.perf_counter(), 0, 0, 0
            for s in range(0, H.shape[0], batch):
                sl = slice(s, s + batch)
                n = H[sl].shape[0]
                top = torch.full((n,), k, dtype=torch.long) if k else None
                r = certify_rows_v2(adapter, H[sl], seeds[sl], pos[sl], temp[sl], top=top)
                cert += int(r.certified.sum())
                scored += r.scored
                if mode == "top_k":  # the dense row masked to its top k (ties kept), drawn
                    want = replay_top_k(dense[sl] / T, torch.full((n,), k), seeds[sl], pos[sl])
                    wrong += int((r.certified & (r.winner != want)).sum())
            cell = {"temperature": T, "mode": mode, "rows": int(H.shape[0]), "certified": cert,
                    "certified_share": cert / H.shape[0], "drawn_at_argmax_share": at_max,
                    "scored_share_per_batch": scored / (V * -(-H.shape[0] // batch)),
                    "seconds": round(time.perf_counter() - t0, 2)}
            if mode == "top_k":
                cell.update(top_k=k, drawn_below_k_share=float((rank < k).double().mean()), wrong=wrong)
            cells.append(cell)
            print(f"T={T} {mode:6s}{k if mode == 'top_k' else '':>4} certified {cert}/{H.shape[0]} (argmax drawn "
                  f"{at_max:.3f}" + (f", ranked below k {cell['drawn_below_k_share']:.3f}, wrong {wrong}"
                                     if mode == "top_k" else "")
                  + ")", flush=True)
    return {"model": str(model), "V": V, "d": d, "dtype": "bf16", "screen": screen, "batch": batch,
            "positions": int(H.shape[0]), "cells": cells, "machine": machine()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo", help="demo, test, or a model directory")
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--temps", type=float, nargs="+", default=[0.7, 1.0, 1.3])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--screen", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top-k", type=int, nargs="*", default=[5, 50], help="top-k alone, each k (>= 2)")
    ap.add_argument("--json", help="write the result here (and its rows to benchmarks/results/results.csv)")
    args = ap.parse_args()
    model = Path(args.model) if Path(args.model).is_dir() else model_dir(args.model)
    out = measure(model, args.positions, args.temps, args.batch, args.screen, args.seed, args.top_k)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        from record import record_run

        record_run("v2_top_share", out, source=args.json)


if __name__ == "__main__":
    main()
