"""The screens' GEMM kernels with and without their software prefetch, interleaved in one process.

    python benchmarks/prefetch_cpu.py --shapes 151936x1024 128256x2048 --batches 1 2 4 8 16 \\
        --threads 2 --json benchmarks/results/prefetch_cpu.json

The int8 kernel (:class:`vllm_csv.ops.int8_vnni.VnniInt8Linear`: VNNI below
``int8_vnni.AMX_FROM`` rows, AMX from there where the CPU has it) and the int4 one
(:class:`vllm_csv.ops.int4_vnni.VnniInt4Linear`) read their weight ``ops.build.PREFETCH`` bytes
ahead of the stream on Intel CPUs (``csrc/cpu/int8_vnni.cpp``, ``prefetch_ahead``). For each shape
and batch, each kernel runs ``--repeats`` times with that distance and with none
(``set_prefetch_ahead``), one call after the other, so both see the same machine; the table
reports medians and minima (ms) and checks that the outputs are equal bit for bit (a prefetch
is a hint: it changes no result). Random weights (speed does not depend on the values), 7-bit
activations laid out as the screens lay them out (``act7_layout``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from provenance import machine
from timing import call_ms
from vllm_csv.ops import build, int4_vnni, int8_vnni
from vllm_csv.ops.fbgemm import act7_layout


def run(shapes, batches, repeats: int, distance: int) -> list[dict]:
    ops = build.load_ops()
    rows = []
    for V, d in shapes:
        g = torch.Generator().manual_seed(V + d)
        w = torch.randn(V, d, generator=g)
        q8 = torch.randint(-127, 128, (V, d), dtype=torch.int8, generator=g)
        kernels = {"int8": int8_vnni.VnniInt8Linear(q8, torch.rand(V, generator=g) * 1e-2 + 1e-3),
                   "int4": int4_vnni.VnniInt4Linear(*int4_vnni.quantize_int4(w))}
        for B in batches:
            x = act7_layout(torch.randint(-64, 64, (B, d), generator=g).float(), 2.0**-7)
            for name, k in kernels.items():
                times: dict[int, list[float]] = {distance: [], 0: []}
                out = {}
                for _ in range(repeats):
                    for pf in times:
                        ops.set_prefetch_ahead(pf)
                        times[pf].append(call_ms(lambda: out.__setitem__(pf, k.linear(x))))
                ops.set_prefetch_ahead(distance)
                row = {"V": V, "d": d, "B": B, "kernel": name,
                       "backend": k.backend if name == "int4" else k.kernel_for(B),
                       "bit_identical": torch.equal(out[distance], out[0])}
                for pf, key in ((distance, "prefetch"), (0, "none")):
                    row[key + "_ms"], row[key + "_min_ms"] = statistics.median(times[pf]), min(times[pf])
                rows.append(row)
                print(f"{V}x{d} B={B} {name} ({row['backend']}): prefetch {row['prefetch_ms']:.2f} "
                      f"(min {row['prefetch_min_ms']:.2f}), none {row['none_ms']:.2f} (min {row['none_min_ms']:.2f}) "
                      f"ms, identical {row['bit_identical']}", flush=True)
    return rows


def markdown(meta: dict, distance: int, rows: list[dict]) -> str:
    out = [f"Machine: {meta['cpu']} ({', '.join(meta['cpu_flags'])}), {meta['threads']} threads, torch "
           f"{meta['torch']}; commit {meta['commit']}; load average {meta['loadavg_start']} at start, "
           f"{meta.get('loadavg_end')} at the end. Prefetch distance {distance} bytes.", "",
           "| V x d | B | kernel | prefetch ms (min) | none ms (min) | none / prefetch (medians) | identical |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['V']} x {r['d']} | {r['B']} | {r['kernel']} ({r['backend']}) | {r['prefetch_ms']:.2f} "
                   f"({r['prefetch_min_ms']:.2f}) | {r['none_ms']:.2f} ({r['none_min_ms']:.2f}) | "
                   f"{r['none_ms'] / r['prefetch_ms']:.2f}x | {r['bit_identical']} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["151936x1024", "128256x2048"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    why = int8_vnni.unavailable_reason(8, 8) or int4_vnni.unavailable_reason()
    if why is not None:
        sys.exit(f"prefetch_cpu.py: the screens' kernels cannot run here ({why})")
    # the distance the kernels use on Intel CPUs (elsewhere they do not prefetch: compared at it too)
    distance = build.PREFETCH
    build.load_ops().set_prefetch_ahead(distance)
    torch.set_num_threads(a.threads)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes]
    meta = machine()
    rows = run(shapes, a.batches, a.repeats, distance)
    meta["loadavg_end"] = list(os.getloadavg())
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": meta, "prefetch_bytes": distance, "rows": rows}, indent=1))
    from record import record_run  # one row a measurement in benchmarks/results/results.csv
    record_run("prefetch_cpu", {"machine": meta, "prefetch_bytes": distance, "rows": rows}, source=out)
    out.with_suffix(".md").write_text(markdown(meta, distance, rows))


if __name__ == "__main__":
    main()
