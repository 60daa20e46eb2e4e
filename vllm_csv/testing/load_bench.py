"""The load benchmark's clients and report (``benchmarks/load.py``): concurrent clients looping
over a fixed, seeded schedule of requests that mixes every sampling mode (greedy, seeded
temperature, top-k, top-p, min-p, penalties, logit_bias; streaming and not; ``n > 1``; stop
strings; short and long prompts) against an OpenAI-compatible server; the run's summary, the
comparison of two servers' deterministic answers and the growth of a server's memory."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

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
    """Whether both servers must give ``req`` the same answer (greedy, or seeded)."""
    return req.get("temperature", 1.0) == 0 or "seed" in req


async def one_request(session, url: str, model: str, req: dict) -> dict:
    """Send ``req`` to the completions endpoint at ``url``: its texts, generated tokens, time to
    the first token and inter-token latencies (streaming), or the error (never raised)."""
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
    """``clients`` concurrent clients, each sending its :func:`schedule` in turn until ``seconds``
    are up: every request's result (:func:`one_request`), keyed ``(client, index)``."""
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


def pct(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``xs`` (seconds) in milliseconds; None under two samples."""
    return round(1e3 * statistics.quantiles(xs, n=100)[q - 1], 2) if len(xs) >= 2 else None


def summarize(results: list[dict], seconds: float) -> dict:
    """Requests, errors, tokens per second and latency percentiles of a run of ``seconds``."""
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


def rss_growth(series: list[tuple[float, float]]) -> dict:
    """RSS after warm-up and at the end, their ratio, and the growth over the second half of
    the run (a leak keeps growing; a pool filling up flattens)."""
    rss0, rss1 = series[0][1], series[-1][1]
    mid = min(series, key=lambda x: abs(x[0] - series[-1][0] / 2))[1]
    return {"rss_mb_after_warmup": rss0, "rss_mb_end": rss1, "rss_growth": round(rss1 / rss0 - 1, 4),
            "rss_growth_second_half": round(rss1 / mid - 1, 4), "rss_mb_series": series}
