"""Print the results table (``benchmarks/results/results.csv``) as markdown: by default the *current*
rows (the latest of each benchmark / metric / config / shape / batch / dtype / machine / threads /
baseline), filtered as asked.

    python benchmarks/results_table.py --benchmark serve --machine EPYC
    python benchmarks/results_table.py --benchmark lm_head --metric speedup --config screen=auto
    python benchmarks/results_table.py --benchmark audit --all            # every row, not only the latest
    python benchmarks/results_table.py --headlines                        # the README's headline tables

Filters: ``--benchmark``/``--metric`` exact (several allowed), ``--config`` words (``k=v`` a whole token of
the config, any other word a substring), ``--machine``/``--baseline``
substrings (case-insensitive), ``--shape``, ``--batch``, ``--commit``. Columns: ``--columns``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

DEFAULT_COLUMNS = ("benchmark", "metric", "config", "shape", "batch", "dtype", "machine", "threads", "commit",
                   "baseline", "value", "unit", "date", "source")

# The README's headline tables: (title, filters, columns). Regenerate with --headlines.
SHORT = ("config", "shape", "batch", "machine", "commit", "value", "source")
HEADLINES = [
    ("LM head step, CSV over vLLM's dense bf16 head (lm_head, random heads, peaked states, 2 threads)",
     dict(benchmark=["lm_head"], metric=["speedup"], config="weights=random screen=auto", threads=2), SHORT),
    ("LM head on the learned demo model (65536 x 768, bf16): speed-up over vLLM's head, certified share",
     dict(benchmark=["lm_head"], metric=["speedup", "certified_share"], config="model=demo screen=auto"),
     ("batch", "machine", "threads", "commit", "source")),
    ("Serving: CSV server's tokens/s over plain `vllm serve` (serve.py, demo model, interleaved)",
     dict(benchmark=["serve"], metric=["tokens_per_s_ratio"], config="model=demo interleave=True"), SHORT),
    ("Speculative decoding served (serve.py, demo model, greedy, interleaved): CSV over the same `vllm serve` "
     "(or, with dense_args, plain decoding); vLLM's acceptance rate on each side",
     dict(benchmark=["serve"], metric=["tokens_per_s_ratio", "identical_outputs", "dense_acceptance_rate",
                                       "csv_acceptance_rate"], config="speculative-config"),
     ("config", "batch", "machine", "commit", "source")),
    ("Sampler step, CSV over vLLM's dense sampler step (sampler_step, demo model, bf16)",
     dict(benchmark=["sampler_step"], metric=["speedup"], config="model=demo screen=int8+int4"), SHORT),
    ("Exactness audits: rows checked and wrong (audit.py; every certified row against the dense head)",
     dict(benchmark=["audit"], metric=["rows", "certified_ids", "certified_values", "certified_draws", "wrong_ids",
                                       "wrong_values", "wrong_tokens"]),
     ("config", "machine", "commit", "source")),
    ("GPU fused step over cuBLAS bf16 + argmax (gpu_step, random heads, CUDA graphs)",
     dict(benchmark=["gpu_step"], metric=["speedup"], config="measure=step"), SHORT),
    ("GPU fused step on heads trained on the GPU, their own held-out hidden states (gpu_learned): rows, "
     "certified, differing from cuBLAS; step over cuBLAS bf16 + argmax",
     dict(benchmark=["gpu_learned"], metric=["rows", "certified", "mismatches", "speedup"],
          config=["learned:"]),
     ("config", "shape", "batch", "commit", "source")),
    ("V2 temperature draw on the device over the dense V2 step (v2_fused_draw, random peaked heads)",
     dict(benchmark=["v2_fused_draw"], metric=["speedup_fused_c8", "certified_share_c8", "mismatches_c8"]),
     ("config", "shape", "batch", "commit", "source")),
    ("Tensor-parallel head (tp_head): speed-up over the dense head at the same TP size, certified share",
     dict(benchmark=["tp_head"], metric=["speedup", "certified_share"]), ("config", "shape", "batch", "commit", "source")),
    ("Off-switch cost: the plugin's step over vLLM's own, CSV kept off (off_switch_cost)",
     dict(benchmark=["off_switch_cost"], metric=["csv_step_over_dense"]), SHORT),
    ("Under load (load.py, 64 clients, 5 min a server)",
     dict(benchmark=["load"], metric=["tokens_per_s_ratio", "csv_errors", "deterministic_differing"]),
     ("shape", "batch", "machine", "commit", "source")),
    ("Outlier channels: certified share with the int8 screen's split (outlier_channels)",
     dict(benchmark=["outlier_channels"], metric=["certified_share", "scored_share"], config="screen=int8", batch=8),
     ("config", "shape", "batch", "commit", "source")),
]


def _config_ok(config: str, words) -> bool:
    """Each word matches: ``k=v`` a whole token of the config, other words a substring."""
    toks = config.split()
    return all((w in toks) if "=" in w else (w.lower() in config.lower()) for w in words)


def select(rows, benchmark=None, metric=None, machine=None, config=None, baseline=None, shape=None, batch=None,
           commit=None, threads=None):
    words = config.split() if isinstance(config, str) else (config or [])

    def ok(r: record.Row) -> bool:
        return ((not benchmark or r.benchmark in benchmark) and (not metric or r.metric in metric)
                and (not machine or machine.lower() in r.machine.lower()) and _config_ok(r.config, words)
                and (not baseline or baseline.lower() in r.baseline.lower())
                and (not shape or r.shape == shape) and (batch is None or r.batch == batch)
                and (not commit or r.commit.startswith(commit)) and (threads is None or r.threads == threads))
    return [r for r in rows if ok(r)]


def markdown(rows, columns=DEFAULT_COLUMNS) -> str:
    def cell(r, c):
        v = r.as_csv()[c]
        if c == "source":
            v = v.removeprefix("benchmarks/results/")
        return str(v).replace("|", "\\|")
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows]
    return "\n".join(out)


def pivot(rows, columns, metrics) -> str:
    """One line per measured thing, one column per metric (value of the latest row of each)."""
    lines: dict[tuple, dict] = {}
    for r in rows:
        if r.metric in metrics:
            k = tuple(r.as_csv()[c] for c in columns if c not in ("commit", "source", "date"))
            line = lines.setdefault(k, {c: r.as_csv()[c] for c in columns})
            line[r.metric] = r.as_csv()["value"]
            for c in ("commit", "source", "date"):
                if c in columns:
                    line[c] = r.as_csv()[c].removeprefix("benchmarks/results/")
    cols = [c for c in columns if c not in ("commit", "source", "date")] + list(metrics) + \
        [c for c in ("commit", "date", "source") if c in columns]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(str(line.get(c, "")).replace("|", "\\|") for c in cols) + " |" for line in lines.values()]
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", default=str(record.TABLE))
    p.add_argument("--benchmark", nargs="*")
    p.add_argument("--metric", nargs="*")
    p.add_argument("--machine")
    p.add_argument("--config", nargs="*", help="words that must all match: k=v a whole token, else a substring")
    p.add_argument("--baseline")
    p.add_argument("--shape")
    p.add_argument("--batch", type=int)
    p.add_argument("--commit")
    p.add_argument("--threads", type=int)
    p.add_argument("--all", action="store_true", help="every row, not only the current ones")
    p.add_argument("--columns", nargs="*", default=list(DEFAULT_COLUMNS))
    p.add_argument("--headlines", action="store_true", help="the README's headline tables")
    a = p.parse_args(argv)
    rows = record.read(a.table)
    if not a.all:
        rows = record.current(rows)
    if a.headlines:
        for title, filt, cols in HEADLINES:
            sel = select(rows, **filt)
            table = pivot(sel, cols, filt["metric"]) if len(filt.get("metric", [])) > 1 else markdown(sel, cols)
            print(f"**{title}**\n\n{table}\n")
        return
    sel = select(rows, a.benchmark, a.metric, a.machine, a.config, a.baseline, a.shape, a.batch, a.commit, a.threads)
    print(markdown(sel, tuple(a.columns)))


if __name__ == "__main__":
    main()
