"""The int8 screen's GEMM on an x86 CPU: our kernel (AVX512-VNNI, or AVX2 where the CPU has no VNNI)
against FBGEMM, same inputs, same bits.

    python benchmarks/int8_gemm_cpu.py --shapes 151936x1024 128256x2048 --batches 1 2 4 8 16 \\
        --threads 2 --json benchmarks/results/int8_gemm_cpu.json

Our AVX2 kernel against FBGEMM's AVX2 kernels on an AVX-512 machine (emulation: AVX2 code on
this core, not an AVX2 machine's figure; the JSON records the caps):

    VLLM_CSV_CPU_ISA=avx2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        python benchmarks/int8_gemm_cpu.py --shapes 65536x768 151936x1024 --threads 1 2 --repeats 41 \\
        --json benchmarks/results/int8_gemm_cpu_avx2.json

Random int8 weights of each head shape (speed does not depend on the values), 7-bit activation
codes laid out as the screen lays them out (``act7_layout``). For each batch both GEMMs run
interleaved, ``--repeats`` times each; the table reports medians and minima (ms), and checks
that the two outputs are equal bit for bit. Also the VNNI kernel with the candidate search's
block maxima taken in the same pass (what the screen calls; ``kernel_block_max``), against
FBGEMM followed by the separate block-max pass the candidate search then makes over ``y``
(``fbgemm_block_max``: what the screen's call costs on FBGEMM), and the kernel's rate in ``vpdpbusd`` a second
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
from vllm_csv.ops import build, int8_vnni, select
from vllm_csv.ops.fbgemm import PackedInt8Linear, act7_layout


def vpdpbusd(V: int, d: int, B: int) -> int:
    """``vpdpbusd`` instructions the VNNI kernel issues for ``[B, d] x [V, d]^T``: one per 16 rows x
    ``GROUP`` columns x batch row (rows padded to the layout's ``PANEL``, k to its ``GROUP``)."""
    return -(-V // build.PANEL) * (build.PANEL // 16) * -(-d // build.GROUP) * B


def run(shapes, batches, repeats: int, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    rows = []
    for V, d in shapes:
        g = torch.Generator().manual_seed(V + d)
        q = torch.randint(-127, 128, (V, d), dtype=torch.int8, generator=g)
        s = torch.rand(V, generator=g) * 1e-2 + 1e-3
        fb, vn = PackedInt8Linear(q, s), int8_vnni.VnniInt8Linear(q, s)
        for B in batches:
            x = act7_layout(torch.randint(-64, 64, (B, d), generator=g).float(), 2.0**-7)
            same = torch.equal(fb.linear(x), vn.linear(x))
            y, bmax = vn.linear_block_max(x, build.BLOCK)
            same = same and torch.equal(bmax, select.block_max(fb.linear(x))) and torch.equal(y, fb.linear(x))
            times = {"fbgemm": [], "vnni": [], "vnni_block_max": [], "fbgemm_block_max": []}
            for _ in range(repeats):
                times["fbgemm"].append(call_ms(lambda: fb.linear(x)))
                times["vnni"].append(call_ms(lambda: vn.linear(x)))
                times["vnni_block_max"].append(call_ms(lambda: vn.linear_block_max(x, build.BLOCK)))
                times["fbgemm_block_max"].append(call_ms(lambda: select.block_max(fb.linear(x))))
            row = {"V": V, "d": d, "B": B, "threads": threads, "kernel": vn.backend, "bit_identical": same}
            for k, v in times.items():
                row[k + "_ms"], row[k + "_min_ms"] = statistics.median(v), min(v)
            row["vnni_g_vpdpbusd_per_s"] = vpdpbusd(V, d, B) / row["vnni_ms"] / 1e6
            rows.append(row)
            print(f"{V}x{d} B={B} {threads}t: fbgemm {row['fbgemm_ms']:.2f} (min {row['fbgemm_min_ms']:.2f}) "
                  f"{vn.backend} {row['vnni_ms']:.2f} (min {row['vnni_min_ms']:.2f}) "
                  f"{vn.backend}+block max {row['vnni_block_max_ms']:.2f}, "
                  f"fbgemm+block max {row['fbgemm_block_max_ms']:.2f} ms, "
                  f"{row['vnni_g_vpdpbusd_per_s']:.2f} G vpdpbusd/s, identical {same}", flush=True)
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    out = [f"Machine: {meta['cpu']} ({', '.join(meta['cpu_flags'])}), torch {meta['torch']}; commit "
           f"{meta['commit']}; load average {meta['loadavg_start']} at start. {meta['emulation']}", "",
           "| V x d | B | threads | kernel | FBGEMM ms (min) | kernel ms (min) | kernel + block maxima ms (min) "
           "| FBGEMM + block-max pass ms (min) | FBGEMM / kernel | screen call: FBGEMM / kernel | identical |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['V']} x {r['d']} | {r['B']} | {r['threads']} | {r['kernel']} "
                   f"| {r['fbgemm_ms']:.2f} ({r['fbgemm_min_ms']:.2f}) | "
                   f"{r['vnni_ms']:.2f} ({r['vnni_min_ms']:.2f}) | {r['vnni_block_max_ms']:.2f} "
                   f"({r['vnni_block_max_min_ms']:.2f}) | {r['fbgemm_block_max_ms']:.2f} ({r['fbgemm_block_max_min_ms']:.2f}) "
                   f"| {r['fbgemm_ms'] / r['vnni_ms']:.2f}x | {r['fbgemm_block_max_ms'] / r['vnni_block_max_ms']:.2f}x "
                   f"| {r['bit_identical']} |")
    return "\n".join(out) + "\n"


def emulation() -> str:
    """The ISA caps this ran under, in words ("" where none): with VLLM_CSV_CPU_ISA=avx2 on an AVX-512
    CPU, AVX2 code on this core, not an AVX2 machine's figure."""
    import os

    cap = build.isa_cap()
    if cap in (None, "auto"):
        return ""
    env = " ".join(f"{k}={os.environ[k]}" for k in (build.ISA_ENV, "FBGEMM_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")
                   if k in os.environ)
    return (f"Emulation ({env}): {cap} code paths on this CPU's cores, not an {cap.upper()} machine's figure "
            f"(other clocks, caches and memory there).")


def run_and_write(a, run) -> tuple[dict, list[dict], Path]:
    """``run(shapes, a.batches, a.repeats, threads)`` at each of ``a.threads`` (``a.shapes`` as
    ``VxD``), the machine (and :func:`emulation`) beside the rows, written to ``a.json``:
    ``(machine, rows, path)``."""
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes]
    meta = machine()
    meta["emulation"] = emulation()
    rows = [r for t in a.threads for r in run(shapes, a.batches, a.repeats, t)]
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": meta, "rows": rows}, indent=1))
    return meta, rows, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["151936x1024", "128256x2048", "32768x512"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--threads", nargs="+", type=int, default=[2])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    why = int8_vnni.unavailable_reason(8, 8)
    if why is not None:
        sys.exit(f"int8_gemm_cpu.py: the int8 kernel cannot run here ({why})")
    meta, rows, out = run_and_write(a, run)
    from record import record_run  # one row a measurement in benchmarks/results/results.csv
    record_run("int8_gemm_cpu", {"machine": meta, "rows": rows}, source=out)
    out.with_suffix(".md").write_text(markdown(meta, rows))


if __name__ == "__main__":
    main()
