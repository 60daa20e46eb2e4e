"""Profile one ``CertifiedHead.sampler_logits`` step (torch.profiler), to see where time goes.

    python benchmarks/profile_head.py --vocab 32768 --hidden 4096 --batch 1 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse

import torch

from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.testing.heads import hidden_near_rows, peaked_head
from vllm_csv.testing.threads import use_test_threads

use_test_threads()  # (as importing the tests' conftest, which set them, used to)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--screen", default="int8")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=25, help="table rows")
    a = p.parse_args(argv)
    W, g = peaked_head(a.vocab, a.hidden, seed=0)
    h = hidden_near_rows(W, a.batch, g)
    dt = getattr(torch, a.dtype)
    W, h = W.to(a.device, dt), h.to(a.device, dt)
    head = CertifiedHead(W, config=HeadConfig(screen=a.screen, off_switch=False))
    k = torch.ones(a.batch, dtype=torch.long)
    for _ in range(5):
        head.sampler_logits(h, k)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(10):
            head.sampler_logits(h, k)
    key = "self_cuda_time_total" if a.device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=a.rows))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
