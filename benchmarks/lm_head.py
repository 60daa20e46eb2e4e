"""LM-head benchmark: every screen against the dense head, in one run, on real hidden states.

    python benchmarks/lm_head.py --fixtures 256 512 1024 --json results/lm_head.json
    python benchmarks/lm_head.py --model /path/to/hf-model --json out.json
    python benchmarks/lm_head.py --shapes 151936x1024 128256x2048 262144x1152 --dtype bfloat16 \
        --vllm-head --profile --json benchmarks/results/lm_head_cpu.json

For each model it collects hidden states (after the final norm, what the head sees) by
running the model over held-out text, then for each screen and batch size reports the
share of the vocabulary scored exactly (mean, p50, p90), the certification and fallback
rates, mismatches against the dense argmax of the same batch (0, or exact dense ties), and the step time of
``CertifiedHead.sampler_logits`` against the dense head measured in the same run.

Dense baselines: ``F.linear(h, W)`` always; with ``--vllm-head`` also vLLM's own head, a
``ParallelLMHead`` after its quant method's ``process_weights_after_loading`` (on CPU:
``dispatch_cpu_unquantized_gemm``, which picks oneDNN, sgl-kernel or ``F.linear``) called
through vLLM's ``LogitsProcessor``; the CSV step then uses it for its dense rows, as the plugin does.

``--shapes VxD``: heads of real models' sizes with *random* weights, for speed only. A random
head has no clear winner, so the hidden states are ``h = 6 sqrt(d) w_t + 0.3 noise`` (``t``
random, the "peaked head" of the tests): the top token stands out as on a learned head, and the
scored set is a few tokens, as measured on the learned fixtures (p50 0.01% of 32768, about 3
tokens). The scored count per row is reported beside each time; certification rates on these
synthetic rows mean nothing and are not reported. ``--profile`` splits the CSV step into the
screen's GEMM, the rest of the screen, exact scoring and the runtime's own passes.

Writes JSON, a markdown table and a PNG plot. Timings are medians (and minima) of repeated
runs, interleaved between the variants, on whatever else the machine is running (the JSON
records the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_csv import CertifiedHead, HeadConfig, build_index
from vllm_csv.screens import SCREENS
from vllm_csv.hf_head import load_lm_head
from vllm_csv.ops.fbgemm import act7_layout
from timing import median_ms, times_ms

from provenance import machine  # (benchmarks/provenance.py)


class VllmDenseHead:
    """vLLM's own dense LM head: ``ParallelLMHead`` + ``LogitsProcessor``, built the way the
    model loader builds them (weights loaded, then ``process_weights_after_loading``: on CPU
    ``dispatch_cpu_unquantized_gemm`` picks the GEMM) in a default ``VllmConfig`` with a
    one-process tensor-parallel group. ``dispatch`` names the GEMM it picked."""

    _initialised = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        self.config = VllmConfig()
        self._ctx = set_current_vllm_config
        with set_current_vllm_config(self.config):
            if not VllmDenseHead._initialised:
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
                initialize_model_parallel(1, 1)
                VllmDenseHead._initialised = True
            from vllm.model_executor.layers.logits_processor import LogitsProcessor
            from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

            V, d = weight.shape
            self.lm_head = ParallelLMHead(V, d, bias=bias is not None, params_dtype=weight.dtype)
            self.lm_head.weight_loader(self.lm_head.weight, weight)
            if bias is not None:
                self.lm_head.weight_loader(self.lm_head.bias, bias)
            self.lm_head.quant_method.process_weights_after_loading(self.lm_head)
            self.processor = LogitsProcessor(V)
        fn = getattr(self.lm_head, "cpu_linear", None)
        names = set(getattr(getattr(fn, "__code__", None), "co_names", ()))
        self.dispatch = next((n for n in ("onednn_mm", "weight_packed_linear_cpu", "zentorch_linear_unary", "linear")
                              if n in names), "unknown" if fn is not None else "device default")

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._ctx(self.config):
            return self.processor(self.lm_head, hidden)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def bench_model(model_dir: Path, screens, batches, positions, repeats, device, dtype=None, vllm_head=False) -> dict:
    head_w = load_lm_head(model_dir)
    dtype = dtype or head_w.weight.dtype
    W = head_w.weight[: head_w.vocab_size].to(device, dtype)
    b = None if head_w.bias is None else head_w.bias[: head_w.vocab_size].to(device, dtype)
    H = hidden_states(model_dir, positions, device).to(W.dtype)
    V, d = W.shape
    sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)
    out = {"V": V, "d": d, "dtype": str(dtype).removeprefix("torch."), "positions": int(H.shape[0]),
           "weights": "learned", "screens": {}}
    dense = _dense_baselines(W, b, vllm_head and device == "cpu", out)
    for screen in screens:
        t0 = time.perf_counter()
        index = build_index(W.float().cpu(), None if b is None else b.float().cpu(),
                            progress=False) if screen == "ball" else None
        cfg = HeadConfig(screen=screen, budget=1.0, off_switch=False)
        head = CertifiedHead(W, b, config=cfg, index=index, softcap=head_w.softcap, scale=head_w.scale)
        prep_s = time.perf_counter() - t0
        res = {"prepare_seconds": round(prep_s, 2), "extra_bytes": int(head.screen.extra_bytes),
               "backend": getattr(head.screen, "backend", type(head.screen).__name__)}
        for B in batches:
            scored, cert, mismatches, ties = [], [], 0, 0
            for s in range(0, H.shape[0] - B + 1, B):
                r = head.topk(H[s : s + B], 1, values=False)  # greedy: ids certified
                scored += (r.scored.float() / V).tolist()
                cert += r.certified.tolist()
                # against the dense head on the same batch (GEMM rounding depends on the shape)
                dz = head.dense_logits(H[s : s + B]).float()
                best = torch.sort(dz, dim=1, descending=True, stable=True)
                diff = r.ids[:, 0] != best.indices[:, 0]
                mismatches += int(diff.sum())
                ties += int((diff & (dz.gather(1, r.ids[:, :1])[:, 0] == best.values[:, 0])).sum())
            hbs = [H[s : s + B] for s in range(0, H.shape[0] - B + 1, B)][:TIMED_BATCHES]
            st = torch.tensor(scored)
            row = {
                "scored_fraction_mean": float(st.mean()), "scored_fraction_p50": float(st.quantile(0.5)),
                "scored_fraction_p90": float(st.quantile(0.9)), "certified_rate": sum(cert) / len(cert),
                "fallback_rate": 1 - sum(cert) / len(cert), "mismatches": mismatches, "mismatches_at_exact_ties": ties,
                "rows": len(cert)}
            row.update(_time_step(head, hbs, dense, sync, repeats))
            res[str(B)] = row
            print(f"  {model_dir.name} {screen:5s} B={B:3d}: scored p50 {st.quantile(0.5):.5f} "
                  f"cert {sum(cert) / len(cert):.3f} mismatches {mismatches} (ties {ties}) csv {row['csv_ms']:.2f} ms "
                  f"dense {row['dense_ms']:.2f} ms x{row['speedup_vs_dense']:.2f}", file=sys.stderr)
        out["screens"][screen] = res
    return out


def _dense_baselines(W, b, vllm_head: bool, out: dict) -> dict:
    """``{"F.linear": fn, "vllm": fn}``; the last one is the baseline of the speed-ups."""
    dense = {"F.linear": lambda h: F.linear(h, W, b)}
    if vllm_head:
        vh = VllmDenseHead(W, b)
        dense["vllm"] = vh
        out["vllm_dispatch"] = vh.dispatch
        h = torch.randn(3, W.shape[1], dtype=W.dtype)
        out["vllm_equals_F.linear"] = bool(torch.equal(vh(h), F.linear(h, W, b)))
    return dense


TIMED_BATCHES = 16  # distinct batches a timed sample steps through (learned heads: their scored sets differ)


def _time_step(head, hbs: list, dense: dict, sync, repeats: int) -> dict:
    """Median ms a step of each dense baseline and of the CSV step (``sampler_logits``, greedy
    rows, dense rows through the last baseline, as in the plugin). Each sample steps through the
    batches ``hbs`` once (one call each; the time per step is the pass's over ``len(hbs)``): on a
    learned head the scored set, and so the step's cost, differs from batch to batch, and one
    batch would time one point of that spread."""
    B = hbs[0].shape[0]
    ones = torch.ones(B, dtype=torch.long, device="cpu")
    base_name, base = list(dense.items())[-1]
    row = {}

    def each(f):
        return lambda: [f(hb) for hb in hbs]

    # Interleaved rounds, so that load from other processes hits every variant alike; the
    # minimum is reported beside the median (the least disturbed run on a shared machine).
    fns = {**{f"dense_ms_{n}": each(f) for n, f in dense.items()},
           "csv_ms": each(lambda hb: head.sampler_logits(hb, ones, base))}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(3):
        for k, f in fns.items():
            samples[k] += [t / len(hbs) for t in times_ms(f, max(1, repeats // 3), sync)]
    for k, v in samples.items():
        row[k] = round(statistics.median(v), 3)
        row[k.replace("_ms", "_min_ms")] = round(min(v), 3)
    row["dense_baseline"] = base_name
    row["dense_ms"] = row[f"dense_ms_{base_name}"]
    row["speedup_vs_dense"] = round(row["dense_ms"] / row["csv_ms"], 3)
    row["speedup_vs_dense_min"] = round(row[f"dense_min_ms_{base_name}"] / row["csv_min_ms"], 3)
    row["timed_batches"] = len(hbs)
    stats = [head.sampler_logits(hb, ones, base)[1] for hb in hbs]
    row["step_certified"], row["step_rows"] = sum(st.certified for st in stats), B * len(hbs)
    scored = [n for st in stats for n in st.scored]
    row["step_scored_per_row"] = statistics.mean(scored) if scored else None
    return row


def bench_shapes(shapes, screens, batches, repeats, dtype, vllm_head: bool, profile: bool) -> dict:
    """Speed on real models' head sizes, random weights (module docstring)."""
    from vllm_csv.testing.heads import hidden_near_rows, peaked_head

    out = {}
    for shape in shapes:
        V, d = map(int, shape.lower().split("x"))
        W, g = peaked_head(V, d, seed=0, dtype=dtype)
        H = hidden_near_rows(W, max(batches), g)
        res = {"V": V, "d": d, "dtype": str(dtype).removeprefix("torch."),
               "weights": "random (speed only), peaked hidden states", "screens": {}}
        dense = _dense_baselines(W, None, vllm_head, res)
        for screen in screens:
            t0 = time.perf_counter()
            head = CertifiedHead(W, config=HeadConfig(screen=screen, off_switch=False))
            s = {"prepare_seconds": round(time.perf_counter() - t0, 2), "extra_bytes": int(head.screen.extra_bytes),
                 "backend": getattr(head.screen, "backend", type(head.screen).__name__)}
            for B in batches:
                s[str(B)] = _time_step(head, [H[:B]], dense, lambda: None, repeats)
                if profile and screen == screens[0] and B in (1, 8):
                    s[str(B)]["profile"] = profile_step(head, H[:B], list(dense.values())[-1], repeats)
                x = s[str(B)]
                print(f"  {V}x{d} {screen} B={B}: csv {x['csv_ms']} ms, dense {x['dense_ms']} ms "
                      f"({x['dense_baseline']}) x{x['speedup_vs_dense']}, scored/row {x['step_scored_per_row']}",
                      file=sys.stderr)
            res["screens"][screen] = s
            del head
        out[f"random-{V}x{d}"] = res
        del W, dense
    return out


def profile_step(head, hb, dense_fn, repeats: int) -> dict:
    """Where the CSV step's time goes (median ms over ``repeats`` steps): the screen's GEMM
    alone (same shapes, FBGEMM screens only), the whole screen call, exact scoring
    (``CertifiedHead.score``), and the rest (the runtime's own passes over ``[B, V]``)."""
    B = hb.shape[0]
    ones = torch.ones(B, dtype=torch.long)
    parts: dict[str, list[float]] = {"screen": [], "score": []}

    def timed(name, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            r = fn(*a, **k)
            parts[name].append((time.perf_counter() - t0) * 1e3)
            return r
        return run

    screen_fn, score_fn = head.screen.center_radius, head.score
    head.screen.center_radius, head.score = timed("screen", screen_fn), timed("score", score_fn)
    try:
        head.sampler_logits(hb, ones, dense_fn)
        for v in parts.values():
            v.clear()
        steps = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            head.sampler_logits(hb, ones, dense_fn)
            steps.append((time.perf_counter() - t0) * 1e3)
    finally:
        head.screen.center_radius, head.score = screen_fn, score_fn
    out = {"step_ms": statistics.median(steps), "screen_ms": statistics.median(parts["screen"]),
           "score_ms": statistics.median(parts["score"]) if parts["score"] else 0.0}
    screen = head.screen.for_batch(B) if hasattr(head.screen, "for_batch") else head.screen  # (screens.by_batch)
    gemm = getattr(screen, "gemm", None)
    if gemm is not None:  # (the int8 and int4 GEMMs on the screens' activation layout)
        x = act7_layout(torch.zeros(B, head.hidden_size), 2.0**-7)
        out["screen_gemm_ms"] = median_ms(lambda: gemm.linear(x), repeats)
    out["rest_ms"] = out["step_ms"] - out["screen_ms"] - out["score_ms"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            head.sampler_logits(hb, ones, dense_fn)
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    out["top_ops_self_ms_per_step"] = {e.key: round(e.self_cpu_time_total / 1e3 / 5, 3) for e in top}
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [f"Machine: {m['cpu']} ({', '.join(m.get('cpu_flags', []))}), {m['threads']} threads, torch {m['torch']}"
             + (f", vLLM {m['vllm']}" if "vllm" in m else "") + f", device {m['device']}"
             + (f" ({m['gpu']})" if "gpu" in m else ""),
             f"Commit {m.get('commit', '?')}; load average {m.get('loadavg_start')} at start, "
             f"{m.get('loadavg_end')} at the end ({m.get('note', '')}).", ""]
    for name, r in results["models"].items():
        dense_note = f", vLLM head dispatch: {r['vllm_dispatch']}" if "vllm_dispatch" in r else ""
        lines += [f"### {name}: V={r['V']} d={r['d']} {r.get('dtype', '')}, {r.get('weights', '')}{dense_note}", "",
                  "| screen | backend | batch | scored p50 | scored p90 | certified | mismatches | CSV step ms | "
                  "dense ms (F.linear) | dense ms (vLLM) | speed-up vs dense | speed-up, min times | "
                  "scored/row (timed steps, mean) |",
                  "|" + "---|" * 13]
        for screen, s in r["screens"].items():
            for B, x in s.items():
                if not B.isdigit():
                    continue
                learned = "scored_fraction_p50" in x
                lines.append(
                    f"| {screen} | {s.get('backend', '')} | {B} | "
                    + (f"{x['scored_fraction_p50']:.4%} | {x['scored_fraction_p90']:.4%} | {x['certified_rate']:.1%} | "
                       f"{x['mismatches']} | " if learned else "n/a | n/a | n/a | n/a | ")
                    + f"{x['csv_ms']} (min {x.get('csv_min_ms')}) | {x.get('dense_ms_F.linear', '')} | "
                    f"{x.get('dense_ms_vllm', '')} (min {x.get('dense_min_ms_vllm', '')}) | "
                    f"{x['speedup_vs_dense']}x ({x['dense_baseline']}) | {x.get('speedup_vs_dense_min')}x | "
                    f"{x.get('step_scored_per_row')} |")
        prof = [(screen, B, x["profile"]) for screen, s in r["screens"].items() for B, x in s.items()
                if B.isdigit() and "profile" in x]
        if prof:
            lines += ["", "Where the CSV step's time goes (median ms):", "",
                      "| screen | batch | step | screen (all) | screen GEMM alone | exact scoring | rest of the runtime |",
                      "|---|---|---|---|---|---|---|"]
            for screen, B, p in prof:
                lines.append(f"| {screen} | {B} | {p['step_ms']} | {p['screen_ms']} | {p.get('screen_gemm_ms', '')} | "
                             f"{p['score_ms']} | {p['rest_ms']} |")
            for screen, B, p in prof:
                ops = ", ".join(f"{k} {v}" for k, v in p["top_ops_self_ms_per_step"].items())
                lines.append(f"\nTop ops by self CPU time per step ({screen}, B={B}, ms): {ops}")
        lines.append("")
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
            if all("scored_fraction_mean" in s[str(b)] for b in bs):  # learned heads only
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
    p.add_argument("--screens", nargs="+", default=["int8", "int4", "fp16", "ball"], choices=SCREENS)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--positions", type=int, default=1024, help="held-out positions per model")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="head dtype (default: as stored in the model; bfloat16 for --shapes)")
    p.add_argument("--shapes", nargs="*", default=[], metavar="VxD",
                   help="random heads of these sizes, for speed only (module docstring)")
    p.add_argument("--vllm-head", action="store_true",
                   help="also time vLLM's own dense head (ParallelLMHead + LogitsProcessor); the CSV step "
                        "uses it for dense rows and the speed-up is against it")
    p.add_argument("--profile", action="store_true", help="split the CSV step's time (--shapes, B=1 and 8)")
    p.add_argument("--json", required=True, help="output JSON path (markdown and PNG go beside it)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = [Path(m) for m in args.model]
    if args.fixtures:
        from vllm_csv.testing.fixtures import fixture

        models += [fixture(h, device=args.device) for h in args.fixtures]
    if not models and not args.shapes:
        p.error("give --model DIR, --fixtures HIDDEN ... and/or --shapes VxD ...")
    results = {"machine": machine(args.device), "command": " ".join(sys.argv), "models": {}}
    dtype = getattr(torch, args.dtype) if args.dtype else None
    for m in models:
        results["models"][m.name] = bench_model(m, args.screens, args.batches, args.positions, args.repeats,
                                                args.device, dtype, args.vllm_head)
    if args.shapes:
        results["models"].update(bench_shapes(args.shapes, args.screens, args.batches, args.repeats,
                                              dtype or torch.bfloat16, args.vllm_head, args.profile))
    results["machine"]["loadavg_end"] = os.getloadavg()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    from record import record_run  # one row a measurement in benchmarks/results/results.csv
    record_run("lm_head", results, source=out)
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
