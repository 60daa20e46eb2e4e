"""The int4 screen's GEMM against the int8 screen's, one row (the batch the ``auto`` screen gives
the int4 copy: :mod:`vllm_csv.screens.by_batch`), on whatever kernels this CPU runs: each screen's
call as the candidate search consumes it, ``y`` and its block maxima (the int8 kernel takes them
in its pass; the int4 one is followed by the search's block-max pass).

    VLLM_CSV_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 \\
        python benchmarks/int4_int8_cpu.py --shapes 65536x768 151936x1024 --threads 1 2 \\
        --json benchmarks/results/int4_int8_cpu_avx2_emulated.json

Random weights (speed does not depend on them); medians and minima (ms) of ``--repeats``
interleaved calls. The GEMMs alone: the int4 one reads half the bytes, but bounds each logit
about ten times more loosely, so its step also scores more tokens exactly: a GEMM that is not
clearly faster here cannot win the step (by_batch's docstring has the step measurements).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from int8_gemm_cpu import run_and_write
from timing import call_ms
from vllm_csv.ops import build, int4_vnni, int8_vnni, select
from vllm_csv.ops.fbgemm import act7_layout


def run(shapes, batches, repeats: int, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    rows = []
    for V, d in shapes:
        g = torch.Generator().manual_seed(V + d)
        w = torch.randn(V, d, generator=g)
        q8 = torch.randint(-127, 128, (V, d), dtype=torch.int8, generator=g)
        i8 = int8_vnni.VnniInt8Linear(q8, torch.rand(V, generator=g) * 1e-2 + 1e-3)
        i4 = int4_vnni.VnniInt4Linear(*int4_vnni.quantize_int4(w))
        for B in batches:
            x = act7_layout(torch.randint(-64, 64, (B, d), generator=g).float(), 2.0**-7)
            t = {"int8": [], "int4": []}
            for _ in range(repeats):
                t["int8"].append(call_ms(lambda: i8.linear_block_max(x, build.BLOCK)))
                t["int4"].append(call_ms(lambda: select.block_max(i4.linear(x))))
            row = {"V": V, "d": d, "B": B, "threads": threads, "int8_kernel": i8.backend, "int4_kernel": i4.backend}
            for k, v in t.items():
                row[k + "_ms"], row[k + "_min_ms"] = statistics.median(v), min(v)
            rows.append(row)
            print(f"{V}x{d} B={B} {threads}t: int8 ({i8.backend}) {row['int8_ms']:.2f} (min {row['int8_min_ms']:.2f}) "
                  f"int4 ({i4.backend}) + block max {row['int4_ms']:.2f} (min {row['int4_min_ms']:.2f}) ms, "
                  f"int8 / int4 {row['int8_ms'] / row['int4_ms']:.2f}x", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["65536x768", "151936x1024"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeats", type=int, default=61)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    run_and_write(a, run)


if __name__ == "__main__":
    main()
