"""Tabulate ``benchmarks/gpu_step.py`` JSON: per (V x d, B) the dense head, the one-byte GEMM
ceiling, the fused step and its ratio to dense, against issue 44's targets and the ratio of
vLLM main's ``ScreenedLMHead`` measured on the same kind of card (a re-typed copy of its kernels,
H100, as issue 44 records them).

    python benchmarks/gpu_table.py benchmarks/results/gpu/gpu_step_h100_428b54f.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

# issue 44: targets (ratio to the cuBLAS bf16 head + argmax, both graph-replayed) and the upstream
# screened head's ratios on an H100, per shape and B = 1, 8, 32, 64
TARGETS = {(151936, 1024): (1.45, 1.45, 1.3, 1.25)}
TARGET_OTHERS = (1.6, 1.6, 1.4, 1.3)
UPSTREAM = {(151936, 1024): (1.15, 1.13, 0.79, 0.50), (128256, 2048): (1.35, 1.33, 0.87, 0.55),
            (128256, 4096): (1.54, 1.46, 0.93, 0.58), (262144, 2560): (1.55, 1.48, 0.92, 0.57)}
BATCHES = (1, 8, 32, 64)


def table(rows: list[dict]) -> str:
    by = defaultdict(dict)
    for r in rows:
        if "ms" in r:
            by[(r["V"], r["d"], r["B"])][r["measure"]] = r
    first = next(iter(rows))
    out = [f"{first['device']}, torch {first['torch']}, CUDA {first['cuda']}, Triton {first['triton']}, "
           f"commit {first['commit']}, {first['dtype']}; us per step, CUDA-graph replayed",
           "",
           "| V x d | B | dense us | int8 GEMM us (ceiling) | screen us | step us | fixed us | step / dense "
           "| target | upstream | certified | mismatches |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (V, d, B), m in sorted(by.items()):
        i = BATCHES.index(B) if B in BATCHES else None
        tgt = TARGETS.get((V, d), TARGET_OTHERS)[i] if i is not None else None
        up = UPSTREAM.get((V, d), (None,) * 4)[i] if i is not None else None
        dense, step = m["dense"]["ms"], m["step"]["ms"]
        ratio = dense / step
        ok = "" if tgt is None else (" (met)" if ratio >= tgt else " (**missed**)")
        out.append(f"| {V} x {d} | {B} | {dense * 1e3:.1f} | {m['int8_gemm']['ms'] * 1e3:.1f} "
                   f"({dense / m['int8_gemm']['ms']:.2f}x) | {m['screen']['ms'] * 1e3:.1f} | {step * 1e3:.1f} | "
                   f"{(step - m['screen']['ms']) * 1e3:.1f} | **{ratio:.2f}x**{ok} | {tgt or '-'} | {up or '-'} | "
                   f"{m['step']['certified']}/{m['step']['rows']} | {m['step']['mismatches']} |")
    audit = [r for r in rows if r["measure"].startswith("audit_")]
    if audit:
        out += ["", "| audit family | rows | certified | mismatches |", "|---|---|---|---|"]
        out += [f"| {r['measure'][6:]} | {r['rows']} | {r['certified']} | {r['mismatches']} |" for r in audit]
    kernels = [(k, r) for k, ms in sorted(by.items()) for n, r in sorted(ms.items()) if n.startswith("k_")]
    if kernels:
        out += ["", "| V x d | B | kernel alone (graph of one kernel) | us |", "|---|---|---|---|"]
        out += [f"| {V} x {d} | {B} | {r['measure']} | {r['ms'] * 1e3:.1f} |" for (V, d, B), r in kernels]
    return "\n".join(out)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(table(json.load(open(path))))
        print()
