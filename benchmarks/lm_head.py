"""LM-head benchmark: every screen against the dense head, in one run, on real hidden states.

    python benchmarks/lm_head.py --fixtures 256 512 1024 --json results/lm_head.json
    python benchmarks/lm_head.py --model /path/to/hf-model --json out.json

For each model it collects hidden states (after the final norm, what the head sees) by
running the model over held-out text, then for each screen and batch size reports the
share of the vocabulary scored exactly (mean, p50, p90), the certification and fallback
rates, mismatches against the dense argmax of the same batch (0, or exact dense ties), and the step time of
``CertifiedHead.sampler_logits`` against ``F.linear(h, W)`` measured in the same run.
Writes JSON, a markdown table and a PNG plot. Timings are medians of repeated runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_csv import CertifiedHead, HeadConfig, build_index  # noqa: E402
from vllm_csv.hf_head import load_lm_head  # noqa: E402


def machine(device: str) -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    out = {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__, "device": device}
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    return out


def held_out_text(limit_chars: int = 400_000) -> str:
    """Stdlib files the fixtures' training corpus does not reach (it takes the sorted head)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[-60:]
    return "\n".join(f.read_text(errors="replace") for f in files)[:limit_chars]


@torch.no_grad()
def hidden_states(model_dir: Path, positions: int, device: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(held_out_text(), return_tensors="pt").input_ids[0]
    grabbed: list[torch.Tensor] = []
    norm = model.get_decoder().norm  # Llama/Qwen/Gemma: the final norm feeds the head
    hook = norm.register_forward_hook(lambda m, i, o: grabbed.append(o[0].detach()))
    n = 0
    for s in range(0, len(ids), 512):
        model(input_ids=ids[s : s + 512][None].to(device))
        n += min(512, len(ids) - s)
        if n >= positions:
            break
    hook.remove()
    return torch.cat(grabbed)[:positions]


def median_ms(fn, sync, repeats: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_model(model_dir: Path, screens, batches, positions, repeats, device, dtype=None) -> dict:
    head_w = load_lm_head(model_dir)
    dtype = dtype or head_w.weight.dtype
    W = head_w.weight[: head_w.vocab_size].to(device, dtype)
    b = None if head_w.bias is None else head_w.bias[: head_w.vocab_size].to(device, dtype)
    H = hidden_states(model_dir, positions, device).to(W.dtype)
    V, d = W.shape
    sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)
    out = {"V": V, "d": d, "dtype": str(dtype).removeprefix("torch."), "positions": int(H.shape[0]),
           "screens": {}}
    for screen in screens:
        t0 = time.perf_counter()
        index = build_index(W.float().cpu(), None if b is None else b.float().cpu(),
                            progress=False) if screen == "ball" else None
        cfg = HeadConfig(screen=screen, budget=1.0, off_switch=False)
        head = CertifiedHead(W, b, config=cfg, index=index, softcap=head_w.softcap, scale=head_w.scale)
        prep_s = time.perf_counter() - t0
        res = {"prepare_seconds": round(prep_s, 2), "extra_bytes": int(head.screen.extra_bytes)}
        for B in batches:
            scored, cert, mismatches, ties = [], [], 0, 0
            for s in range(0, H.shape[0] - B + 1, B):
                r = head.topk(H[s : s + B], 1)
                scored += (r.scored.float() / V).tolist()
                cert += r.certified.tolist()
                # against the dense head on the same batch (GEMM rounding depends on the shape)
                dz = head.dense_logits(H[s : s + B]).float()
                best = torch.sort(dz, dim=1, descending=True, stable=True)
                diff = r.ids[:, 0] != best.indices[:, 0]
                mismatches += int(diff.sum())
                ties += int((diff & (dz.gather(1, r.ids[:, :1])[:, 0] == best.values[:, 0])).sum())
            hb = H[:B]
            ones = torch.ones(B, dtype=torch.long)
            csv_ms = median_ms(lambda: head.sampler_logits(hb, ones), sync, repeats)
            dense_ms = median_ms(lambda: F.linear(hb, W, b), sync, repeats)
            st = torch.tensor(scored)
            res[str(B)] = {
                "scored_fraction_mean": float(st.mean()), "scored_fraction_p50": float(st.quantile(0.5)),
                "scored_fraction_p90": float(st.quantile(0.9)), "certified_rate": sum(cert) / len(cert),
                "fallback_rate": 1 - sum(cert) / len(cert), "mismatches": mismatches, "mismatches_at_exact_ties": ties,
                "rows": len(cert),
                "csv_ms": round(csv_ms, 3), "dense_ms": round(dense_ms, 3),
                "speedup_vs_dense": round(dense_ms / csv_ms, 3)}
            print(f"  {model_dir.name} {screen:5s} B={B:3d}: scored p50 {st.quantile(0.5):.5f} "
                  f"cert {sum(cert) / len(cert):.3f} mismatches {mismatches} (ties {ties}) csv {csv_ms:.2f} ms "
                  f"dense {dense_ms:.2f} ms x{dense_ms / csv_ms:.2f}", file=sys.stderr)
        out["screens"][screen] = res
    return out


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [f"Machine: {m['cpu']} ({m['threads']} threads), torch {m['torch']}, device {m['device']}"
             + (f" ({m['gpu']})" if "gpu" in m else ""), "",
             "| model | V | d | dtype | screen | batch | scored p50 | scored mean | scored p90 | certified | "
             "mismatches | CSV ms | dense ms | speed-up |", "|" + "---|" * 14]
    for name, r in results["models"].items():
        for screen, s in r["screens"].items():
            for B, x in s.items():
                if not B.isdigit():
                    continue
                lines.append(f"| {name} | {r['V']} | {r['d']} | {r.get('dtype', '')} | {screen} | {B} | {x['scored_fraction_p50']:.4%} | "
                             f"{x['scored_fraction_mean']:.4%} | {x['scored_fraction_p90']:.4%} | "
                             f"{x['certified_rate']:.1%} | {x['mismatches']} | {x['csv_ms']} | {x['dense_ms']} | "
                             f"{x['speedup_vs_dense']}x |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results["models"].items():
        for screen, s in r["screens"].items():
            bs = sorted(int(b) for b in s if b.isdigit())
            a1.plot(bs, [s[str(b)]["speedup_vs_dense"] for b in bs], marker="o", label=f"{name} {screen}")
            a2.plot(bs, [s[str(b)]["scored_fraction_mean"] for b in bs], marker="o", label=f"{name} {screen}")
    a1.axhline(1.0, color="gray", lw=0.8)
    a1.set(xlabel="batch", ylabel="speed-up vs dense head", xscale="log")
    a2.set(xlabel="batch", ylabel="share of V scored (mean)", xscale="log", yscale="log")
    a1.legend(fontsize=7)
    fig.suptitle(f"vllm-csv LM head, {results['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], help="Hugging Face model directory (repeatable)")
    p.add_argument("--fixtures", type=int, nargs="*", default=None, help="hidden sizes of learned fixtures to build/use")
    p.add_argument("--screens", nargs="+", default=["int8", "int4", "fp16", "ball"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--positions", type=int, default=1024, help="held-out positions per model")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="head dtype (default: as stored in the model)")
    p.add_argument("--json", required=True, help="output JSON path (markdown and PNG go beside it)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = [Path(m) for m in args.model]
    if args.fixtures:
        from fixtures import fixture

        models += [fixture(h, device=args.device) for h in args.fixtures]
    if not models:
        p.error("give --model DIR and/or --fixtures HIDDEN ...")
    results = {"machine": machine(args.device), "models": {}}
    for m in models:
        results["models"][m.name] = bench_model(m, args.screens, args.batches, args.positions, args.repeats,
                                                args.device, getattr(torch, args.dtype) if args.dtype else None)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    md = markdown(results)
    out.with_suffix(".md").write_text(md)
    try:
        plot(results, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
