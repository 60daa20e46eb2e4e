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
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RSS_EVERY = 10.0  # seconds between RSS samples of the server
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Parser:\n    def __init__(self",
           "# Copyright 2024\n" + "x = 1\n" * 40, "for i in range(", "    return self."]
MODES = [
    dict(temperature=0),
    dict(temperature=0.8, seed=11),
    dict(temperature=1.0, top_k=20, seed=12),
    dict(temperature=1.0, top_p=0.9, seed=13),
    dict(temperature=1.0, min_p=0.1, seed=14),
    dict(temperature=0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
    dict(temperature=0, logit_bias={"10": 5.0, "50": -100.0}),
    dict(temperature=0.7, top_k=8, n=3, seed=15),
    dict(temperature=0, stop=["\n\n", ")"]),
]


def schedule(i: int) -> dict:
    """The ``i``-th request of a client: a mode, a prompt, streaming or not, a length."""
    mode = dict(MODES[i % len(MODES)])
    return {"prompt": PROMPTS[(i // len(MODES)) % len(PROMPTS)], "max_tokens": 8 + 8 * (i % 4),
            "stream": i % 3 == 0 and mode.get("n", 1) == 1, **mode}


def deterministic(req: dict) -> bool:
    return req.get("temperature", 1.0) == 0 or "seed" in req


async def one_request(session, url: str, model: str, req: dict) -> dict:
    import aiohttp

    body = {"model": model, **req}
    t0 = time.perf_counter()
    out = {"req": req, "error": None, "tokens": 0, "ttft": None, "itl": [], "texts": None}
    try:
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=600)) as r:
            if r.status != 200:
                out["error"] = f"HTTP {r.status}: {(await r.text())[:200]}"
                return out
            if not req["stream"]:
                data = await r.json()
                out["tokens"] = data["usage"]["completion_tokens"]
                out["texts"] = [c["text"] for c in sorted(data["choices"], key=lambda c: c["index"])]
                return out
            text, last = [], None
            async for line in r.content:
                line = line.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[5:])
                for c in chunk.get("choices", []):
                    if c.get("text"):
                        if last is None:
                            out["ttft"] = now - t0
                        else:
                            out["itl"].append(now - last)
                        last = now
                        out["tokens"] += 1
                        text.append(c["text"])
            out["texts"] = ["".join(text)]
    except Exception as e:  # counted, never raised: a load test reports errors
        out["error"] = f"{type(e).__name__}: {e}"[:200]
    return out


async def run_load(url: str, clients: int, seconds: float) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        deadline = time.perf_counter() + seconds
        results: list[dict] = []

        async def client(c: int):
            i = c
            while time.perf_counter() < deadline:
                res = await one_request(session, url, model, schedule(i))
                res["key"] = (c, i)
                results.append(res)
                i += clients

        await asyncio.gather(*(client(c) for c in range(clients)))
        return results


def server_rss_mb(pid: int) -> float:
    """Resident memory of a server process and its children (MB)."""
    import psutil

    p = psutil.Process(pid)
    return sum(x.memory_info().rss for x in [p, *p.children(recursive=True)]) / 2**20


def pct(xs: list[float], q: float) -> float | None:
    return round(1e3 * statistics.quantiles(xs, n=100)[q - 1], 2) if len(xs) >= 2 else None


def summarize(results: list[dict], seconds: float) -> dict:
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    errors = [r["error"] for r in results if r["error"]]
    return {"requests": len(results), "errors": len(errors), "error_samples": errors[:5],
            "tokens": sum(r["tokens"] for r in results),
            "tokens_per_s": round(sum(r["tokens"] for r in results) / seconds, 1),
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99)}


def compare(csv: list[dict], dense: list[dict]) -> dict:
    """Deterministic requests answered by both servers (same client and index): how many differ."""
    d = {r["key"]: r for r in dense if not r["error"]}
    both = [(r, d[r["key"]]) for r in csv if not r["error"] and r["key"] in d and deterministic(r["req"])]
    return {"compared": len(both), "differing": sum(a["texts"] != b["texts"] for a, b in both)}


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


def rss_growth(series: list[tuple[float, float]]) -> dict:
    """RSS after warm-up and at the end, their ratio, and the growth over the second half of
    the run (a leak keeps growing; a pool filling up flattens)."""
    rss0, rss1 = series[0][1], series[-1][1]
    mid = min(series, key=lambda x: abs(x[0] - series[-1][0] / 2))[1]
    return {"rss_mb_after_warmup": rss0, "rss_mb_end": rss1, "rss_growth": round(rss1 / rss0 - 1, 4),
            "rss_growth_second_half": round(rss1 / mid - 1, 4), "rss_mb_series": series}


@contextlib.contextmanager
def started_server(args, csv: bool):
    """``vllm serve`` on ``args.model`` (plain, or with CSV): yields ``(base_url, pid)``."""
    from vllm_csv.serve import _vllm_command, wait_healthy

    port = args.port + int(csv)
    cmd = [*_vllm_command(), "serve", args.model, "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           "--max-model-len", "1024", *(["--enable-csv-decode"] if csv else [])]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
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
              **runs, "deterministic": cmp}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    from record import record_run  # one row a measurement in benchmarks/results/results.csv
    record_run("load", report, source=args.json)
    print(json.dumps(report, indent=1))
    ok = cmp["differing"] == 0 and runs["csv"]["errors"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
