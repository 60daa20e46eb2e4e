"""The int8 screen's GEMM on an x86 CPU: our AVX512-VNNI kernel against FBGEMM, same inputs, same bits.

    python benchmarks/int8_gemm_cpu.py --shapes 151936x1024 128256x2048 --batches 1 2 4 8 16 \\
        --threads 2 --json benchmarks/results/int8_gemm_cpu.json

Random int8 weights of each head shape (speed does not depend on the values), 7-bit activation
codes laid out as the screen lays them out (``act7_layout``). For each batch both GEMMs run
interleaved, ``--repeats`` times each; the table reports medians and minima (ms), and checks
that the two outputs are equal bit for bit. Also the VNNI kernel with the candidate search's
block maxima taken in the same pass (what the screen calls), and its rate in ``vpdpbusd`` a second
(``V d B / 64`` of them a call, at the median time): on a head that stays in the caches (e.g.
``8192x1024``) at eight rows, the kernel's compute ceiling on this CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from provenance import machine
from timing import call_ms
from vllm_csv.ops import build, int8_vnni
from vllm_csv.ops.fbgemm import PackedInt8Linear, act7_layout


def vpdpbusd(V: int, d: int, B: int) -> int:
    """``vpdpbusd`` instructions the VNNI kernel issues for ``[B, d] x [V, d]^T``: one per 16 rows x
    ``GROUP`` columns x batch row (rows padded to the layout's ``PANEL``, k to its ``GROUP``)."""
    return -(-V // build.PANEL) * (build.PANEL // 16) * -(-d // build.GROUP) * B


def run(shapes, batches, repeats: int) -> list[dict]:
    rows = []
    for V, d in shapes:
        g = torch.Generator().manual_seed(V + d)
        q = torch.randint(-127, 128, (V, d), dtype=torch.int8, generator=g)
        s = torch.rand(V, generator=g) * 1e-2 + 1e-3
        fb, vn = PackedInt8Linear(q, s), int8_vnni.VnniInt8Linear(q, s)
        for B in batches:
            x = act7_layout(torch.randint(-64, 64, (B, d), generator=g).float(), 2.0**-7)
            same = torch.equal(fb.linear(x), vn.linear(x))
            times = {"fbgemm": [], "vnni": [], "vnni_block_max": []}
            for _ in range(repeats):
                times["fbgemm"].append(call_ms(lambda: fb.linear(x)))
                times["vnni"].append(call_ms(lambda: vn.linear(x)))
                times["vnni_block_max"].append(call_ms(lambda: vn.linear_block_max(x, build.BLOCK)))
            row = {"V": V, "d": d, "B": B, "bit_identical": same}
            for k, v in times.items():
                row[k + "_ms"], row[k + "_min_ms"] = statistics.median(v), min(v)
            row["vnni_g_vpdpbusd_per_s"] = vpdpbusd(V, d, B) / row["vnni_ms"] / 1e6
            rows.append(row)
            print(f"{V}x{d} B={B}: fbgemm {row['fbgemm_ms']:.2f} (min {row['fbgemm_min_ms']:.2f}) "
                  f"vnni {row['vnni_ms']:.2f} (min {row['vnni_min_ms']:.2f}) "
                  f"vnni+block max {row['vnni_block_max_ms']:.2f} ms, "
                  f"{row['vnni_g_vpdpbusd_per_s']:.2f} G vpdpbusd/s, identical {same}", flush=True)
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    out = [f"Machine: {meta['cpu']} ({', '.join(meta['cpu_flags'])}), {meta['threads']} threads, torch "
           f"{meta['torch']}; commit {meta['commit']}; load average {meta['loadavg_start']} at start.", "",
           "| V x d | B | FBGEMM ms (min) | VNNI ms (min) | VNNI + block maxima ms (min) | FBGEMM / VNNI "
           "| VNNI G vpdpbusd/s | identical |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['V']} x {r['d']} | {r['B']} | {r['fbgemm_ms']:.2f} ({r['fbgemm_min_ms']:.2f}) | "
                   f"{r['vnni_ms']:.2f} ({r['vnni_min_ms']:.2f}) | {r['vnni_block_max_ms']:.2f} "
                   f"({r['vnni_block_max_min_ms']:.2f}) | {r['fbgemm_ms'] / r['vnni_ms']:.2f}x "
                   f"| {r['vnni_g_vpdpbusd_per_s']:.2f} | {r['bit_identical']} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["151936x1024", "128256x2048", "32768x512"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    why = int8_vnni.unavailable_reason(8, 8)
    if why is not None:
        sys.exit(f"int8_gemm_cpu.py: the VNNI kernel cannot run here ({why})")
    torch.set_num_threads(a.threads)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes]
    meta = machine()
    rows = run(shapes, a.batches, a.repeats)
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": meta, "rows": rows}, indent=1))
    from record import record_run  # one row a measurement in benchmarks/results/results.csv
    record_run("int8_gemm_cpu", {"machine": meta, "rows": rows}, source=out)
    out.with_suffix(".md").write_text(markdown(meta, rows))


if __name__ == "__main__":
    main()
