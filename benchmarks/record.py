"""The results table: one row per measurement in ``benchmarks/results/results.csv``.

    from record import record_run            # in a benchmark script, after it writes its JSON
    record_run("lm_head", result, source=args.json)

    import record
    rows = record.read()                       # every row, oldest first
    now = record.current(rows)                 # the latest row per measured thing

A row is one number: what was measured (``benchmark``, ``metric``, ``config``), on what (``shape``
V x d, ``batch``, ``dtype``, ``machine`` in words, ``threads``), at which ``commit``, against what
(``baseline``: what a ratio or a share is taken against; empty for an absolute time or count), the
``value`` and its ``unit``, the ``date`` it was recorded and its ``source`` (the raw file, or the
command that produced it). Rows are appended, never rewritten: the order of the file is the order
of recording, and the *current* value of a measurement is its last row (:func:`current`).

The ``rows_from_*`` functions turn each benchmark's JSON into rows; the benchmark scripts call
them through :func:`record_run` when they write results, and ``results_convert.py`` ran them once
over the JSON files recorded before the table existed. ``VLLM_CSV_RESULTS`` names another table
file (``off`` or ``0``: record nothing).

Why CSV and not JSONL: every row has the same flat columns, so a CSV line is a row that ``grep``,
``git diff``, a spreadsheet and ``csv``/``pandas`` all read as is.
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "benchmarks" / "results" / "results.csv"
FIELDS = ("benchmark", "metric", "config", "shape", "batch", "dtype", "machine", "threads", "commit",
          "baseline", "value", "unit", "date", "source", "note")
# what makes two rows the same measurement (the latest of them is the current one)
KEY = ("benchmark", "metric", "config", "shape", "batch", "dtype", "machine", "threads", "baseline")

# baselines, spelled once
VLLM_HEAD = "vLLM's dense head (its LogitsProcessor dispatch), same dtype, same run"
FLINEAR = "dense F.linear head, same dtype, same run"
DENSE_SERVER = "vLLM alone: plain `vllm serve` without this plugin (dense head), same model and requests"
# (serve runs before the dense server was vLLM alone: it loaded the plugin, with CSV off)
DENSE_SERVER_PLUGIN = "plain `vllm serve` with the plugin loaded and CSV off (dense head), same model and requests"
DENSE_STEP = "vLLM's dense sampler step (dense head + vLLM sampler), same rows"
DENSE_HEAD = "dense head of the same batch (exact comparison)"
CUBLAS = "cuBLAS bf16 F.linear + argmax (vLLM's dense head), CUDA-graph replayed"
CUBLAS_SYNC = "cuBLAS bf16 F.linear + argmax, with a host sync a step"
FBGEMM = "FBGEMM int8 GEMM, same inputs"
NO_PREFETCH = "same kernel without software prefetch"
V2_DENSE = "dense bf16 head (cuBLAS) + vLLM V2 gumbel_sample"
V2_VERIFY_DENSE = "dense bf16 head (cuBLAS) on the same rows (V2's rejection kernels, unchanged on both sides, left out)"

# learned models by the name of their cache directory: V x d (from their configs, as recorded by
# the serving metrics' csv_decode_info and lm_head.py)
MODEL_SHAPES = {"demo": "65536x768", "test": "8192x256"}


class Row(BaseModel):
    """One measurement; validated on the way in and out of the table."""

    model_config = ConfigDict(extra="forbid")

    benchmark: str
    metric: str
    config: str = ""
    shape: str = ""
    batch: int | None = None
    dtype: str = ""
    machine: str
    threads: int | None = None
    commit: str = ""
    baseline: str = ""
    value: float
    unit: str
    date: str = ""
    source: str

    note: str = ""

    @field_validator("benchmark", "metric", "machine", "unit", "source")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("shape")
    @classmethod
    def _shape(cls, v: str) -> str:
        if v and not re.fullmatch(r"\d+x\d+", v):
            raise ValueError(f"shape {v!r} is not V x d (e.g. 151936x1024)")
        return v

    @field_validator("date")
    @classmethod
    def _date(cls, v: str) -> str:
        if v:
            _dt.date.fromisoformat(v)
        return v

    @field_validator("value")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("value must be finite (leave a measurement out rather than record nan)")
        return v

    @field_validator("batch", "threads", mode="before")
    @classmethod
    def _blank_int(cls, v):
        return None if v == "" else v

    def key(self) -> tuple:
        return tuple(getattr(self, f) for f in KEY)

    def as_csv(self) -> dict:
        d = self.model_dump()
        d["value"] = _fmt(self.value)
        return {k: ("" if v is None else v) for k, v in d.items()}


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:.6g}"


# --------------------------------------------------------------------------- the table


def table_path(path: str | Path | None = None) -> Path | None:
    if path is not None:
        return Path(path)
    env = os.environ.get("VLLM_CSV_RESULTS", "")
    if env.lower() in ("off", "0", "no"):
        return None
    return Path(env) if env else TABLE


def append(rows: Iterable[Row | dict], path: str | Path | None = None) -> int:
    """Validate ``rows`` and append them to the table (header written when the file is new).
    Returns how many were written (0 when recording is off)."""
    rows = [r if isinstance(r, Row) else Row(**r) for r in rows]
    p = table_path(path)
    if p is None or not rows:
        return 0
    p.parent.mkdir(parents=True, exist_ok=True)
    new = not p.exists() or p.stat().st_size == 0
    with open(p, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, lineterminator="\n")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(r.as_csv())
    return len(rows)


def read(path: str | Path | None = None) -> list[Row]:
    """Every row of the table, in the order recorded."""
    p = Path(path) if path is not None else TABLE
    if not p.exists():
        return []
    with open(p, newline="") as f:
        return [Row(**r) for r in csv.DictReader(f)]


def current(rows: Iterable[Row]) -> list[Row]:
    """The latest row of each measurement (same benchmark, metric, config, shape, batch, dtype,
    machine, threads and baseline), in the order of their first recording."""
    latest: dict[tuple, Row] = {}
    for r in rows:
        latest[r.key()] = r  # dicts keep the first insertion's position
    return list(latest.values())


# --------------------------------------------------------------------------- helpers


def git_commit() -> str:
    """The checked-out commit (short), ``-dirty`` with uncommitted changes to tracked files."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return (head + ("-dirty" if dirty else "")) if head else ""
    except OSError:
        return ""


