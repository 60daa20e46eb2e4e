"""Load benchmark: concurrent clients mixing every sampling mode against a CSV server and a
plain vLLM server, one after the other (never both at once: they would share the CPU).

    python benchmarks/load.py --clients 64 --seconds 300 --json benchmarks/results/load.json
    python benchmarks/load.py --csv-url http://127.0.0.1:8001 --dense-url http://127.0.0.1:8000 ...

Without URLs it starts `vllm serve` itself on the model (default: the embedded demo model),
first plain, then with ``--enable-csv-decode``. Each client loops until the time is up over a
fixed, seeded schedule of requests (greedy, seeded temperature, top-k, top-p, min-p,
penalties, logit_bias; streaming and not; ``n > 1``; stop strings; short and long prompts).
Reports per server: requests, errors, generated tokens/s, TTFT and inter-token latency
percentiles (streaming requests), the server's resident memory (sampled every 10 s after a
warm-up at full load; its growth over the run and over its second half), and for CSV its
certified share from ``/metrics``. Deterministic requests (greedy or seeded)
that both servers answered are compared: the number that differ must be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from vllm_csv.testing.load_bench import compare, rss_growth, run_load, summarize

RSS_EVERY = 10.0  # seconds between RSS samples of the server


def server_rss_mb(pid: int) -> float:
    """Resident memory of a server process and its children (MB)."""
    import psutil

    p = psutil.Process(pid)
    return sum(x.memory_info().rss for x in [p, *p.children(recursive=True)]) / 2**20


def measure(url: str, pid: int | None, args) -> dict:
    """Warm up with every client for ``args.warmup`` seconds (the KV cache's pages and the
    allocators' pools fill up to the load's working set), then measure ``args.seconds``,
    sampling the server's RSS every ``RSS_EVERY`` seconds."""
    import threading

    asyncio.run(run_load(url, args.clients, args.warmup))
    series: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample():
        while True:
            series.append((round(time.perf_counter() - t0, 1), round(server_rss_mb(pid), 1)))
            if stop.wait(RSS_EVERY):
                return

    t0 = time.perf_counter()
    sampler = threading.Thread(target=sample, daemon=True) if pid else None
    if sampler:
        sampler.start()
    results = asyncio.run(run_load(url, args.clients, args.seconds))
    out = summarize(results, time.perf_counter() - t0)
    if sampler:
        stop.set()
        sampler.join()
        series.append((round(time.perf_counter() - t0, 1), round(server_rss_mb(pid), 1)))
        out.update(rss_growth(series))
    out["results"] = results
    return out


@contextlib.contextmanager
def started_server(args, csv: bool):
    """``vllm serve`` on ``args.model`` (plain, or with CSV): yields ``(base_url, pid)``."""
    from vllm_csv.serve import _vllm_command, wait_healthy, without_plugin

    port = args.port + int(csv)
    cmd = [*_vllm_command(), "serve", args.model, "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           "--max-model-len", "1024", *(["--enable-csv-decode"] if csv else [])]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    if not csv:  # vLLM alone: its own dense path as the baseline
        env = without_plugin(env)
    log = open(Path(args.json).with_suffix(f".{'csv' if csv else 'dense'}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, 900)
        yield base, proc.pid
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--warmup", type=float, default=60, help="seconds of full load before measuring")
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--csv-url", default=None)
    p.add_argument("--dense-url", default=None)
    p.add_argument("--port", type=int, default=8130)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    if args.model is None and not (args.csv_url and args.dense_url):
        from vllm_csv.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    from vllm_csv.serve import csv_metrics

    runs = {}
    for name, url in (("dense", args.dense_url), ("csv", args.csv_url)):
        if url:
            runs[name] = measure(url, None, args)
            continue
        with started_server(args, csv=name == "csv") as (base, pid):
            runs[name] = measure(base, pid, args)
            if name == "csv":
                runs[name]["csv_metrics"] = csv_metrics(base)
    cmp = compare(runs["csv"].pop("results"), runs["dense"].pop("results"))
    from provenance import machine

    report = {"clients": args.clients, "seconds": args.seconds, "machine": machine(),
              "dense_plugin": "external" if args.dense_url else False, **runs, "deterministic": cmp}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    from record import record_run  # one row a measurement in benchmarks/results/results.csv
    record_run("load", report, source=args.json)
    print(json.dumps(report, indent=1))
    ok = cmp["differing"] == 0 and runs["csv"]["errors"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
