"""Serving benchmark: plain `vllm serve` against `vllm serve --enable-csv-decode`, in one run.

    python benchmarks/serve.py --json results/serve.json            # the embedded demo model
    python benchmarks/serve.py --model /path/to/hf-model --json out.json

Starts each server in turn on the same model (never both busy at once: they would share the
CPU; with ``--interleave`` both are up and take turns, round by round), sends the same requests
(batched prompts; greedy and seeded top-k sampling, which CSV certifies, and top-p sampling),
and reports generated tokens per second, whether the outputs are identical, and, for CSV, what
its own metrics on `/metrics` say: rows on the CSV path, certified share, fallbacks by reason,
head time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from pathlib import Path

from provenance import commit, machine as provenance  # (benchmarks/provenance.py)
from vllm_csv.testing.serve_bench import PROMPTS, combine, markdown, run_interleaved, run_server, summary

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the demo model)")
    p.add_argument("--rounds", type=int, default=3, help="batched requests per workload")
    p.add_argument("--prompts", type=int, default=len(PROMPTS),
                   help=f"prompts per batched request, i.e. sequences decoded together (1 to {len(PROMPTS)})")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--port", type=int, default=8110)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--screen", default=None, help="--csv-screen for the CSV server (default: the plugin's auto)")
    p.add_argument("--no-off-switch", action="store_true",
                   help="keep CSV on even where it is slower (to measure the certified share)")
    p.add_argument("--mixed", action="store_true",
                   help="add the concurrent workloads: mixed (greedy, temperature, top-k, top-p, min-p, "
                        "penalties, logit_bias at once) and greedy_beside (greedy, temperature, top-k at once)")
    p.add_argument("--workloads", nargs="*", default=None, help="run only these workloads (names as in the table)")
    p.add_argument("--pairs", type=int, default=1,
                   help="dense/CSV server pairs, run in ABBA order (dense first, then CSV first, ...); the "
                        "speed-up is the median of the pairs' (server start-up scatter is several percent)")
    p.add_argument("--interleave", action="store_true",
                   help="both servers up at once, each workload's rounds alternating between them (ABBA); "
                        "the speed-up is the median of the rounds' ratios (drift between runs cancels)")
    p.add_argument("--pause", type=float, default=1.0, help="--interleave: seconds of rest before each turn")
    p.add_argument("--warmup-rounds", type=int, default=0,
                   help="--interleave: untimed rounds of each workload on each server first, left out of the "
                        "speed-up and of CSV's counts (the whole run's certified share is reported beside)")
    p.add_argument("--per-turn", type=int, default=1,
                   help="--interleave: batched requests a server's turn (longer turns: less scheduling jitter)")
    p.add_argument("--same-malloc", action="store_true",
                   help="run both servers with the allocator thresholds the CSV head sets in its worker "
                        "(vllm_csv/cpu_malloc.py), so that the ratio is CSV's alone")
    p.add_argument("--same-metrics", action="store_true",
                   help="run both servers with prometheus-client's multiprocess mode, which CSV turns on for "
                        "its worker metrics (vLLM's own metrics then go through files too)")
    p.add_argument("--control", action="store_true",
                   help="A/A control: the CSV side is a second plain `vllm serve`, so the ratios measure two "
                        "identical servers' difference, the noise floor of the comparison (with --interleave)")
    p.add_argument("--csv-first", action="store_true",
                   help="--interleave: start the CSV server first, on --port (the dense one then on --port + 1); "
                        "with --control, whether the order of two identical servers matters")
    p.add_argument("--dense-args", default=None,
                   help="`vllm serve` arguments of the dense server instead of the trailing ones (one string, "
                        "shell-split; '' for none): e.g. speculative decoding with CSV against plain dense decoding")
    p.add_argument("--dense-plugin", action="store_true",
                   help="the dense server loads this plugin too, with CSV off (by default it is vLLM alone: "
                        "VLLM_PLUGINS without the plugin, so the baseline is vLLM's own and whatever the plugin "
                        "costs a server while off is charged to CSV); with it, the ratio leaves that cost out")
    p.add_argument("--json", required=True)
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="further `vllm serve` arguments (after --)")
    args = p.parse_args(argv)
    args.vllm_args = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    args.dense_args = None if args.dense_args is None else shlex.split(args.dense_args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from vllm_csv.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    if args.pairs < 1:
        p.error("--pairs must be >= 1")
    pairs = []
    if args.warmup_rounds and not args.interleave:
        p.error("--warmup-rounds needs --interleave")
    if args.interleave:
        if args.pairs != 1:
            p.error("--interleave runs one pair of servers")
        args.pair = 0
        pairs.append(run_interleaved(args.model, args))
    for i in range(0 if args.interleave else args.pairs):
        args.pair = i  # (names the server logs)
        order = (False, True) if i % 2 == 0 else (True, False)
        runs = {csv: run_server(args.model, csv, args) for csv in order}
        pairs.append(summary(runs[False], runs[True]))
        print(f"pair {i + 1}/{args.pairs}: " + ", ".join(
            f"{k} {w['speedup']}x" for k, w in pairs[-1]["workloads"].items()), file=sys.stderr)
    s = pairs[0] if args.pairs == 1 else combine(pairs)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    report = {"machine": machine, "model": args.model, "prompts": args.prompts, "commit": commit(), "provenance": provenance(), "vllm_args": args.vllm_args, "dense_args": args.dense_args, "dense_plugin": args.dense_plugin, "same_malloc": args.same_malloc, "same_metrics": args.same_metrics, "interleave": args.interleave, "control": args.control, "csv_first": args.csv_first, **s}
    Path(args.json).write_text(json.dumps(report, indent=1))
    from record import record_run  # one row a measurement in benchmarks/results/results.csv
    record_run("serve", report, source=args.json)
    md = markdown(s, machine, Path(args.model).name)
    if args.control:
        md = ("A/A control (`--control`): both servers are plain `vllm serve` ("
              + ("both with the plugin loaded, CSV off" if args.dense_plugin else "neither loads the plugin")
              + "); the CSV column is the second one.\n\n" + md)
    elif not args.dense_plugin:
        md = "The dense server is vLLM without this plugin (VLLM_PLUGINS); the CSV one loads it.\n\n" + md
    Path(args.json).with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