def commit_time(c) -> int:
    """Unix time of a commit of this repository (0 when it is not one)."""
    m = re.match(r"[0-9a-f]{7,40}", str(c or ""))
    if not m:
        return 0
    out = subprocess.run(["git", "show", "-s", "--format=%ct", m.group(0)], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    return int(out) if out.isdigit() else 0


def short_commit(c) -> str:
    """``da8f8b8...`` -> ``da8f8b8``; keeps ``-dirty`` and a trailing ``+`` (a working tree on top)."""
    if not c:
        return ""
    m = re.match(r"([0-9a-f]{7,40})(\+)?(-dirty)?", str(c))
    if not m:
        return str(c)
    return m.group(1)[:7] + (m.group(2) or "") + (m.group(3) or "")


def machine_words(m, fallback=None) -> str:
    """The machine in words from a benchmark's ``machine``/``provenance`` record: CPU model and the
    instruction sets that matter here (AMX, AVX-512 VNNI), and the kernels' cap where one was set
    (``isa_cap``: AVX2 code on an AVX-512 core is not an AVX2 machine's figure), or the GPU's name."""
    for cand in (m, fallback):
        if isinstance(cand, dict):
            if cand.get("gpu"):
                return str(cand["gpu"])
            if cand.get("device", "cpu") not in ("cpu", None) and "cpu" not in cand:
                return str(cand["device"])
            cpu = str(cand.get("cpu", "")).replace("(R)", "").replace(" Processor", "").strip()
            if cpu:
                flags = set(cand.get("cpu_flags", []))
                isa = ("AMX" if "amx_int8" in flags else "AVX-512 VNNI" if "avx512_vnni" in flags
                       else "AVX2" if "avx2" in flags else "")
                words = f"{cpu} ({isa})" if isa else cpu
                cap = cand.get("isa_cap")  # provenance.machine: the kernels capped, an emulation
                return f"{words}, {str(cap).upper()} code under VLLM_CSV_CPU_ISA={cap} (emulation)" if cap else words
    return "x86_64 CPU (model not recorded)"


def _threads(*ms) -> int | None:
    for m in ms:
        if isinstance(m, dict) and isinstance(m.get("threads"), int):
            return m["threads"]
    for m in ms:
        if isinstance(m, str):
            t = re.search(r"(\d+) thread", m)
            if t:
                return int(t.group(1))
    return None


def model_label(name) -> tuple[str, str]:
    """(label, V x d) of a model path or name: ``.../demo-79fe395bffd1`` -> ("demo", "65536x768")."""
    base = Path(str(name or "")).name
    m = re.search(r"v(\d+)-d(\d+)", base)
    if m:
        return re.sub(r"-[0-9a-f]{12}$", "", base), f"{m.group(1)}x{m.group(2)}"
    m = re.match(r"random-(\d+)x(\d+)", base)
    if m:
        return base, f"{m.group(1)}x{m.group(2)}"
    label = re.sub(r"-[0-9a-f]{12}$", "", base)
    return label, MODEL_SHAPES.get(label, "")


def _dtype(s) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(str(s), str(s or ""))


def _cfg(**kw) -> str:
    return " ".join(f"{k}={v}" for k, v in kw.items() if v not in (None, "", [], ()))


def _num(x):
    if isinstance(x, bool):
        return float(x)
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class _Rows(list):
    """Rows that share everything but the measurement (fills the common fields)."""

    def __init__(self, **common):
        super().__init__()
        self.common = common

    def add(self, metric, value, unit, baseline="", **kw):
        v = _num(value)
        if v is None:
            return
        self.append(Row(**{**self.common, **kw, "metric": metric, "value": v, "unit": unit,
                           "baseline": baseline}))


def _run_rows(benchmark: str, m, source: str, common: dict, **fixed) -> _Rows:
    """The rows of a run whose JSON names its machine, threads and commit in one dict ``m``."""
    return _Rows(benchmark=benchmark, machine=machine_words(m), threads=_threads(m),
                 commit=short_commit(m.get("commit") if isinstance(m, dict) else ""), source=source, **fixed,
                 **common)


# --------------------------------------------------------------------------- per benchmark


def rows_from_lm_head(d: dict, source: str, **common) -> list[Row]:
    m = d.get("machine", {})
    out = _run_rows("lm_head", m, source, common)
    for name, md in d.get("models", {}).items():
        label, shape = model_label(name)
        shape = f"{md['V']}x{md['d']}" if "V" in md else shape
        weights = "random" if str(md.get("weights", "")).startswith("random") else "learned"
        for screen, sd in md.get("screens", {}).items():
            cfg = _cfg(model=label, weights=weights, screen=screen)
            for b, bd in sd.items():
                if not isinstance(bd, dict):
                    continue
                kw = dict(config=cfg, shape=shape, batch=int(b), dtype=_dtype(md.get("dtype")))
                base = VLLM_HEAD if bd.get("dense_baseline") == "vllm" else FLINEAR
                out.add("speedup", bd.get("speedup_vs_dense"), "x", base, note=f"backend {sd.get('backend')}", **kw)
                out.add("csv_ms", bd.get("csv_ms"), "ms", **kw)
                out.add("dense_ms", bd.get("dense_ms"), "ms", note=f"dense = {bd.get('dense_baseline')}", **kw)
                out.add("certified_share", bd.get("certified_rate"), "share", **kw)
                out.add("scored_share_mean", bd.get("scored_fraction_mean"), "share of V", **kw)
                out.add("mismatches", bd.get("mismatches"), "rows", DENSE_HEAD, **kw)
    return out


def _dense_server(d: dict) -> str:
    """The baseline of a serving run: vLLM alone (``dense_plugin`` false, the default since the
    benchmarks set ``VLLM_PLUGINS``), a server given by URL, or, for runs recorded before the
    key existed, a dense server that loaded the plugin with CSV off."""
    dp = d.get("dense_plugin", True)
    if dp == "external":
        return "the dense server given by URL (its plugins unknown), same requests"
    return DENSE_SERVER if dp is False else DENSE_SERVER_PLUGIN


def _serve_shape(d: dict) -> str:
    for k in (d.get("csv_metrics") or {}):
        m = re.search(r'hidden_size="(\d+)".*vocab_size="(\d+)"', k)
        if m:
            return f"{m.group(2)}x{m.group(1)}"
    return model_label(d.get("model"))[1]


def rows_from_serve(d: dict, source: str, **common) -> list[Row]:
    prov = d.get("provenance")
    label = model_label(d.get("model") or "demo-")[0] if d.get("model") else "demo"
    flags = _cfg(interleave=d.get("interleave") or None, same_malloc=d.get("same_malloc") or None,
                 pairs=len(d["pairs"]) if isinstance(d.get("pairs"), list) else None,
                  control=d.get("control") or None, csv_first=d.get("csv_first") or None,
                 warmup_rounds=d.get("warmup_rounds") or None)
    vargs = " ".join(d.get("vllm_args") or [])
    if d.get("dense_args") is not None:  # the dense server ran other arguments (e.g. no speculation)
        vargs += f"' dense_args='{' '.join(d['dense_args'])}"
    baseline = _dense_server(d) if d.get("dense_args") is None else \
        f"plain `vllm serve` {' '.join(d['dense_args']) or '(no further arguments)'}, same model and requests"
    out = _Rows(benchmark="serve", machine=machine_words(prov, d.get("machine")),
                threads=_threads(prov, d.get("machine")), commit=short_commit(d.get("commit")),
                shape=_serve_shape(d), batch=d.get("prompts"), dtype="", source=source, **common)
    for w, wd in (d.get("workloads") or {}).items():
        cfg = _cfg(model=label, workload=w) + (" " + flags if flags else "") + (f" vllm_args='{vargs}'" if vargs else "")
        out.add("tokens_per_s_ratio", wd.get("speedup"), "x", baseline, config=cfg,
                note="median of per-pair/round ratios" if ("speedup_by_pair" in wd or "speedup_by_round" in wd) else "")
        out.add("csv_tokens_per_s", wd.get("csv_tokens_per_s"), "tokens/s", config=cfg)
        out.add("dense_tokens_per_s", wd.get("dense_tokens_per_s"), "tokens/s", config=cfg)
        out.add("identical_outputs", wd.get("identical_outputs"), "bool", baseline, config=cfg)
    cfg = _cfg(model=label, workload="all") + (" " + flags if flags else "") + (f" vllm_args='{vargs}'" if vargs else "")
    out.add("certified_share_of_csv_rows", d.get("certified_share_of_csv_rows"), "share", config=cfg)
    sd = d.get("spec_decode")
    if sd:  # speculative decoding: vLLM's acceptance on each side
        for side in ("dense", "csv"):
            out.add(f"{side}_acceptance_rate", (sd.get(side) or {}).get("acceptance_rate"), "share", config=cfg)
        out.add("identical_spec_counts", sd.get("identical"), "bool", baseline, config=cfg)
    out.add("head_speedup_on_csv_steps", d.get("head_speedup_on_csv_steps"), "x",
            "the plugin's dense-head estimate for the same steps (server metrics)", config=cfg)
    return out


def rows_from_sampler_step(d: dict, source: str, **common) -> list[Row]:
    if "runs" in d:  # several runs gathered in one file
        out = []
        # before/after runs interleaved in one file: the "after" version (or the later commit) last
        runs = sorted(d["runs"], key=lambda r: (r.get("version") != "before", commit_time(r.get("commit")),
                                                r.get("pass") or 0))
        for run in runs:
            res = run.get("result", run)
            note = " ".join(str(x) for x in (run.get("version"), run.get("pass") and f"pass {run['pass']}") if x)
            out += rows_from_sampler_step(res, source, note=note, **common)
        return out
    m = d.get("machine")
    label, shape = model_label(d.get("model"))
    modes = d.get("modes") or ["temperature", "top_p", "min_p", "penalties", "logit_bias"]
    modes = "+".join(modes.split() if isinstance(modes, str) else modes)
    cfg = _cfg(model=label, modes=modes, screen=d.get("screen"), budget=d.get("budget"),
               suppress=d.get("suppress") or None)
    out = _Rows(benchmark="sampler_step", machine=machine_words(m), threads=d.get("threads") or _threads(m),
                commit=short_commit(d.get("commit")), shape=shape, dtype="bf16", config=cfg, source=source,
                **common)
    for r in d.get("rows", []):
        kw = dict(batch=r.get("batch"))
        out.add("speedup", r.get("speedup"), "x", DENSE_STEP, **kw)
        out.add("csv_ms", r.get("csv_ms"), "ms", **kw)
        out.add("dense_ms", r.get("dense_ms"), "ms", **kw)
        out.add("certified_share", r.get("certified_share"), "share", **kw)
        out.add("mismatches", r.get("mismatches"), "rows", "vLLM's dense sampler, same seeds", **kw)
    return out


def rows_from_audit(d: dict, source: str, **common) -> list[Row]:
    prov = d.get("provenance")
    fams = sorted({c.get("family") for c in d.get("cases", []) if c.get("family")})
    dtypes = sorted({_dtype(c.get("dtype")) for c in d.get("cases", []) if c.get("dtype")})
    cfg = _cfg(screens="+".join(d.get("screens") or []),
               families=("+".join(d["families"]) if len(d["families"]) <= 3 else f"{len(d['families'])} families")
               if d.get("families") else ("all" if fams else None),
               flush_to_zero=d.get("flush_to_zero") or None,
               random_seeds=d.get("random_seeds") or None, verify_fused=d.get("verify_fused") or None)
    out = _Rows(benchmark="audit", machine=machine_words(prov, d.get("machine")),
                threads=_threads(prov, d.get("machine")), commit=short_commit(d.get("commit")),
                dtype="+".join(dtypes), config=cfg, source=source, **common)
    t = d.get("total", {})
    ran = {k for k in ("rows", "sampler_rows") if t.get(k, 1)}  # (a campaign of verifications alone skips both)
    for k in ("rows", "certified_ids", "certified_values", "certified_sampled", "sampler_rows", "certified_draws"):
        if ("sampler_rows" if k in ("sampler_rows", "certified_draws") else "rows") in ran:
            out.add(k, t.get(k), "rows" if k != "certified_draws" else "draws")
    for k in ("wrong_ids", "wrong_values", "wrong_tokens", "rng_out_of_step"):
        if ("sampler_rows" if k in ("wrong_tokens", "rng_out_of_step") else "rows") in ran:
            out.add(k, t.get(k), "rows" if k != "wrong_tokens" else "draws", DENSE_HEAD if k != "wrong_tokens"
                    else "vLLM's sampler on the dense logits, same seeds")
    if t.get("verify_requests"):  # (campaigns before the V2 verification audit have none)
        for k in ("verify_requests", "certified_verifications", "certified_verifications_probabilistic",
                  "verify_drafts_accepted", "verify_rejections"):
            out.add(k, t.get(k), "requests" if k != "verify_drafts_accepted" else "drafts")
        out.add("wrong_verifications", t.get("wrong_verifications"), "requests",
                "V2's verification replayed in float64 on the dense rows, same seeds")
    if t.get("v2_top_k_rows"):  # (campaigns before the V2 top-k audit have none)
        for k in ("v2_top_k_rows", "certified_v2_top_k", "v2_top_k_below_max"):
            out.add(k, t.get(k), "rows")
        out.add("wrong_v2_top_k", t.get("wrong_v2_top_k"), "rows",
                "the dense row masked to its top k, drawn in float64, same seeds")
    return out


def rows_from_tp_head(d: dict, source: str, **common) -> list[Row]:
    prov = d.get("provenance") or d.get("machine")
    label, _ = model_label(d.get("model"))
    out = _Rows(benchmark="tp_head", machine=machine_words(prov), threads=d.get("threads"),
                commit=short_commit(prov.get("commit") if isinstance(prov, dict) else ""),
                shape=f"{d['V']}x{d['d']}", dtype=_dtype(d.get("dtype")), source=source, **common)
    for tp, td in d.get("tp", {}).items():
        cfg = _cfg(model=label, tp=tp, mode=d.get("mode"), screen=d.get("screen"), temperature=d.get("temperature"))
        for b, bd in td.items():
            kw = dict(config=cfg, batch=int(b))
            out.add("speedup", bd.get("speedup_vs_dense"), "x", "dense head at the same TP size, same run", **kw)
            out.add("csv_ms", bd.get("csv_ms"), "ms", **kw)
            out.add("dense_ms", bd.get("dense_ms"), "ms", **kw)
            out.add("certified_share", bd.get("certified_share"), "share", **kw)
    return out


def rows_from_off_switch_cost(d: dict, source: str, **common) -> list[Row]:
    m = d.get("machine")
    label, shape = model_label(d.get("model"))
    s = d.get("sampling") or {}
    cfg = _cfg(model=label, sampling=",".join(f"{k}={v}" for k, v in s.items()) or "greedy", rounds=d.get("rounds"))
    out = _Rows(benchmark="off_switch_cost", machine=machine_words(m), threads=_threads(m),
                commit=short_commit(d.get("commit")), shape=shape, batch=d.get("sequences"), config=cfg,
                source=source, **common)
    v = d.get("versions", {})
    if d.get("count_calls"):  # (--count-calls: counts, no times)
        for ver in ("csv", "plan", "dense", "vllm"):
            out.add(f"{ver}_calls_per_step", v.get(ver, {}).get("calls_per_step"), "calls",
                    note="Python and built-in calls in the model step (sys.setprofile), averaged over its steps, each round's prefill included")
        a, b = v.get("csv", {}).get("calls_per_step"), v.get("vllm", {}).get("calls_per_step")
        if a is not None and b is not None:
            out.add("csv_calls_over_vllm", a - b, "calls", "vLLM alone (the plugin's wrappers bypassed), same engine, "
                    "interleaved rounds", note="difference of the file's calls a step")
        out.add("off_switch_times_tripped", (d.get("off_switch") or {}).get("times_tripped"), "count")
        return out
    for ver in ("csv", "plan", "dense", "vllm"):
        for part in ("step", "layer"):
            out.add(f"{ver}_{part}_median_ms", v.get(ver, {}).get(part, {}).get("median_ms"), "ms")
    for ver in ("csv", "plan"):
        a, b = (v.get(ver, {}).get("step", {}).get("median_ms"), v.get("dense", {}).get("step", {}).get("median_ms"))
        if a and b:
            out.add(f"{ver}_step_over_dense", a / b, "x", "vLLM's own LogitsProcessor.forward, same engine, "
                    "interleaved rounds", note="ratio of the file's step medians")
    a, b = (v.get("csv", {}).get("step", {}).get("median_ms"), v.get("vllm", {}).get("step", {}).get("median_ms"))
    if a and b:  # (files from before the vllm version have none)
        out.add("csv_step_over_vllm", a / b, "x", "vLLM alone: its layer, execute_model, compute_logits and "
                "Sampler.forward (the plugin's wrappers bypassed), same engine, interleaved rounds",
                note="ratio of the file's step medians")
    out.add("off_switch_times_tripped", (d.get("off_switch") or {}).get("times_tripped"), "count")
    return out


def rows_from_gpu_step(d: list, source: str, benchmark: str = "gpu_step", **common) -> list[Row]:
    """``gpu_step.py``'s rows, and ``gpu_learned.py``'s (the same form; ``head`` names the learned
    head, ``measure=train`` its training run)."""
    out = []
    for r in d:
        rs = _Rows(benchmark=benchmark, machine=str(r.get("device", "GPU")), commit=short_commit(r.get("commit")),
                   shape=f"{r['V']}x{r['d']}", batch=r.get("B"), dtype=_dtype(r.get("dtype")),
                   config=_cfg(head=r.get("head"), measure=r.get("measure")), source=source, **common)
        if r.get("measure") == "train":
            rs.add("val_loss", r.get("val_loss"), "nats")
            rs.add("train_seconds", r.get("seconds"), "s")
        elif str(r.get("measure", "")).startswith("diagnose"):  # gpu_learned's estimates
            for k, v in r.items():
                if k.endswith(("_p50", "_p99")) or k.startswith("share_"):
                    unit = ("share" if k.startswith("share_") else "tokens" if k.startswith("tokens")
                            else "blocks" if k.startswith("blocks") else "ratio" if k.startswith(("peak", "radius"))
                            else "logit")
                    rs.add(k, v, unit)
        elif "ms" in r:
            rs.add("us", r["ms"] * 1000, "us")
            base = CUBLAS_SYNC if r.get("baseline") == "dense_sync" else CUBLAS
            if r.get("measure") not in ("dense",):
                rs.add("speedup", r.get("speedup_vs_baseline"), "x", base)
            rs.add("certified_share", r["certified"] / r["rows"] if r.get("rows") else None, "share")
            if r.get("measure") == "step_pdl":  # (gpu_step --pdl: its outputs against the step's)
                rs.add("differs", r.get("pdl_differs"), "flag", "the same step launched without PDL")
        else:  # an exactness audit
            rs.add("rows", r.get("rows"), "rows")
            rs.add("certified", r.get("certified"), "rows")
            rs.add("mismatches", r.get("mismatches"), "rows", "cuBLAS bf16 dense head, same batch")
        out += rs
    return out


def rows_from_v2_sampler_gpu(d: dict, source: str, **common) -> list[Row]:
    out = _Rows(benchmark="v2_sampler_gpu", machine=str(d.get("device", "GPU")), commit=short_commit(d.get("commit")),
                shape=f"{d['vocab']}x{d['hidden']}", dtype="bf16",
                config=_cfg(screen=d.get("screen"), temperature=d.get("temperature"), weights="random"),
                source=source, **{**common, **({"date": d["date"]} if d.get("date") else {})})
    for r in d.get("rows", []):
        kw = dict(batch=r.get("batch"))
        out.add("speedup", r.get("speedup"), "x", V2_DENSE, **kw)
        out.add("csv_ms", r.get("csv_ms"), "ms", **kw)
        out.add("dense_ms", r.get("dense_ms"), "ms", **kw)
        out.add("certified_share", r.get("certified_share"), "share", **kw)
    return out


def rows_from_v2_verify_gpu(d: dict, source: str, **common) -> list[Row]:
    """``v2_verify_gpu.py``: per (requests, temperature, draft kind) the certified verification's
    speed-up over the dense head of the same rows, the times, the certified share of requests and
    the tokens scored, for the reference path and (``_fused``) the device path."""
    out = _Rows(benchmark="v2_verify_gpu", machine=str(d.get("device", "GPU")), commit=short_commit(d.get("commit")),
                shape=f"{d['vocab']}x{d['hidden']}", dtype="bf16", source=source, **common)
    for r in d.get("rows", []):
        kw = dict(batch=r.get("rows"), config=_cfg(screen=d.get("screen"), weights="random", requests=r.get("requests"),
                                                   drafts=d.get("drafts"), temperature=r.get("temperature"),
                                                   draft_kind="probabilistic" if r.get("probabilistic") else "one-hot"))
        out.add("dense_ms", r.get("dense_ms"), "ms", **kw)
        for sfx in ("", "_fused"):  # the reference path, the device path (one-hot drafts)
            out.add(f"speedup{sfx}", r.get(f"speedup{sfx}"), "x", V2_VERIFY_DENSE, **kw)
            out.add(f"csv{sfx}_ms", r.get(f"csv{sfx}_ms"), "ms", **kw)
            out.add(f"certified_share{sfx}", r.get(f"certified_share{sfx}"), "share of requests", **kw)
            out.add(f"scored{sfx}", r.get(f"scored{sfx}"), "tokens", **kw)
    return out


def rows_from_v2_fused_draw(d: dict, source: str, **common) -> list[Row]:
    """``v2_fused_draw_gpu.py``: per (V x d, B, T, grammar) the dense V2 step's time, each fused
    draw's speed-up over it, and each candidate cap's certified share and mismatches."""
    out = _Rows(benchmark="v2_fused_draw", machine=str(d.get("device", "GPU")), commit=short_commit(d.get("commit")),
                dtype="bf16", source=source, **common)
    weights = "random" if str(d.get("head", "")).startswith("peaked") else d.get("head")
    for r in d.get("rows", []):
        kw = dict(shape=f"{r['V']}x{r['d']}", batch=r.get("batch"),
                  config=_cfg(weights=weights, temperature=r.get("temperature"), grammar=r.get("grammar") or None,
                              bias=r.get("bias") or None))
        out.add("dense_ms", r.get("dense_ms"), "ms", **kw)
        for k, v in r.items():
            if k.startswith("speedup_"):
                out.add(k, v, "x", V2_DENSE, **kw)
            elif k.startswith("certified_c"):
                out.add(f"certified_share_{k[len('certified_'):]}", v, "share", **kw)
            elif k.startswith("mismatches_c"):
                out.add(k, v, "rows", "vLLM V2 gumbel_sample on the cuBLAS logits, same batch", **kw)
    return out


def rows_from_v2_draw_breakdown(d: dict, source: str, **common) -> list[Row]:
    """The V2 device draw's kernels one at a time (``{"device", "commit", "rows": [{V, d, B,
    <kernel>: us}]}``), each CUDA-graph replayed alone, beside cuBLAS's ``F.linear``."""
    out = _Rows(benchmark="v2_draw_breakdown", machine=str(d.get("device", "GPU")),
                commit=short_commit(d.get("commit")), dtype="bf16", source=source, **common)
    for r in d.get("rows", []):
        for k, v in r.items():
            if k not in ("V", "d", "B"):
                out.add(k, v, "us", shape=f"{r['V']}x{r['d']}", batch=r.get("B"),
                        config=_cfg(weights="random", temperature=1.0, cap=16))
    return out


def rows_from_outlier_channels(d: dict, source: str, **common) -> list[Row]:
    m = d.get("machine")
    label, _ = model_label(d.get("model"))
    out = _run_rows("outlier_channels", m, source, common, shape=f"{d['V']}x{d['d']}", dtype="bf16")
    for r in d.get("rows", []):
        if "scored_share" not in r:
            continue
        kw = dict(config=_cfg(model=label, screen=r.get("screen"), channel_factor=r.get("factor")), batch=r.get("B"))
        out.add("scored_share", r.get("scored_share"), "share of V", **kw)
        out.add("certified_share", r["certified"] / r["rows"] if r.get("rows") else None, "share", **kw)
    for r in d.get("rows", []):  # timing rows, if any
        for k, v in r.items():
            if k.endswith("_ms"):
                out.add(k, v, "ms", config=_cfg(model=label, screen=r.get("screen"), channel_factor=r.get("factor")),
                        batch=r.get("B"))
    return out


def rows_from_load(d: dict, source: str, **common) -> list[Row]:
    m = d.get("machine")
    shape = _serve_shape(d.get("csv") or {}) or (model_label(d["model"])[1] if d.get("model") else "")
    out = _run_rows("load", m, source, common, shape=shape, batch=d.get("clients"),
                    config=_cfg(model=model_label(d["model"])[0] if d.get("model") else None,
                                seconds=d.get("seconds")))
    c, dn = d.get("csv", {}), d.get("dense", {})
    if c.get("tokens_per_s") and dn.get("tokens_per_s"):
        out.add("tokens_per_s_ratio", c["tokens_per_s"] / dn["tokens_per_s"], "x", _dense_server(d),
                note="ratio of the file's csv and dense tokens/s")
    for side, sd in (("csv", c), ("dense", dn)):
        out.add(f"{side}_tokens_per_s", sd.get("tokens_per_s"), "tokens/s")
        out.add(f"{side}_errors", sd.get("errors"), "requests")
        for k in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"):
            out.add(f"{side}_{k}", sd.get(k), "ms")
        out.add(f"{side}_rss_growth_second_half", sd.get("rss_growth_second_half"), "share")
    det = d.get("deterministic") if isinstance(d.get("deterministic"), dict) else {}
    out.add("deterministic_compared", det.get("compared"), "responses")
    out.add("deterministic_differing", det.get("differing"), "responses", _dense_server(d))
    return out


def rows_from_int8_gemm_cpu(d: dict, source: str, **common) -> list[Row]:
    m = d.get("machine")
    out = _run_rows("int8_gemm_cpu", m, source, common, dtype="int8")
    for r in d.get("rows", []):
        kw = dict(shape=f"{r['V']}x{r['d']}", batch=r.get("B"), config=f"kernel={r.get('kernel', 'vnni')}",
                  note=(m or {}).get("emulation", ""), **({"threads": r["threads"]} if r.get("threads") else {}),
                  **({"machine": machine_words(m) + ", AVX2 code under VLLM_CSV_CPU_ISA=avx2 (emulation)"}
                     if (m or {}).get("emulation") else {}))
        if r.get("fbgemm_ms") and r.get("vnni_ms"):
            out.add("speedup", r["fbgemm_ms"] / r["vnni_ms"], "x", FBGEMM, **{**kw, "note": "ratio of the file's medians " + kw["note"]})
        if r.get("fbgemm_block_max_ms") and r.get("vnni_block_max_ms"):  # the screen's call: y and block maxima
            out.add("speedup_with_block_max", r["fbgemm_block_max_ms"] / r["vnni_block_max_ms"], "x",
                    FBGEMM + " + block-max pass", **kw)
        out.add("vnni_ms", r.get("vnni_ms"), "ms", **kw)
        out.add("fbgemm_ms", r.get("fbgemm_ms"), "ms", **kw)
        out.add("bit_identical", r.get("bit_identical"), "bool", FBGEMM, **kw)
    return out


def rows_from_prefetch_cpu(d: dict, source: str, **common) -> list[Row]:
    m = d.get("machine")
    out = _run_rows("prefetch_cpu", m, source, common)
    for r in d.get("rows", []):
        kw = dict(shape=f"{r['V']}x{r['d']}", batch=r.get("B"), dtype=r.get("kernel", ""),
                  config=_cfg(kernel=r.get("kernel"), backend=r.get("backend"), prefetch_bytes=d.get("prefetch_bytes")))
        if r.get("prefetch_ms") and r.get("none_ms"):
            out.add("speedup", r["none_ms"] / r["prefetch_ms"], "x", NO_PREFETCH, note="ratio of the file's medians", **kw)
        out.add("prefetch_ms", r.get("prefetch_ms"), "ms", **kw)
        out.add("none_ms", r.get("none_ms"), "ms", **kw)
        out.add("bit_identical", r.get("bit_identical"), "bool", NO_PREFETCH, **kw)
    return out


def rows_from_tail_bound(d: dict, source: str, **common) -> list[Row]:
    m = d.get("machine")
    out = _run_rows("tail_bound", m, source, common, dtype="fp32")
    for case in ("peaked_random", "learned"):
        c = d.get(case)
        if not isinstance(c, dict):
            continue
        shape = f"{c['V']}x{c['d']}"
        for k, v in (c.get("survivors") or {}).items():
            out.add("survivors_share", v, "share of V", config=_cfg(case=case, k_over_d=k), shape=shape)
        out.add("top_cosine", c.get("top_cosine"), "cosine", config=_cfg(case=case), shape=shape)
    return out


def rows_from_hidden_rank(d: dict, source: str, **common) -> list[Row]:
    """``hidden_rank.py``: per model and ``k``, the share of the held-out hidden states' energy in
    their top ``k`` directions, the median share of ``||h||`` left outside them, and the median share
    of the vocabulary a screen over them would leave to score."""
    prov = d.get("machine")
    out = _Rows(benchmark="hidden_rank", machine=machine_words(prov), threads=_threads(prov),
                commit=short_commit((prov or {}).get("commit")), dtype="fp32", source=source, **common)
    for m in d.get("models", []):
        label, _ = model_label(m["model"])
        for k, v in m.get("k", {}).items():
            kw = dict(shape=m["shape"], config=_cfg(model=label, k=k, positions=m.get("positions")))
            out.add("energy_in_top_k", v.get("energy_fit"), "share", **kw)
            out.add("rest_norm_median", v.get("rest_norm_median"), "share of ||h||", **kw)
            out.add("vocab_left_median", v.get("left_median"), "share of V", **kw)
    return out


def rows_from_v2_top_share(d: dict, source: str, **common) -> list[Row]:
    """``v2_top_share.py``: per temperature, the share of rows the V2 hook certifies drawn plainly,
    masked with a top-p (any mask: the maximum's rule) and masked with a top-k alone (each ``k``),
    the share whose drawn token is the row's argmax, and the share whose drawn token ranks below
    ``k``."""
    from pathlib import Path as _P

    prov = d.get("machine")
    label = _P(d["model"]).name.rsplit("-", 1)[0]
    out = _Rows(benchmark="v2_top_share", machine=machine_words(prov), threads=_threads(prov),
                commit=short_commit((prov or {}).get("commit")), dtype=d.get("dtype", "bf16"), source=source,
                shape=f"{d['V']}x{d['d']}", batch=d.get("batch"), **common)
    for c in d.get("cells", []):
        cfg = dict(model=label, screen=d.get("screen"), temperature=c["temperature"], positions=d.get("positions"))
        out.add("certified_share", c["certified_share"], "share of rows",
                config=_cfg(mode=c["mode"], top_k=c.get("top_k"), **cfg))
        if c["mode"] == "masked":
            out.add("drawn_at_argmax_share", c["drawn_at_argmax_share"], "share of rows", config=_cfg(**cfg))
        if c["mode"] == "top_k":
            out.add("drawn_ranked_below_k_share", c["drawn_below_k_share"], "share of rows",
                    config=_cfg(top_k=c["top_k"], **cfg))
            out.add("wrong_certified_rows", c["wrong"], "rows", config=_cfg(top_k=c["top_k"], **cfg),
                    note="certified tokens other than the draw from the dense row masked to its top k (float64)")
    return out


def rows_from_row_walk(d: dict, source: str, **common) -> list[Row]:
    """``row_walk.py``: the cross-module calls of the deferred rows through V1's sampler hook, the
    modules entered, and the stages (modules that enter another product module, the kernels'
    ``ops.*`` not counted) entered more than once within one phase, summed over the phases."""
    a = d["args"]
    out = _Rows(benchmark="row_walk", machine=machine_words(d.get("machine")), threads=_threads(d.get("machine")),
                commit=short_commit((d.get("machine") or {}).get("commit")), dtype="bf16", batch=a["rows"],
                source=source, config=_cfg(family=a["family"], rows=a["rows"], seed=a["seed"] or None,
                                            screen=a["screen"], sampler="vLLM V1"), **common)
    what = "cross-module calls of the deferred rows through the V1 sampler hook (benchmarks/row_walk.py)"
    out.add("module_entries", sum(d["entries"].values()), "calls", note=what)
    out.add("modules_entered", len(d["entries"]), "modules", note=what)
    out.add("stages_repeated_in_a_phase", sum(len(r) for r in d["repeated_stages"].values()), "modules",
            note="modules that enter another product module (ops.* kernels not counted), entered more than once "
                 "within one phase (setup, a round, finish), summed over phases")
    return out


CONVERTERS = {
    "lm_head": rows_from_lm_head, "serve": rows_from_serve, "sampler_step": rows_from_sampler_step,
    "audit": rows_from_audit, "tp_head": rows_from_tp_head, "off_switch_cost": rows_from_off_switch_cost,
    "gpu_step": rows_from_gpu_step, "v2_sampler_gpu": rows_from_v2_sampler_gpu, "v2_verify_gpu": rows_from_v2_verify_gpu,
    "gpu_learned": lambda d, source, **c: rows_from_gpu_step(d, source, benchmark="gpu_learned", **c),
    "v2_fused_draw": rows_from_v2_fused_draw, "v2_draw_breakdown": rows_from_v2_draw_breakdown,
    "outlier_channels": rows_from_outlier_channels, "load": rows_from_load,
    "int8_gemm_cpu": rows_from_int8_gemm_cpu, "prefetch_cpu": rows_from_prefetch_cpu,
    "tail_bound": rows_from_tail_bound, "hidden_rank": rows_from_hidden_rank,
    "v2_top_share": rows_from_v2_top_share, "row_walk": rows_from_row_walk,
}


def _source(source) -> str:
    """A results file inside the repository by its repository path, else the command that ran."""
    if source:
        p = Path(source).resolve()
        try:
            return str(p.relative_to(ROOT))
        except ValueError:
            pass
    argv = [Path(sys.argv[0]).name if i == 0 else a for i, a in enumerate(sys.argv)]
    return "command: benchmarks/" + " ".join(argv)


def record_run(benchmark: str, result, source=None, path=None) -> int:
    """Append a finished run's rows to the table: ``result`` is the JSON the benchmark wrote, converted
    by ``CONVERTERS[benchmark]``; the date is today, the commit the checked-out one where the result
    names none. Never fails the benchmark: a problem is printed and nothing is written."""
    if table_path(path) is None:
        return 0
    try:
        rows = CONVERTERS[benchmark](result, _source(source), date=_dt.date.today().isoformat())
        head = git_commit()
        rows = [r if r.commit else r.model_copy(update={"commit": head}) for r in rows]
        n = append(rows, path)
        print(f"[record] {n} rows appended to {table_path(path)}")
        return n
    except Exception as e:  # noqa: BLE001 - recording must not lose the run's own output
        print(f"[record] not recorded ({type(e).__name__}: {e})", file=sys.stderr)
        return 0
