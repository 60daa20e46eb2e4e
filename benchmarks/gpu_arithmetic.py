"""The dense engine's arithmetic on a GPU (issue 42): what cuBLAS does under each setting that
selects it, and whether the certificate stays exact there.

    python benchmarks/gpu_arithmetic.py --json results/gpu_arithmetic.json [--device cuda]

Per setting (fp32 matmul precision highest / high / medium; bf16 and fp16 reduced-precision
reductions on / off):

* the engine probe (:func:`vllm_csv.dense_engine.probe_engine`) of ``F.linear`` at d = 1024,
  4096 and 8192, in the head's dtype: fp32 accumulation or not, FTZ, DAZ;
* the issue's TF32 case (fp32, ``[1 + 2^-12, ...]`` against ``[..., 1.0625, ...]``): the dense
  argmax and logits;
* cancelling heads at large ``d`` (rows whose products cancel to small logits, the case the
  reduced-precision split-K reduction could round): ``CertifiedHead.topk`` against the dense head
  of the same batch, ids (k = 1 and 4) and value bits, counted per setting.

Each row of the JSON names the device, torch and CUDA versions and the commit. On a CPU it runs
too (its settings are what torch's CPU path does with them).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.dense_engine import probe_engine


def settings(device: str):
    """(name, apply) for each arithmetic setting to try."""
    def precision(p):
        return lambda: torch.set_float32_matmul_precision(p)

    out = [(f"fp32-{p}", precision(p)) for p in ("highest", "high", "medium")]
    if device == "cuda":
        m = torch.backends.cuda.matmul
        for flag in ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction"):
            for on in (True, False):
                out.append((f"{flag}={on}", (lambda f, v: lambda: (torch.set_float32_matmul_precision("highest"),
                                                                      setattr(m, f, v)))(flag, on)))
    return out


def cancelling(V: int, d: int, B: int, dtype, device, seed: int):
    """Rows of ``+-a`` pairs (their sum a small remainder) and hidden states of ones, plus peaked
    rows: logits that a reduced-precision reduction of partial sums would move."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, d, generator=g) / d**0.5
    half = d // 2
    W[: V // 2, half: 2 * half] = -W[: V // 2, :half] * (1 + 2.0**-8 * torch.rand(V // 2, half, generator=g))
    h = torch.randn(B, d, generator=g)
    h[:, half: 2 * half] = h[:, :half]
    t = torch.randint(0, V, (B // 2,), generator=g)
    h[: B // 2] = 6 * W[t] * d**0.5 + 0.3 * torch.randn(B // 2, d, generator=g)
    return W.to(device, dtype), h.to(device, dtype)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--batches", type=int, default=8, help="batches of 64 rows per case")
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    dev = a.device
    prov = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "commit": os.environ.get("VLLM_CSV_COMMIT", "unknown")}
    rows = []
    for name, apply in settings(dev):
        apply()
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for d in a.hidden:
                pr = probe_engine(F.linear, dtype, d, dev)
                rows.append({**prov, "setting": name, "dtype": str(dtype)[6:], "d": d, "measure": "probe",
                             "fp32_accumulation": pr.fp32_accumulation, "ftz": pr.ftz, "daz": pr.daz,
                             "detail": pr.detail})
        d = 1024  # the TF32 case
        W = torch.ones(4, d, device=dev)
        W[0] += 2**-12
        W[1, 5] = 1.0625
        W[2:] *= -1
        z = F.linear(torch.ones(3, d, device=dev), W)
        rows.append({**prov, "setting": name, "measure": "tf32_case", "logits": z[0, :2].tolist(),
                     "argmax": int(z[0].argmax())})
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for d in a.hidden:
                tally = {"rows": 0, "certified_k1": 0, "wrong_k1": 0, "certified_k4": 0, "wrong_k4": 0}
                W, _ = cancelling(a.vocab, d, 64, dtype, dev, seed=d)
                head = CertifiedHead(W, config=HeadConfig(budget=1.0, off_switch=False))
                for i in range(a.batches):
                    _, h = cancelling(a.vocab, d, 64, dtype, dev, seed=1000 * d + i)
                    dense = F.linear(h, W).float()
                    dv, di = torch.sort(dense, dim=1, descending=True, stable=True)
                    r1 = head.topk(h, 1, values=False)
                    r4 = head.topk(h, 4, values=True)
                    tally["rows"] += 64
                    tally["certified_k1"] += int(r1.certified.sum())
                    tally["wrong_k1"] += int((r1.certified & (r1.ids[:, 0] != di[:, 0])).sum())
                    c4 = r4.certified
                    tally["certified_k4"] += int(c4.sum())
                    tally["wrong_k4"] += int((c4[:, None] & ((r4.ids != di[:, :4]) |
                                                           (r4.values.float() != dv[:, :4]))).any(1).sum())
                rows.append({**prov, "setting": name, "dtype": str(dtype)[6:], "d": d, "V": a.vocab,
                             "measure": "cancelling_heads", **tally})
                print(name, dtype, d, tally, flush=True)
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rows, indent=1))  # (after each setting: a timeout keeps what ran)
    torch.set_float32_matmul_precision("highest")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(rows, indent=1))
    wrong = sum(r.get("wrong_k1", 0) + r.get("wrong_k4", 0) for r in rows)
    print(f"wrong certified rows over every setting: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
