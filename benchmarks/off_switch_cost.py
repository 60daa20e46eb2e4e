"""What CSV costs a serving step when the off-switch keeps it off, measured in one process.

    python benchmarks/off_switch_cost.py --model <HF model dir> [--sequences 8] [--rounds 30]

Server-to-server scatter on a small VM is larger than the effect (``serve.py --pairs``), so this
runs one offline ``LLM(...)`` with CSV enabled and alternates, round by round, four versions on
the same engine: ``csv`` (the plugin: its layer's plan, off-switch ledger and counters, vLLM's
dense call when the switch says so, and its wrappers of the runner's ``execute_model``, the
model's ``compute_logits`` and the sampler), ``dense`` (vLLM's own ``LogitsProcessor.forward`` in
the layer, the plugin's wrappers kept), ``plan`` (the step plan's lookup, then vLLM's call) and
``vllm`` (vLLM alone: its own layer, ``execute_model``, ``compute_logits`` and
``Sampler.forward``, the plugin's wrappers bypassed through their ``_csv_orig``). It reports,
per version, the median and mean time of the model step (the runner's ``execute_model`` and
then its ``sample_tokens``, which calls the sampler) and of the layer's call, over every decode step of its rounds: ``csv``
against ``dense`` is the layer's cost, ``csv`` against ``vllm`` the plugin's whole cost. On a
model where CSV pays the switch stays on and ``csv`` is the CSV path itself.

``--count-calls`` counts instead of timing (no times are reported then): the Python function
calls and the calls of built-in functions (``sys.setprofile``'s ``call`` and ``c_call`` events)
in each version's model step, averaged over its steps (each round's prefill included); ``csv``
against ``vllm`` is the plugin's per-step work, in a form the machine's noise moves far less
than the times: by a few calls, since the steps the lane times, and when the off-switch probes,
follow the clock (which the profiler itself slows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from provenance import commit, machine  # (benchmarks/provenance.py)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the runner in this process: its steps can be timed
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=32, help="rounds, cycling csv, dense, plan, vllm")
    ap.add_argument("--top-k", type=int, default=0,
                    help="seeded top-k sampling (temperature 0.8) instead of greedy decoding")
    ap.add_argument("--count-calls", action="store_true",
                    help="count each version's Python and built-in calls a step instead of timing (docstring)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.sample.sampler import Sampler

    from vllm_csv.vllm_plugin import logits_processor as lp
    from vllm_csv.vllm_plugin.step import step_of

    cls, csv_forward = lp.CSVLogitsProcessor, lp.CSVLogitsProcessor.forward
    versions = ("csv", "dense", "plan", "vllm")
    mode = ["csv"]
    calls = {v: 0 for v in versions}

    def count(frame, event, arg):  # (--count-calls: sys.setprofile's hook during the model step)
        if event == "call" or event == "c_call":
            calls[mode[0]] += 1

    def profiled(fn, *args, **kw):
        if not a.count_calls:
            return fn(*args, **kw)
        sys.setprofile(count)
        try:
            return fn(*args, **kw)
        finally:
            sys.setprofile(None)
    step_s: dict[str, list[float]] = {v: [] for v in versions}
    layer_s: dict[str, list[float]] = {v: [] for v in versions}

    def forward(self, lm_head, hidden, *rest, **kw):
        t = time.perf_counter()
        if mode[0] == "csv":
            out = csv_forward(self, lm_head, hidden, *rest, **kw)
        else:
            if mode[0] == "plan" and step_of(self) is not None:
                step_of(self).take_plan(hidden.shape[0])
            out = LogitsProcessor.forward(self, lm_head, hidden, *rest, **kw)
        layer_s[mode[0]].append(time.perf_counter() - t)
        return out

    cls.forward = forward
    llm = LLM(model=a.model, dtype="bfloat16", max_model_len=512, seed=0,
              additional_config={"csv_decode": {"enabled": True}})
    worker = llm.llm_engine.model_executor.driver_worker.worker
    runner_cls = type(worker.model_runner)
    execute = runner_cls.execute_model
    sampler_forward = Sampler.forward

    def timed_execute(self, *args, **kw):
        t = time.perf_counter()
        out = profiled(execute._csv_orig if mode[0] == "vllm" else execute, self, *args, **kw)
        step_s[mode[0]].append(time.perf_counter() - t)
        return out

    sample_tokens = runner_cls.sample_tokens

    def timed_sample(self, *args, **kw):  # (the step's sampler call: after execute_model, same step)
        t = time.perf_counter()
        out = profiled(sample_tokens, self, *args, **kw)
        if step_s[mode[0]]:
            step_s[mode[0]][-1] += time.perf_counter() - t
        return out

    runner_cls.execute_model, runner_cls.sample_tokens = timed_execute, timed_sample
    sampling = {"temperature": 0.8, "top_k": a.top_k, "seed": 1} if a.top_k else {"temperature": 0}
    params = [SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, **sampling) for _ in range(a.sequences)]
    prompts = [f"def f{i}(x):\n" for i in range(a.sequences)]
    for _ in range(2):  # warm-up: kernels, allocator, the off-switch's first decisions
        llm.generate(prompts, params, use_tqdm=False)
    for v in versions:
        step_s[v].clear()
        layer_s[v].clear()
        calls[v] = 0
    model = worker.model_runner.model
    compute_logits = model.compute_logits  # (the plugin's wrapper: bound at the first step)
    for r in range(a.rounds):
        mode[0] = versions[r % len(versions)]
        plain = mode[0] == "vllm"
        Sampler.forward = sampler_forward._csv_orig if plain else sampler_forward
        model.compute_logits = compute_logits._csv_orig if plain else compute_logits
        llm.generate(prompts, params, use_tqdm=False)
    Sampler.forward, model.compute_logits = sampler_forward, compute_logits
    head = next(m for m in worker.model_runner.model.modules() if isinstance(m, cls)).csv_head
    out = {"model": a.model, "sequences": a.sequences, "rounds": a.rounds, "sampling": sampling, "commit": commit(),
           "machine": machine(),
           "versions": {}}
    sw = head.off_switch
    out["off_switch"] = None if sw is None else {"times_tripped": sw.times_tripped, "probes": sw.probes}
    if a.count_calls:
        out["count_calls"] = True
        for v in versions:
            out["versions"][v] = {"calls_per_step": calls[v] / len(step_s[v]), "steps": len(step_s[v])}
            print(f"{v:5s}: {calls[v] / len(step_s[v]):.1f} calls a step ({len(step_s[v])} steps)")
        c, p = (out["versions"][v]["calls_per_step"] for v in ("csv", "vllm"))
        print(f"csv over vllm (the plugin's calls a step): {c - p:+.1f}")
        return save(a.json, out)
    for v in versions:
        out["versions"][v] = {k: {"median_ms": 1e3 * statistics.median(x), "mean_ms": 1e3 * statistics.mean(x),
                                  "steps": len(x)} for k, x in (("step", step_s[v]), ("layer", layer_s[v]))}
    base = out["versions"]["dense"]
    for v in ("csv", "plan", "vllm"):
        o = out["versions"][v]
        print(f"{v:5s}: step median {o['step']['median_ms']:.3f} ms ({o['step']['median_ms'] / base['step']['median_ms'] - 1:+.1%} "
              f"vs vLLM's layer), layer median {o['layer']['median_ms']:.3f} ms "
              f"({1e3 * (o['layer']['median_ms'] - base['layer']['median_ms']):+.0f} us)")
    print(f"dense: step median {base['step']['median_ms']:.3f} ms, layer median {base['layer']['median_ms']:.3f} ms")
    c, p = out["versions"]["csv"]["step"]["median_ms"], out["versions"]["vllm"]["step"]["median_ms"]
    print(f"csv over vllm (the plugin's whole cost a step): {1e3 * (c - p):+.0f} us, {c / p - 1:+.1%}")
    save(a.json, out)


def save(path: str | None, out: dict) -> None:
    """``out`` to ``path`` and its rows to ``benchmarks/results/results.csv`` (where given)."""
    if path:
        Path(path).write_text(json.dumps(out, indent=1))
        from record import record_run  # one row a measurement in benchmarks/results/results.csv
        record_run("off_switch_cost", out, source=path)


if __name__ == "__main__":
    main()
