"""Adversarial campaign: hostile heads and hidden states until at least ``--rows`` certified
rows have been checked against the dense head of the same batch.

    python benchmarks/audit.py --rows 1000000 --json benchmarks/results/audit.json
    python benchmarks/audit.py --rows 300000 --random-seeds 1 --json out.json   # seeds drawn at random
    python benchmarks/audit.py --flush-to-zero --families subnormal accumulator --json out.json

Families, checks and regressions are those of :mod:`vllm_csv.testing.audit` (the CI suite
``tests/test_audit.py`` draws from the same). Cases cycle through every family x dtype
(bf16, fp16, fp32) x screen (int8, int4, fp16, ball) with increasing seeds. Each case runs
twice: ids only (``values=False``: greedy), and ids with value bits (``values=True``: top-k
sampling reads the values; fp32 heads never certify values, by design). Writes JSON and a
markdown table per family, dtype and screen: rows, certified rows in each mode, wrong ids,
wrong values. Until ``--sampler-rows`` rows are certified there too, each case also runs as a
batch drawn by vLLM's own ``Sampler`` through the sampler hook, every row with its own sampling
parameters (greedy, temperature, top-k, top-p, min-p and their mixes; penalties, logit bias,
allowed ids, bad words and grammar masks by batch: :mod:`vllm_csv.testing.audit_sampler`), against the
same ``Sampler`` on the dense head: wrong tokens (any row) and RNG streams out of step. Until
``--verify-requests`` requests are certified, each case with the int8 and fp16 screens also
runs as sampled requests under V2's speculative verification (one-hot drafts, and on odd seeds
probabilistic ones; on half the seeds min-p on half the requests: :mod:`vllm_csv.testing.audit_verify`), each certified request's accepted drafts and next token
checked against V2's verification replayed in float64 on the dense rows. ``--verify-fused``: the
verifications on the device path instead (:mod:`vllm_csv.sampling.verify_v2_fused`, its kernels'
torch references on a CPU; int8 screen). Until ``--v2-top-k-rows`` rows are certified, each case with
those screens also runs as V2 temperature rows with a top-k alone, on some a min-p
(:mod:`vllm_csv.testing.audit_draw_v2`), each certified row's token checked against the draw from
the dense row masked to its top k, replayed in float64. The campaign is
deterministic (seeded); it is a check, not a timing.
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

from vllm_csv.testing.audit import DTYPES, FAMILIES, flush_to_zero, run_case, run_sampled_case
from vllm_csv.testing.audit_draw_v2 import run_top_k_draw_case
from vllm_csv.testing.audit_sampler import run_sampler_case
from vllm_csv.testing.audit_verify import run_verify_case

from provenance import commit, machine  # (benchmarks/provenance.py)

SCREENS = ("int8", "int4", "fp16", "ball")
FIELDS = ("rows", "certified_ids", "certified_values", "certified_sampled", "wrong_ids", "wrong_values",
          "sampler_rows", "certified_draws", "wrong_tokens", "rng_out_of_step", "verify_requests",
          "certified_verifications", "certified_verifications_probabilistic", "verify_drafts_accepted",
          "verify_rejections", "wrong_verifications", "v2_top_k_rows", "certified_v2_top_k", "v2_top_k_below_max",
          "wrong_v2_top_k")
VERIFY_SCREENS = ("int8", "fp16")  # the screens the CUDA head runs (V2's verification is CUDA's)


def campaign(target: int, screens, log_every: float = 30.0, random_seeds: int | None = None,
             sampler_target: int = 0, families=None, verify_target: int = 0, verify_fused: bool = False,
             top_k_target: int = 0) -> dict:
    """Cases seed by seed (0, 1, 2, ...; with ``random_seeds``, the i-th seed is drawn from
    ``random.Random(random_seeds)``: a reproducible sweep of seeds anywhere in ``[0, 2^31)``).
    ``verify_fused``: the verifications on the device path instead (int8 screen:
    :func:`~vllm_csv.sampling.verify_v2_fused.verify_fused`)."""
    table: dict[tuple[str, str, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
    total = dict.fromkeys(FIELDS, 0)
    t0 = last = time.perf_counter()
    rng = None if random_seeds is None else random.Random(random_seeds)
    seed = 0
    by_mode: dict[str, int] = defaultdict(int)
    while (total["certified_ids"] < target or total["certified_draws"] < sampler_target
           or total["certified_verifications"] < verify_target or total["certified_v2_top_k"] < top_k_target):
        case_seed = seed if rng is None else rng.randrange(2**31)
        for fam in families or FAMILIES:
            for dt in DTYPES:
                for sc in screens:
                    row = table[(fam, str(dt).removeprefix("torch."), sc)]
                    if total["certified_ids"] < target:  # (a campaign of draws or verifications alone skips them)
                        a, b = run_case(fam, case_seed, dt, sc)
                        c = run_sampled_case(fam, case_seed, dt, sc) if sc != "ball" else None
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
                    if total["certified_draws"] < sampler_target:  # vLLM's Sampler, hooked and not
                        # (one case in three: every row but the greedy ones deferred)
                        d = run_sampler_case(fam, case_seed, dt, sc, greedy_apart=case_seed % 3 == 0)
                        for t in (row, total):
                            t["sampler_rows"] += d.rows
                            t["certified_draws"] += d.certified
                            t["wrong_tokens"] += d.wrong_tokens
                            t["rng_out_of_step"] += d.rng_out_of_step
                        for m, n in d.certified_by_mode.items():
                            by_mode[m] += n
                    if total["certified_verifications"] < verify_target and sc in VERIFY_SCREENS and (
                            not verify_fused or sc == "int8"):
                        # (odd seeds: probabilistic drafts, the drafter's logits beside; seeds 2 and 3
                        # modulo 4: min-p on half the requests)
                        prob = case_seed % 2 == 1
                        v = run_verify_case(fam, case_seed, dt, sc, probabilistic=prob,
                                            with_min_p=case_seed % 4 >= 2, fused=verify_fused)
                        for t in (row, total):
                            t["verify_requests"] += v.requests
                            t["certified_verifications"] += v.certified
                            t["certified_verifications_probabilistic"] += v.certified if prob else 0
                            t["verify_drafts_accepted"] += v.drafts_accepted
                            t["verify_rejections"] += v.rejections
                            t["wrong_verifications"] += v.wrong
                    if total["certified_v2_top_k"] < top_k_target and sc in VERIFY_SCREENS:  # V2's top-k rows
                        o = run_top_k_draw_case(fam, case_seed, dt, sc)
                        for t in (row, total):
                            t["v2_top_k_rows"] += o.rows
                            t["certified_v2_top_k"] += o.certified
                            t["v2_top_k_below_max"] += o.below_max
                            t["wrong_v2_top_k"] += o.wrong
        seed += 1
        if time.perf_counter() - last > log_every:
            last = time.perf_counter()
            print(f"  seed {seed}: {total}", file=sys.stderr)
    return {"seeds": seed, "seconds": round(time.perf_counter() - t0, 1), "total": total,
            "certified_draws_by_mode": dict(sorted(by_mode.items())),
            "cases": [{"family": f, "dtype": d, "screen": s, **v} for (f, d, s), v in sorted(table.items())]}


def markdown(res: dict) -> str:
    t = res["total"]
    fams = res.get("families", sorted(FAMILIES))
    lines = [f"Adversarial campaign: {res['seeds']} seeds x {len(fams)} families x {len(DTYPES)} dtypes "
             f"x {len(res['screens'])} screens, {res['seconds']} s on {res['machine']} (commit {res['commit']})"
             + (", under flush-to-zero" if res.get("flush_to_zero") else "") + ".", "",
             f"**Total: {t['certified_ids']} certified rows checked for ids, {t['certified_values']} for ids and "
             f"value bits, {t['certified_sampled']} sampled top-k rows for the sampler's kept set and bits, of "
             f"{t['rows']} rows; {t['wrong_ids']} wrong ids, {t['wrong_values']} wrong values.**", "",
             f"**vLLM's Sampler through the hook: {t['certified_draws']} certified of {t['sampler_rows']} rows drawn; "
             f"{t['wrong_tokens']} tokens differ from the dense draw's, {t['rng_out_of_step']} batches with an RNG "
             f"out of step.** Certified draws by mode: "
             + ", ".join(f"{m} {n}" for m, n in res["certified_draws_by_mode"].items()) + ".", "",
             f"**V2's speculative verification (sampled requests): {t['certified_verifications']} "
             f"certified of {t['verify_requests']} requests ({t['certified_verifications_probabilistic']} with "
             f"probabilistic drafts, {t['verify_drafts_accepted']} drafts accepted, "
             f"{t['verify_rejections']} requests with a rejection); {t['wrong_verifications']} differ from the "
             f"float64 replay.**", "",
             f"**V2 rows with a top-k alone: {t['certified_v2_top_k']} certified of {t['v2_top_k_rows']} "
             f"({t['v2_top_k_below_max']} drawn below the row's maximum); {t['wrong_v2_top_k']} differ from the "
             f"dense row's masked draw, replayed in float64.**", "",
             "| family | dtype | rows | certified (ids) | certified (ids + values) | certified (sampled) | wrong ids "
             "| wrong values | sampler rows | certified draws | wrong tokens | RNG out of step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    agg: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
    for c in res["cases"]:
        for k in FIELDS:
            agg[(c["family"], c["dtype"])][k] += c[k]
    for (f, d), v in sorted(agg.items()):
        lines.append(f"| {f} | {d} | {v['rows']} | {v['certified_ids']} | {v['certified_values']} | "
                     f"{v['certified_sampled']} | {v['wrong_ids']} | {v['wrong_values']} | {v['sampler_rows']} | "
                     f"{v['certified_draws']} | {v['wrong_tokens']} | {v['rng_out_of_step']} |")
    if t.get("verify_requests"):
        lines += ["", "| family | dtype | verification requests | certified | drafts accepted | with a rejection "
                  "| differ from the replay |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {f} | {d} | {v['verify_requests']} | {v['certified_verifications']} | "
                  f"{v['verify_drafts_accepted']} | {v['verify_rejections']} | {v['wrong_verifications']} |"
                  for (f, d), v in sorted(agg.items()) if v["verify_requests"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="certified rows (ids mode) to check")
    p.add_argument("--screens", nargs="+", default=list(SCREENS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--random-seeds", type=int, default=None, metavar="N",
                   help="draw each case seed from random.Random(N) instead of 0, 1, 2, ...")
    p.add_argument("--sampler-rows", type=int, default=100_000,
                   help="rows certified in vLLM's Sampler through the hook to check (0: none)")
    p.add_argument("--verify-requests", type=int, default=100_000,
                   help="sampled requests whose V2 speculative verification is certified, to check (0: none)")
    p.add_argument("--verify-fused", action="store_true",
                   help="the verifications on the device path (its kernels' torch references here; int8)")
    p.add_argument("--v2-top-k-rows", type=int, default=100_000,
                   help="V2 rows with a top-k alone certified, to check (0: none)")
    p.add_argument("--families", nargs="+", default=None, choices=sorted(FAMILIES),
                   help="a subset of the families (default: all)")
    p.add_argument("--flush-to-zero", action="store_true",
                   help="the whole campaign under x86 flush-to-zero and denormals-are-zero (one thread)")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with flush_to_zero(args.flush_to_zero) as mode:
        if not mode.supported:
            p.error("this CPU cannot flush subnormals")
        res = campaign(args.rows, args.screens, random_seeds=args.random_seeds,
                       sampler_target=args.sampler_rows, families=args.families,
                       verify_target=args.verify_requests, verify_fused=args.verify_fused,
                       top_k_target=args.v2_top_k_rows)
    res.update(verify_fused=args.verify_fused or None, screens=args.screens, random_seeds=args.random_seeds,
               commit=commit(), torch=torch.__version__, provenance=machine(),
               machine=f"{platform.machine()}, {1 if args.flush_to_zero else args.threads} thread(s)",
               families=args.families or sorted(FAMILIES), flush_to_zero=args.flush_to_zero)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    from record import record_run  # one row a measurement in benchmarks/results/results.csv
    record_run("audit", res, source=out)
    md = markdown(res)
    out.with_suffix(".md").write_text(md)
    print(md)
    t = res["total"]
    return 1 if t["wrong_ids"] or t["wrong_values"] or t["wrong_tokens"] or t["rng_out_of_step"] or \
        t["wrong_verifications"] or t["wrong_v2_top_k"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
