"""One-shot: build ``benchmarks/results/results.csv`` from the result files recorded before the table
existed (kept for the record of how the table's first rows were made; benchmarks now append their
own rows through ``record.record_run``).

    PYTHONPATH=. python benchmarks/results_convert.py [--out benchmarks/results/results.csv]

Each JSON goes through its benchmark's ``record.rows_from_*``; the date of a row is the day its file
was added to the repository (``git log --diff-filter=A``), and files are converted in the order
they were recorded (then by the commit they measured), so that the last row of a measurement is
the latest. Prints the files it could not read into rows, and why.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

RESULTS = record.ROOT / "benchmarks" / "results"

# file name prefix -> benchmark (longest first)
PREFIXES = [("audit_sampler", "audit"), ("audit", "audit"), ("gpu/gpu_step", "gpu_step"),
            ("int8_gemm_cpu", "int8_gemm_cpu"), ("lm_head", "lm_head"), ("load_", "load"),
            ("off_switch_cost", "off_switch_cost"), ("outlier_channels", "outlier_channels"),
            ("prefetch_cpu", "prefetch_cpu"), ("sampler_step", "sampler_step"), ("serve_", "serve"),
            ("tail_bound", "tail_bound"), ("tp_head", "tp_head"), ("tp_sampler", "tp_head"),
            ("v2_sampler_gpu", "v2_sampler_gpu")]


def git(*args) -> str:
    return subprocess.run(["git", *args], cwd=record.ROOT, capture_output=True, text=True).stdout.strip()


def added(path: Path) -> tuple[int, str]:
    """(unix time, date) of the commit that added ``path``."""
    out = git("log", "--diff-filter=A", "--follow", "--format=%ct %cs", "--", str(path.relative_to(record.ROOT)))
    t, day = out.splitlines()[-1].split()
    return int(t), day


def commit_time(c: str) -> int:
    m = re.match(r"[0-9a-f]{7,40}", c or "")
    out = git("show", "-s", "--format=%ct", m.group(0)) if m else ""
    return int(out) if out.isdigit() else 0


def rows_from_screen_kernels_md(path: Path, source: str, **common) -> list[record.Row]:
    """``gpu/screen_kernels_<gpu>_<commit>.md``: its markdown table (ms per column)."""
    gpu = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}[re.search(r"_(h\d00)_", path.name).group(1)]
    rs = record._Rows(benchmark="screen_kernels", machine=gpu, commit=re.search(r"_([0-9a-f]{7})\.md$", path.name)
                      .group(1), dtype="bf16", source=source, **common)
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("|")]
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    for ln in lines[2:]:
        cells = dict(zip(head, (c.strip() for c in ln.strip("|").split("|"))))
        kw = dict(shape=f"{cells['V']}x{cells['d']}", batch=int(cells["B"]))
        dense = float(cells["dense bf16 ms"])
        for col, cfg in (("dense bf16 ms", "dense"), ("int8 GEMM ms", "int8_gemm"),
                         ("quantise h + GEMM ms", "quantise_and_gemm"), ("CSV step ms", "csv_step")):
            rs.add("ms", cells[col], "ms", config=f"measure={cfg}", **kw)
        rs.add("speedup", dense / float(cells["CSV step ms"]), "x", "dense bf16 F.linear (cuBLAS), same run",
               config="measure=csv_step", note="ratio of the file's columns", **kw)
    return rs


def rows_from_pytest_log(path: Path, source: str, **common) -> list[record.Row]:
    """``gpu/pytest_*_<gpu>_<commit>.log``: the passed/failed counts of the GPU test run."""
    text = path.read_text()
    m = re.search(r"(\d+) passed", text)
    rs = record._Rows(benchmark="gpu_tests", machine="NVIDIA H100 80GB HBM3",
                      commit=re.search(r"_([0-9a-f]{7})\.log$", path.name).group(1),
                      config=f"run={path.stem.rsplit('_', 2)[0]}", source=source, **common)
    rs.add("passed", m.group(1) if m else None, "tests")
    f = re.search(r"(\d+) failed", text)
    rs.add("failed", f.group(1) if f else 0, "tests")
    return rs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(record.TABLE))
    args = p.parse_args()
    files = sorted(f for f in RESULTS.rglob("*") if f.is_file() and f.name != "results.csv")
    jobs, skipped = [], []
    for f in files:
        rel = f.relative_to(RESULTS).as_posix()
        src = str(f.relative_to(record.ROOT))
        t, day = added(f)
        if f.suffix == ".json":
            bench = next((b for pre, b in PREFIXES if rel.startswith(pre)), None)
            if bench is None:
                skipped.append((src, "no converter for this benchmark"))
                continue
            try:
                data = json.loads(f.read_text())
            except ValueError as e:
                skipped.append((src, f"not JSON: {e}"))
                continue
            mc = data.get("commit") if isinstance(data, dict) else data[0].get("commit")
            if isinstance(data, dict) and not mc:
                mc = (data.get("machine") or {}).get("commit") if isinstance(data.get("machine"), dict) else ""
            jobs.append(((t, commit_time(mc or ""), "before" not in rel, rel), src, day,
                         lambda data=data, bench=bench, src=src, day=day: record.CONVERTERS[bench](data, src, date=day)))
        elif rel.startswith("gpu/screen_kernels_") and f.suffix == ".md":
            jobs.append(((t, 0, True, rel), src, day, lambda f=f, src=src, day=day: rows_from_screen_kernels_md(f, src, date=day)))
        elif rel.startswith("gpu/pytest_") and f.suffix == ".log":
            jobs.append(((t, 0, True, rel), src, day, lambda f=f, src=src, day=day: rows_from_pytest_log(f, src, date=day)))
        elif f.suffix == ".md" and f.with_suffix(".json").exists():
            continue  # the rendering of a JSON beside it
        elif f.suffix == ".log" or f.suffix == ".png":
            continue  # server/run logs and plots: no measurements of their own
        else:
            skipped.append((src, "prose or a table without a JSON beside it: not converted"))
    out = Path(args.out)
    if out.exists():
        out.unlink()
    n = 0
    for _, src, _, make in sorted(jobs, key=lambda j: j[0]):
        try:
            rows = make()
        except Exception as e:  # noqa: BLE001
            skipped.append((src, f"{type(e).__name__}: {e}"))
            continue
        if not rows:
            skipped.append((src, "no measurement in it"))
            continue
        if any(not r.commit for r in rows):  # the file names no commit: say which one added it
            sha = git("log", "--diff-filter=A", "--format=%h", "--abbrev=7", "--", src).splitlines()[-1]
            rows = [r if r.commit else r.model_copy(update={"note": "; ".join(
                x for x in (r.note, f"commit not recorded; file added in {sha}") if x)}) for r in rows]
        n += record.append(rows, out)
    print(f"{n} rows from {len(jobs)} files -> {out}")
    for src, why in skipped:
        print(f"not converted: {src}: {why}")


if __name__ == "__main__":
    main()
