"""Adversarial campaign: hostile heads and hidden states until at least ``--rows`` certified
rows have been checked against the dense head of the same batch.

    python benchmarks/audit.py --rows 1000000 --json benchmarks/results/audit.json
    python benchmarks/audit.py --rows 300000 --random-seeds 1 --json out.json   # seeds drawn at random

Families, checks and regressions are those of :mod:`vllm_csv.audit` (the CI suite
``tests/test_audit.py`` draws from the same). Cases cycle through every family x dtype
(bf16, fp16, fp32) x screen (int8, int4, fp16, ball) with increasing seeds. Each case runs
twice: ids only (``values=False``: greedy), and ids with value bits (``values=True``: top-k
sampling reads the values; fp32 heads never certify values, by design). Writes JSON and a
markdown table per family, dtype and screen: rows, certified rows in each mode, wrong ids,
wrong values. The campaign is deterministic (seeded); it is a check, not a timing.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_csv.audit import DTYPES, FAMILIES, run_case, run_sampled_case  # noqa: E402

from provenance import commit, machine  # noqa: E402  (benchmarks/provenance.py)

SCREENS = ("int8", "int4", "fp16", "ball")
FIELDS = ("rows", "certified_ids", "certified_values", "certified_sampled", "wrong_ids", "wrong_values")


def campaign(target: int, screens, log_every: float = 30.0, random_seeds: int | None = None) -> dict:
    """Cases seed by seed (0, 1, 2, ...; with ``random_seeds``, the i-th seed is drawn from
    ``random.Random(random_seeds)``: a reproducible sweep of seeds anywhere in ``[0, 2^31)``)."""
    table: dict[tuple[str, str, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
    total = dict.fromkeys(FIELDS, 0)
    t0 = last = time.perf_counter()
    rng = None if random_seeds is None else random.Random(random_seeds)
    seed = 0
    while total["certified_ids"] < target:
        case_seed = seed if rng is None else rng.randrange(2**31)
        for fam in FAMILIES:
            for dt in DTYPES:
                for sc in screens:
                    a, b = run_case(fam, case_seed, dt, sc)
                    c = run_sampled_case(fam, case_seed, dt, sc) if sc != "ball" else None
                    row = table[(fam, str(dt).removeprefix("torch."), sc)]
                    for t in (row, total):
                        t["rows"] += a.rows
                        t["certified_ids"] += a.certified
                        t["certified_values"] += b.certified
                        t["wrong_ids"] += a.wrong_ids + b.wrong_ids
                        t["wrong_values"] += b.wrong_values
                        if c is not None:  # sampled top-k rows (vLLM's kept set after the temperature)
                            t["rows"] += c.rows
                            t["certified_sampled"] += c.certified
                            t["wrong_ids"] += c.wrong_ids
                            t["wrong_values"] += c.wrong_values
        seed += 1
        if time.perf_counter() - last > log_every:
            last = time.perf_counter()
            print(f"  seed {seed}: {total}", file=sys.stderr)
    return {"seeds": seed, "seconds": round(time.perf_counter() - t0, 1), "total": total,
            "cases": [{"family": f, "dtype": d, "screen": s, **v} for (f, d, s), v in sorted(table.items())]}


def markdown(res: dict) -> str:
    t = res["total"]
    lines = [f"Adversarial campaign: {res['seeds']} seeds x {len(FAMILIES)} families x {len(DTYPES)} dtypes "
             f"x {len(res['screens'])} screens, {res['seconds']} s on {res['machine']} (commit {res['commit']}).", "",
             f"**Total: {t['certified_ids']} certified rows checked for ids, {t['certified_values']} for ids and "
             f"value bits, {t['certified_sampled']} sampled top-k rows for the sampler's kept set and bits, of "
             f"{t['rows']} rows; {t['wrong_ids']} wrong ids, {t['wrong_values']} wrong values.**", "",
             "| family | dtype | rows | certified (ids) | certified (ids + values) | certified (sampled) | wrong ids | wrong values |",
             "|---|---|---|---|---|---|---|---|"]
    agg: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
    for c in res["cases"]:
        for k in FIELDS:
            agg[(c["family"], c["dtype"])][k] += c[k]
    for (f, d), v in sorted(agg.items()):
        lines.append(f"| {f} | {d} | {v['rows']} | {v['certified_ids']} | {v['certified_values']} | "
                     f"{v['certified_sampled']} | {v['wrong_ids']} | {v['wrong_values']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="certified rows (ids mode) to check")
    p.add_argument("--screens", nargs="+", default=list(SCREENS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--random-seeds", type=int, default=None, metavar="N",
                   help="draw each case seed from random.Random(N) instead of 0, 1, 2, ...")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = campaign(args.rows, args.screens, random_seeds=args.random_seeds)
    res.update(screens=args.screens, random_seeds=args.random_seeds, commit=commit(), torch=torch.__version__, provenance=machine(),
               machine=f"{platform.machine()}, {args.threads} thread(s)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    md = markdown(res)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 1 if res["total"]["wrong_ids"] or res["total"]["wrong_values"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
