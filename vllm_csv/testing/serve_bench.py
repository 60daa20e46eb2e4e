"""The serving benchmark's machinery (``benchmarks/serve.py``): a dense and a CSV ``vllm serve``
on the same model, the workloads sent to them (batched prompts; greedy and seeded sampling of each
mode; the concurrent mixed workloads), one server at a time or both up taking turns round by round,
and the summary of a pair (tokens per second, identical outputs, CSV's own metrics) and of
several pairs (medians of per-pair ratios)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..serve import _get, _post, _vllm_command, csv_metrics, spec_metrics, wait_healthy, without_plugin

PROMPTS = [
    "import os\nimport sys\n", "def fibonacci(n):\n", "class Parser:\n    def __init__(self", "for i in range(",
    "# Copyright", "    return self.", "if __name__ == ", "def test_", "from collections import",
    "    raise ValueError(", "try:\n    import ", "with open(", "x = [", '"""Utilities for', "    @property\n",
    "        self.assertEqual(",
]
WORKLOADS = {
    "greedy": {"temperature": 0},
    "top_k_sampling": {"temperature": 0.8, "top_k": 20, "seed": 1},
    "temperature_sampling": {"temperature": 0.8, "seed": 1},
    "top_p_sampling": {"temperature": 0.8, "top_p": 0.9, "seed": 1},
    "top_k_top_p_sampling": {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "seed": 1},
}
# One batched request per mode, all sent at once so their rows share steps; sampled modes are
# seeded so that outputs are comparable between servers.
MIXED = {
    "greedy": {"temperature": 0},
    "temperature": {"temperature": 0.8, "seed": 2},
    "top_k": {"temperature": 0.8, "top_k": 20, "seed": 3},
    "top_p": {"temperature": 0.8, "top_p": 0.9, "seed": 4},
    "min_p": {"temperature": 0.8, "min_p": 0.1, "seed": 5},
    "penalties": {"temperature": 0, "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2},
    "logit_bias": {"temperature": 0.8, "seed": 6, "logit_bias": {"10": 3.0, "50": -5.0, "300": 2.0}},
}
# Greedy rows (certified in the head) in the same steps as sampled rows (deferred to the sampler),
# sent at once like the mixed workload: steps the sampler hook can draw itself.
GREEDY_BESIDE = {
    "greedy": {"temperature": 0},
    "temperature": {"temperature": 0.8, "seed": 2},
    "top_k": {"temperature": 0.8, "top_k": 20, "seed": 3},
}
CONCURRENT = {"mixed": MIXED, "greedy_beside": GREEDY_BESIDE}  # workloads whose modes are sent at once


def server_flags(csv: bool, args) -> tuple[int, list[str]]:
    """The port and the CSV flags of the dense (``csv=False``) or the CSV server. The first server
    started takes ``--port`` (the dense one, or the CSV one with ``--csv-first``); with ``--control``
    the CSV side is a second plain server, on its own port."""
    port = args.port + (int(not csv) if args.csv_first else int(csv))
    if not csv or args.control:
        return port, []
    flags = ["--enable-csv-decode"]
    if args.screen:
        flags += ["--csv-screen", args.screen]
    if args.no_off_switch:
        flags += ["--additional-config", json.dumps({"csv_decode": {"off_switch": False}})]
    return port, flags


def loads_plugin(csv: bool, args) -> bool:
    """Whether the dense (``csv=False``) or the CSV server loads this plugin: the CSV one does;
    the dense one is vLLM alone (:func:`vllm_csv.serve.without_plugin`) unless ``--dense-plugin``;
    under ``--control`` both are alike (the plugin in both with ``--dense-plugin``, else in neither)."""
    if getattr(args, "dense_plugin", False):
        return True
    return csv and not args.control


@contextlib.contextmanager
def server(model: str, csv: bool, args):
    """A running ``vllm serve`` (dense or CSV), warmed up; yields its ``complete(params)`` and its
    base URL; stopped on exit."""
    port, flags = server_flags(csv, args)
    base = f"http://127.0.0.1:{port}"
    extra = args.vllm_args if csv or getattr(args, "dense_args", None) is None else args.dense_args
    cmd = [*_vllm_command(), "serve", model, "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           "--max-model-len", "1024", *flags, *extra]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    if not loads_plugin(csv, args):
        env = without_plugin(env)
    if args.same_malloc:
        env.update(malloc_env())
    if args.same_metrics:  # each server its own fresh directory (files left by one would be read by the next)
        env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="serve-bench-prometheus-")
    tag = ('csv' if csv else 'dense') + (f".{args.pair}" if args.pairs > 1 else "")
    log = open(Path(args.json).with_suffix(f".{tag}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(proc, base, args.timeout)
        served = json.loads(_get(base + "/v1/models"))["data"][0]["id"]

        def complete(params: dict) -> dict:
            return _post(base + "/v1/completions", {"model": served, "prompt": PROMPTS[: args.prompts],
                                                     "max_tokens": args.max_tokens, **params}, timeout=900)

        complete({"temperature": 0, "max_tokens": 4})  # warm-up
        yield complete, base
    finally:
        proc.send_signal(2)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        if args.same_metrics:
            shutil.rmtree(env["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)


def workloads(args) -> dict[str, dict]:
    """The workloads to run: name -> request parameters (``--mixed`` adds :data:`CONCURRENT`;
    ``--workloads`` keeps the named ones)."""
    out = dict(WORKLOADS, **CONCURRENT) if args.mixed else dict(WORKLOADS)
    return {k: v for k, v in out.items() if k in args.workloads} if args.workloads else out


def run_round(complete, name: str, params: dict) -> tuple[list, int]:
    """One batched request of a workload (a :data:`CONCURRENT` one: every mode at once, from
    threads, so that the server batches their rows); returns the texts and the completion tokens."""
    if name in CONCURRENT:
        with ThreadPoolExecutor(len(params)) as pool:
            outs = list(pool.map(complete, params.values()))
    else:
        outs = [complete(params)]
    texts = [[c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])] for out in outs]
    return texts, sum(out["usage"]["completion_tokens"] for out in outs)


def run_server(model: str, csv: bool, args) -> dict:
    """One server's run: per workload ``args.rounds`` rounds, their tokens, seconds and texts;
    ``metrics`` the CSV server's own (empty for the dense one)."""
    with server(model, csv, args) as (complete, base):
        res = {}
        for name, params in workloads(args).items():
            texts, tokens, t0 = [], 0, time.perf_counter()
            for _ in range(args.rounds):
                t, n = run_round(complete, name, params)
                texts += t
                tokens += n
            secs = time.perf_counter() - t0
            res[name] = {"tokens": tokens, "seconds": round(secs, 2), "tokens_per_s": round(tokens / secs, 1),
                         "texts": texts}
        res["metrics"] = csv_metrics(base) if csv else {}
        res["spec"] = spec_metrics(base)
        return res


def run_interleaved(model: str, args) -> dict:
    """Both servers up at once, idle but for their turn: each workload's rounds alternate between
    them (ABBA: dense first, then CSV first, ...), with a pause before each turn so that the
    other server's OpenMP threads stop spinning. Drift in the machine's speed (other tenants,
    clocks) then falls on both sides of each round's ratio alike; the speed-up is the median of
    the rounds' ratios, beside the ratio of the summed rates."""
    with contextlib.ExitStack() as stack:
        order = (True, False) if args.csv_first else (False, True)
        comp = {csv: stack.enter_context(server(model, csv, args)) for csv in order}
        res: dict = {False: {}, True: {}}
        start = warm_up(comp, args)
        ratios: dict[str, list[float]] = {}
        for name, params in workloads(args).items():
            acc = {csv: {"tokens": 0, "seconds": 0.0, "texts": []} for csv in (False, True)}
            ratios[name] = []
            for r in range(args.rounds):
                rate = {}
                for csv in ((False, True) if r % 2 == 0 else (True, False)):
                    time.sleep(args.pause)
                    t0, texts, n = time.perf_counter(), [], 0
                    for _ in range(args.per_turn):
                        t, k = run_round(comp[csv][0], name, params)
                        texts, n = texts + t, n + k
                    secs = time.perf_counter() - t0
                    a = acc[csv]
                    a["tokens"] += n
                    a["seconds"] += secs
                    a["texts"] += texts
                    rate[csv] = n / secs
                ratios[name].append(round(rate[True] / rate[False], 3))
            for csv in (False, True):
                a = acc[csv]
                res[csv][name] = {"tokens": a["tokens"], "seconds": round(a["seconds"], 2),
                                  "tokens_per_s": round(a["tokens"] / a["seconds"], 1), "texts": a["texts"]}
        end = csv_metrics(comp[True][1])
        res[True]["metrics"] = since(end, start[True]["metrics"])
        res[False]["metrics"] = {}
        for csv in (False, True):
            res[csv]["spec"] = spec_since(spec_metrics(comp[csv][1]), start[csv]["spec"])
    s = summary(res[False], res[True])
    if getattr(args, "warmup_rounds", 0):
        s["warmup_rounds"] = args.warmup_rounds
        s["csv_metrics_with_warmup"] = end
        rows = end.get("csv_decode_rows_total", 0.0)
        s["certified_share_with_warmup"] = end.get("csv_decode_rows_certified_total", 0.0) / rows if rows else 0.0
    for name, rs in ratios.items():
        w = s["workloads"][name]
        w["speedup_of_totals"] = w["speedup"]
        w["speedup"] = round(statistics.median(rs), 3)
        w["speedup_by_round"] = rs
    return s


def warm_up(comp: dict, args) -> dict:
    """``args.warmup_rounds`` untimed rounds of each workload on each server (``comp``: CSV or
    not -> (complete, base)), before the timed ones: a server's first steps are its warm-up
    (first calls of each shape, the off-switch's first dense steps of each batch size). Returns
    each server's metrics after them (``{csv: {"metrics", "spec"}}``; empty without warm-up
    rounds), which :func:`since` and :func:`spec_since` take off the end's."""
    n = getattr(args, "warmup_rounds", 0)
    for name, params in workloads(args).items() if n else ():
        for csv in comp:
            for _ in range(n):
                run_round(comp[csv][0], name, params)
    return {csv: {"metrics": csv_metrics(comp[csv][1]) if (n and csv) else {},
                  "spec": spec_metrics(comp[csv][1]) if n else {}} for csv in comp}


def since(end: dict[str, float], start: dict[str, float]) -> dict[str, float]:
    """CSV's metrics (:func:`~vllm_csv.serve.csv_metrics`) counted between ``start`` and ``end``:
    every sample is a counter or a histogram's sum or count, but ``csv_decode_info`` (a gauge of
    1, kept)."""
    return {k: v if k.startswith("csv_decode_info") else v - start.get(k, 0.0) for k, v in end.items()}


def spec_since(end: dict[str, float], start: dict[str, float]) -> dict[str, float]:
    """vLLM's speculative-decoding counters (:func:`~vllm_csv.serve.spec_metrics`) between
    ``start`` and ``end``, the acceptance rate taken over that span."""
    out = {k: v - start.get(k, 0.0) for k, v in end.items() if k != "acceptance_rate"}
    drafted = out.get("spec_decode_num_draft_tokens", 0.0)
    if drafted:
        out["acceptance_rate"] = round(out.get("spec_decode_num_accepted_tokens", 0.0) / drafted, 4)
    return out


def malloc_env() -> dict[str, str]:
    """glibc's environment tunables with the thresholds the CSV head sets with ``mallopt`` in
    its worker (:mod:`vllm_csv.cpu_malloc`), for both servers: without them the CSV server's
    whole process runs with a tuned allocator and the dense one does not, and the comparison
    credits CSV with the allocator's effect."""
    from vllm_csv import cpu_malloc

    return {"MALLOC_MMAP_THRESHOLD_": str(cpu_malloc.MMAP), "MALLOC_TRIM_THRESHOLD_": str(cpu_malloc.TRIM),
            "MALLOC_TOP_PAD_": str(cpu_malloc.TOP_PAD)}


def summary(dense: dict, csv: dict) -> dict:
    """The comparison of a pair's runs (:func:`run_server`): per workload tokens per second, the
    speed-up and whether the outputs are identical; CSV's rows, certified share and fallbacks."""
    m = csv["metrics"]
    csv_rows = m.get("csv_decode_csv_rows_total", 0.0)
    out = {"workloads": {}, "csv_metrics": m}
    for name in csv:
        if name in ("metrics", "spec"):
            continue
        out["workloads"][name] = {
            "dense_tokens_per_s": dense[name]["tokens_per_s"], "csv_tokens_per_s": csv[name]["tokens_per_s"],
            "speedup": round(csv[name]["tokens_per_s"] / dense[name]["tokens_per_s"], 3),
            "identical_outputs": dense[name]["texts"] == csv[name]["texts"]}
    if dense.get("spec") or csv.get("spec"):  # speculative decoding: vLLM's draft and acceptance counts
        out["spec_decode"] = {"dense": dense.get("spec"), "csv": csv.get("spec"),
                              "identical": dense.get("spec") == csv.get("spec")}
    out["rows_total"] = m.get("csv_decode_rows_total", 0.0)
    out["csv_rows"] = csv_rows
    by_mode = {k.split('mode="')[1].split('"')[0]: v for k, v in m.items()
               if k.startswith("csv_decode_rows_certified_total{")}
    cert = sum(by_mode.values())
    out["certified_by_mode"] = by_mode
    out["certified_share_of_csv_rows"] = cert / csv_rows if csv_rows else 0.0
    out["certified_share_of_all_rows"] = cert / out["rows_total"] if out["rows_total"] else 0.0
    out["fallbacks"] = {k.split('reason="')[1].rstrip('"}'): v for k, v in m.items()
                        if k.startswith("csv_decode_fallbacks_total{")}
    n = m.get("csv_decode_head_seconds_count", 0.0)
    out["csv_head_ms_mean"] = round(1e3 * m.get("csv_decode_head_seconds_sum", 0.0) / n, 3) if n else None
    out["head_seconds_saved_total"] = m.get("csv_decode_head_seconds_saved_total")
    csv_s = m.get("csv_decode_head_seconds_csv_total", 0.0)  # steps that ran CSV, and their dense estimate
    out["head_speedup_on_csv_steps"] = round(m["csv_decode_head_seconds_dense_estimate_total"] / csv_s, 3) \
        if csv_s else None
    return out


def combine(pairs: list[dict]) -> dict:
    """The summary of several dense/CSV server pairs: per workload, the median of the pairs'
    speed-ups (each pair's two servers ran back to back, so their ratio is free of the drift
    between pairs) and of their tokens/s, each pair's speed-up, and the metrics summed."""
    out = dict(pairs[-1])
    out["workloads"] = {}
    for name in pairs[0]["workloads"]:
        ws = [p["workloads"][name] for p in pairs]
        out["workloads"][name] = {
            "dense_tokens_per_s": statistics.median(w["dense_tokens_per_s"] for w in ws),
            "csv_tokens_per_s": statistics.median(w["csv_tokens_per_s"] for w in ws),
            "speedup": round(statistics.median(w["speedup"] for w in ws), 3),
            "speedup_by_pair": [w["speedup"] for w in ws],
            "identical_outputs": all(w["identical_outputs"] for w in ws)}
    for key in ("rows_total", "csv_rows"):
        out[key] = sum(p[key] for p in pairs)
    by_mode: dict[str, float] = {}
    falls: dict[str, float] = {}
    for p in pairs:
        for k, v in p["certified_by_mode"].items():
            by_mode[k] = by_mode.get(k, 0.0) + v
        for k, v in p["fallbacks"].items():
            falls[k] = falls.get(k, 0.0) + v
    out["certified_by_mode"], out["fallbacks"] = by_mode, falls
    cert = sum(by_mode.values())
    out["certified_share_of_csv_rows"] = cert / out["csv_rows"] if out["csv_rows"] else 0.0
    out["certified_share_of_all_rows"] = cert / out["rows_total"] if out["rows_total"] else 0.0
    out["pairs"] = pairs
    return out


def markdown(s: dict, machine: str, model: str) -> str:
    """The table of a :func:`summary` or :func:`combine` (its pairs), for the ``.md`` beside the JSON."""
    n = len(s.get("pairs", ())) or 1
    lines = [f"Machine: {machine}; model {model}"
             + (f"; {n} server pairs run back to back in ABBA order, medians over pairs" if n > 1 else ""), "",
             "| workload | dense tok/s | CSV tok/s | speed-up | identical outputs |", "|---|---|---|---|---|"]
    for name, w in s["workloads"].items():
        by_pair = f" (pairs: {', '.join(f'{x}x' for x in w['speedup_by_pair'])})" if "speedup_by_pair" in w else ""
        if "speedup_by_round" in w:
            by_pair = (f" (median of {len(w['speedup_by_round'])} interleaved rounds; ratio of totals "
                       f"{w['speedup_of_totals']}x)")
        lines.append(f"| {name} | {w['dense_tokens_per_s']} | {w['csv_tokens_per_s']} | {w['speedup']}x{by_pair} | "
                     f"{w['identical_outputs']} |")
    n = s.get("warmup_rounds")
    warm = (f" (after {n} untimed warm-up round{'s' if n > 1 else ''} per server, not counted here; with them "
            f"{s['certified_share_with_warmup']:.1%} of all rows certified)") if n else ""
    lines += ["", f"CSV path{warm}: {s['csv_rows']:.0f} of {s['rows_total']:.0f} head rows eligible, "
              f"{s['certified_share_of_csv_rows']:.1%} of them certified ({s['certified_share_of_all_rows']:.1%} of all "
              f"rows; by mode {s['certified_by_mode']}); fallbacks {s['fallbacks']}; "
              f"mean timed head step {s['csv_head_ms_mean']} ms (the off-switch's fast lane times 2 steps in 8); "
              f"head time saved {s['head_seconds_saved_total']} s"]
    if s.get("spec_decode"):
        sd = s["spec_decode"]
        lines += ["", f"Speculative decoding (vLLM's counters): dense {sd['dense']}; CSV {sd['csv']}; "
                  f"identical: {sd['identical']}"]
    return "\n".join(lines) + "\n"
