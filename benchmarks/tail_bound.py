"""Would a screen over part of the hidden dimensions prune? (An analysis, not a screen of this repo.)

    python benchmarks/tail_bound.py --model <HF model dir> --json benchmarks/results/tail_bound.json

A screen that multiplies only the first ``k`` of ``d`` dimensions bounds the rest by Cauchy-Schwarz,
``|<w_tail, h_tail>| <= ||w_tail|| ||h_tail||``, and would cut the multiplies of the whole-vocabulary
pass to ``k / d`` (what 3x at eight rows would take on AVX512-VNNI CPUs, where the int8 screen
already runs near the ``vpdpbusd`` ceiling). A token survives when its upper bound reaches the
largest lower bound of its row. This reports, exactly in fp32 (no quantisation, so the best case):

* on the speed benchmarks' peaked random states (``h = 6 sqrt(d) w_t + 0.3 noise``, as in
  ``lm_head.py --shapes``), the median share of the vocabulary surviving per row for each ``k / d``,
  and the median cosine between ``h`` and its top token's row;
* on a learned model's held-out hidden states (``--model``): the same cosine, the survivors for
  each ``k / d`` in the original basis, and, in the basis of the states' principal directions
  (fitted on one half of the positions, measured on the other), ``||h_tail|| / ||h||`` and the
  survivors.

The cosine decides it: with the state nearly parallel to one row (peaked states: about 1) a tail
bound prunes from ``k / d`` of about 3/4; with the cosines of a learned head it needs nearly all of
``d``, unless the states lie in a low-dimensional subspace.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from provenance import machine  # (benchmarks/provenance.py)
from vllm_csv.hf_head import load_lm_head
from vllm_csv.testing.heads import hidden_near_rows, peaked_head
from vllm_csv.testing.tail_bound import survivors, top_cosine

FRACTIONS = (0.0625, 0.125, 0.25, 0.5, 0.625, 0.75, 0.875, 0.9375)


def peaked(V: int, d: int, B: int) -> dict:
    """The states ``lm_head.py --shapes`` times (:mod:`vllm_csv.testing.heads`' ``peaked_head`` and
    ``hidden_near_rows``)."""
    W, g = peaked_head(V, d, seed=0)
    h = hidden_near_rows(W, B, g)
    return {"V": V, "d": d, "rows": B, "top_cosine": top_cosine(h, W),
            "survivors": {f: survivors(h, W, int(f * d)) for f in FRACTIONS}}


def learned(model: Path, positions: int) -> dict:
    from lm_head import hidden_states

    head = load_lm_head(model)
    W = head.weight[: head.vocab_size].float()
    H = hidden_states(model, 2 * positions, "cpu").float()
    fit, test = H[:positions], H[positions:]
    _, vecs = torch.linalg.eigh(fit.T @ fit)
    R = vecs.flip(1)  # principal directions of the fitted half, largest first
    Ht, Wt = test @ R, W @ R
    d = W.shape[1]
    return {"V": W.shape[0], "d": d, "positions": int(test.shape[0]), "top_cosine": top_cosine(test, W),
            "survivors": {f: survivors(test, W, int(f * d)) for f in FRACTIONS},
            "principal_basis": {f: {"tail_norm_share": (Ht[:, int(f * d):].norm(dim=1) / Ht.norm(dim=1)).median().item(),
                                    "survivors": survivors(Ht, Wt, int(f * d))} for f in FRACTIONS}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a Hugging Face model directory (learned head)")
    ap.add_argument("--positions", type=int, default=1024, help="held-out positions fitted, and as many measured")
    ap.add_argument("--shape", default="16384x1024", help="VxD of the peaked random head")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    V, d = (int(x) for x in a.shape.split("x"))
    out = {"machine": machine(), "peaked_random": peaked(V, d, a.rows)}
    if a.model is not None:
        out["learned"] = {"model": a.model.name, **learned(a.model, a.positions)}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    from record import record_run  # one row a measurement in benchmarks/results/results.csv
    record_run("tail_bound", out, source=a.json)
    for name in ("peaked_random", "learned"):
        if name in out:
            r = out[name]
            print(f"{name}: top cosine {r['top_cosine']:.3f}; survivors by k/d: "
                  + ", ".join(f"{f:g}: {s:.4f}" for f, s in r["survivors"].items()))
    if "learned" in out:
        print("learned, principal basis (tail norm share, survivors): " + ", ".join(
            f"{f:g}: {v['tail_norm_share']:.3f} / {v['survivors']:.4f}" for f, v in out["learned"]["principal_basis"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
