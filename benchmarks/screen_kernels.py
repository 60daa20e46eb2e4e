"""Time the screen's building blocks against the dense bf16 head on a GPU (CUDA events, median).

    python benchmarks/screen_kernels.py --vocab 32768 128256 --hidden 4096

Columns: dense ``F.linear`` in bf16; the csrc fp32-accumulating int8 kernel
(``vllm_csv.ops.int8_screen``); the exact int8 GEMM (``vllm_csv.ops.int8_gemm``, cuBLASLt),
with and without quantising ``h``; and a whole ``CertifiedHead.sampler_logits`` step.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.ops import has_cuda_kernels, int8_gemm, int8_screen, pad_for_int_gemm
from vllm_csv.screens.quantized import quantize
from vllm_csv.testing.heads import hidden_near_rows, peaked_head
from vllm_csv.testing.threads import use_test_threads

use_test_threads()  # (as importing the tests' conftest, which set them, used to)


def cuda_ms(fn, repeats: int = 50) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 128256])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    a = p.parse_args(argv)
    print("| V | d | B | dense bf16 ms | csrc int8 ms | int8 GEMM ms | quantise h + GEMM ms | CSV step ms |")
    print("|---|---|---|---|---|---|---|---|")
    for V in a.vocab:
        for d in a.hidden:
            W, g = peaked_head(V, d, seed=0)
            Wc = W.to("cuda", torch.bfloat16)
            q, s = quantize(W, 8)
            q, s = q.cuda(), s.cuda()
            qp = pad_for_int_gemm(q)
            head = CertifiedHead(Wc, config=HeadConfig(off_switch=False))
            for B in a.batches:
                h = hidden_near_rows(W, B, g).to("cuda", torch.bfloat16)
                pi = torch.randint(-127, 128, (B, d), dtype=torch.int8, device="cuda")
                k = torch.ones(B, dtype=torch.long)
                dense = cuda_ms(lambda: torch.nn.functional.linear(h, Wc))
                csrc = cuda_ms(lambda: int8_screen(h, q, s)) if has_cuda_kernels() else float("nan")
                gemm = cuda_ms(lambda: int8_gemm(pi, qp, V))
                quant = cuda_ms(lambda: head.screen.center_radius(h))
                step = cuda_ms(lambda: head.sampler_logits(h, k), repeats=20)
                print(f"| {V} | {d} | {B} | {dense:.3f} | {csrc:.3f} | {gemm:.3f} | {quant:.3f} | {step:.3f} |",
                      flush=True)
            del W, Wc, q, qp, head
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
