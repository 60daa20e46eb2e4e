"""The V2 runner's sampler step on a GPU, dense vs certified, for plain temperature sampling.

* dense: the bf16 head (``F.linear``, cuBLAS) on the whole batch, then vLLM's V2
  ``gumbel_sample`` (temperature in its kernel);
* CSV: :func:`vllm_csv.sampling.rows_v2.certify_rows_v2` (screen, temperature bounds, draw
  certificate, exact scoring of the contenders), its rows written as the V2 hook writes them
  (the dense head for the rows it leaves), then the same ``gumbel_sample``.

vLLM's kernels come from the installed vLLM or from ``VLLM_V2_GUMBEL_PY`` (a copy of
``vllm/v1/worker/gpu/sample/gumbel.py``, vLLM 0.32.0: the GPU machines here have no vLLM) or
``VLLM_V2_SAMPLE_DIR`` (:func:`vllm_csv.testing.vllm_v2.load_vllm_v2_sample`). The
head's weights are random (peaked rows), so the certified share says little about a learned
model; the point is the step's time. Both paths draw the same tokens (checked every step).
Timings: CUDA events around each whole step, median over ``--repeats``.

Usage: python benchmarks/v2_sampler_gpu.py [--vocab V] [--hidden D] [--batches 1 8 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from vllm_csv.testing.vllm_v2 import load_vllm_v2_gumbel


def main() -> None:
    from vllm_csv import CertifiedHead, HeadConfig
    from vllm_csv.sampling.head_adapter import HeadAdapter
    from vllm_csv.sampling.rows_v2 import certify_rows_v2
    from vllm_csv.testing.heads import hidden_near_rows, peaked_head
    from vllm_csv.testing.threads import use_test_threads

    use_test_threads()  # (as importing the tests' conftest, which set them, used to)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--screen", default="int8")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    v2 = load_vllm_v2_gumbel()
    if v2 is None or not torch.cuda.is_available():
        sys.exit("needs CUDA and vLLM's V2 gumbel.py (vLLM installed, or VLLM_V2_GUMBEL_PY)")
    W, g = peaked_head(a.vocab, a.hidden, seed=3)
    Wc = W.to("cuda", torch.bfloat16)
    head = CertifiedHead(Wc, config=HeadConfig(screen=a.screen, off_switch=False))
    adapter = HeadAdapter(head)
    rows_out = []
    for B in a.batches:
        h = hidden_near_rows(W.bfloat16(), B, g, scale=2.0).cuda()
        seeds = torch.randint(-2**62, 2**62, (B,), generator=g).cuda()
        pos = torch.randint(0, 2**20, (B,), generator=g).cuda()
        temp = torch.full((B,), 0.7, device="cuda")
        idx = torch.arange(B, dtype=torch.int32, device="cuda")

        def dense():
            return v2.gumbel_sample(head.dense_logits(h), idx, temp, seeds, pos, apply_temperature=True,
                                    is_drafting=False)

        def csv():
            res = certify_rows_v2(adapter, h, seeds, pos, temp)
            logits = res.values.to(head.dtype)
            if not bool(res.certified.all()):
                logits[~res.certified] = head.dense_logits(h)[~res.certified]
            return v2.gumbel_sample(logits, idx, temp, seeds, pos, apply_temperature=True, is_drafting=False), res

        times = {"dense": [], "csv": []}
        cert = 0
        for r in range(a.repeats + 2):
            for name in ("dense", "csv"):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = dense() if name == "dense" else csv()
                e.record()
                torch.cuda.synchronize()
                if r >= 2:
                    times[name].append(s.elapsed_time(e))
                if name == "dense":
                    want = out
                else:
                    got, res = out
                    assert torch.equal(got, want), "CSV drew another token than dense"
                    cert += int(res.certified.sum()) if r >= 2 else 0
        d, c = statistics.median(times["dense"]), statistics.median(times["csv"])
        row = {"batch": B, "dense_ms": d, "csv_ms": c, "speedup": d / c, "certified_share": cert / (B * a.repeats)}
        rows_out.append(row)
        print(f"B={B}: dense {d:.3f} ms, CSV {c:.3f} ms ({d / c:.2f}x), certified {row['certified_share']:.1%}")
    if a.json:
        report = {
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "vocab": a.vocab, "hidden": a.hidden, "screen": a.screen, "temperature": 0.7,
            "command": " ".join(sys.argv), "rows": rows_out}
        Path(a.json).write_text(json.dumps(report, indent=1))
        from record import record_run  # one row a measurement in benchmarks/results/results.csv
        record_run("v2_sampler_gpu", report, source=a.json)


if __name__ == "__main__":
    main()
