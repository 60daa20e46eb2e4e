"""How a row certified in vLLM's sampler walks through the product's modules (issue 43):
:mod:`vllm_csv.testing.row_walk` records the walk; this prints it.

Prints, per module, how many times the walk entered it, and the total (the issue counted 61
entries into 11 modules before the redesign); then, for each phase of the walk (setup, each
round, finish), the stages (modules that enter another product module) entered more than once in
it, with the functions entered; ``--json`` writes all of them (and the counts' rows to
``benchmarks/results/results.csv``).

    python benchmarks/row_walk.py --family peaked --rows 1
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from vllm_csv.testing.row_walk import phases, repeated_stages, stages, walk

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import machine  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="peaked")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--screen", default="int8")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    entries = walk(a.family, a.seed, a.rows, a.screen)
    count = collections.Counter(mod for mod, _, _ in entries)
    for mod, n in count.most_common():
        print(f"{n:5d}  {mod}")
    print(f"{sum(count.values()):5d}  entries into {len(count)} modules")
    # each phase: the stages entered more than once in it (what "each module once" leaves, phase by phase)
    stage = stages(entries)
    repeats = repeated_stages(entries)
    for name, part in phases(entries):
        print(f"{name}: {len(part)} entries, stages entered more than once: "
              + (", ".join(f"{m.removeprefix('vllm_csv.')} ({' '.join(fs)})" for m, fs in repeats[name].items())
                 or "none"))
    if a.json:
        out = {"args": vars(a), "entries": dict(count), "order": [mod for mod, _, _ in entries],
               "calls": [list(e) for e in entries], "stages": sorted(stage), "repeated_stages": repeats,
               "machine": machine()}
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        from record import record_run

        record_run("row_walk", out, source=a.json)

if __name__ == "__main__":
    main()
