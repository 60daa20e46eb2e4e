"""Issue 42, "Done when": do ordinary learned heads certify as before the arithmetic guards?

Certified share and share of V scored on learned heads, on the *same* hidden states, at two
commits (run once from each commit's checkout, with that checkout on ``PYTHONPATH``):

    # 1. hidden states, once (any checkout: benchmarks/lm_head.py's hidden_states, held-out text)
    PYTHONPATH=$PWD python benchmarks/certified_share.py dump --out /tmp/hidden
    # 2. each commit, from its own worktree
    PYTHONPATH=$PWD python benchmarks/certified_share.py measure --hidden /tmp/hidden \
        --commit d25e922 --csv benchmarks/results/certified_share_issue42.csv
    # 3. the table
    python benchmarks/certified_share.py summary --csv benchmarks/results/certified_share_issue42.csv --md out.md

What is measured is what ``benchmarks/lm_head.py --model`` measures (greedy ``topk(h, 1,
values=False)``, the head in the model dtype, off-switch off), in bf16, over more modes:

* ``greedy``: ``topk(h, 1, values=False)``;
* ``topk50``: ``topk(h, 50, values=True)`` (ids and values certified);
* ``sampler_greedy``: ``sampler_logits(h, ones)`` (the plugin's step, greedy rows);
* ``sampler_topk50``: ``sampler_logits(h, 50s, temperature=1)`` (sampled top-k rows).

at the repository's default budget (0.05: what users serve) and at budget 1.0 (lm_head.py's, so
that the share scored is the certificate's own, not cut at the budget). ``share_scored`` is the
mean over rows of scored / V with a dense row counted as V (as lm_head.py does); the mean over
certified rows only is written beside it.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

FIXTURES = {  # name -> how to find the model directory (cached under ~/.cache/vllm_csv/models)
    "demo": "demo-",
    "test": "test-",
    "issue45-v16384-d384": "issue45-v16384-d384-",
}
MODES = ("greedy", "topk50", "sampler_greedy", "sampler_topk50")
FIELDS = ["fixture", "V", "d", "dtype", "screen", "backend", "budget", "batch", "mode", "commit", "rows",
          "certified", "certified_share", "share_scored", "share_scored_certified_rows", "share_scored_p50",
          "fallbacks", "seconds", "machine", "command"]


def model_dir(name: str) -> Path:
    root = Path.home() / ".cache" / "vllm_csv" / "models"
    hits = sorted(p for p in root.glob(FIXTURES[name] + "*") if p.is_dir() and (p / "vllm_csv_recipe.json").exists())
    if not hits:
        raise SystemExit(f"fixture {name}: no model under {root}")
    return hits[0]


def machine() -> str:
    model = next((l.split(":", 1)[1].strip() for l in subprocess.run(["lscpu"], capture_output=True, text=True)
                  .stdout.splitlines() if l.startswith("Model name")), platform.processor())
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    avx = [f for f in flags if f.startswith("avx512") or f in ("amx_bf16", "amx_int8", "amx_tile")]
    return f"{model} ({' '.join(avx)}); torch {torch.__version__}; {torch.get_num_threads()} thread(s)"


def dump(args) -> None:
    sys.path.insert(0, str(Path.cwd() / "benchmarks"))
    from lm_head import hidden_states  # noqa: E402  (the benchmark's own held-out states)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.fixtures:
        d = model_dir(name)
        t0 = time.perf_counter()
        H = hidden_states(d, args.positions, "cpu")  # fp32, after the final norm
        torch.save({"model": str(d), "hidden_fp32": H.contiguous()}, out / f"{name}.pt")
        print(f"{name}: {d.name} {tuple(H.shape)} in {time.perf_counter() - t0:.1f}s", flush=True)


def measure(args) -> None:
    from vllm_csv import CertifiedHead, HeadConfig
    from vllm_csv.hf_head import load_lm_head
    import vllm_csv

    print(f"vllm_csv from {vllm_csv.__file__}", flush=True)
    assert str(Path(vllm_csv.__file__).resolve()).startswith(str(Path.cwd().resolve())), "wrong checkout imported"
    torch.set_num_threads(args.threads)
    mach = machine()
    command = " ".join(["python", *sys.argv])
    new = not Path(args.csv).exists()
    with open(args.csv, "a", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        if new:
            w.writeheader()
        for name in args.fixtures:
            blob = torch.load(Path(args.hidden) / f"{name}.pt")
            head_w = load_lm_head(Path(blob["model"]))
            dtype = getattr(torch, args.dtype)
            W = head_w.weight[: head_w.vocab_size].to(dtype).contiguous()
            b = None if head_w.bias is None else head_w.bias[: head_w.vocab_size].to(dtype)
            H = blob["hidden_fp32"][: args.rows].to(dtype)
            V, d = W.shape
            for screen in args.screens:
                for budget in args.budgets:
                    cfg = HeadConfig(screen=screen, budget=budget, off_switch=False)
                    t0 = time.perf_counter()
                    head = CertifiedHead(W, b, config=cfg, softcap=head_w.softcap, scale=head_w.scale)
                    backend = getattr(head.screen, "backend", type(head.screen).__name__)
                    print(f"{name} {screen} budget {budget}: head in {time.perf_counter() - t0:.1f}s ({backend})",
                          flush=True)
                    for B in args.batches:
                        for mode in args.modes:
                            t0 = time.perf_counter()
                            r = run_cell(head, H, B, mode, V)
                            row = dict(fixture=name, V=V, d=d, dtype=args.dtype, screen=screen, backend=backend,
                                       budget=budget, batch=B, mode=mode, commit=args.commit,
                                       seconds=round(time.perf_counter() - t0, 2), machine=mach, command=command, **r)
                            w.writerow(row)
                            f.flush()
                            print(f"  B={B:2d} {mode:15s} cert {r['certified']}/{r['rows']} "
                                  f"scored {r['share_scored']:.5f} ({row['seconds']}s) {r['fallbacks']}", flush=True)
                    del head


@torch.no_grad()
def run_cell(head, H, B: int, mode: str, V: int) -> dict:
    """Rows of ``H`` in batches of ``B`` through one mode; per row scored / V (a dense row: 1)."""
    ncert, scored, cert_scored, fb = 0, [], [], {}
    for s in range(0, H.shape[0] - B + 1, B):
        h = H[s: s + B]
        if mode in ("greedy", "topk50"):
            r = head.topk(h, 1 if mode == "greedy" else 50, values=mode != "greedy")
            c = r.certified.tolist()
            ncert += sum(c)
            x = [n / V for n in r.scored.tolist()]  # dense rows: V
            scored += x
            cert_scored += [v for v, ok in zip(x, c) if ok]
        else:
            k = 1 if mode == "sampler_greedy" else 50
            temp = None if k == 1 else torch.ones(B)
            _, st = head.sampler_logits(h, torch.full((B,), k, dtype=torch.long), temperature=temp)
            ncert += st.certified
            x = [n / V for n in st.scored]  # (StepStats.scored: the certified rows only)
            scored += x + [1.0] * (B - st.certified)
            cert_scored += x
            for key, v in st.fallbacks.items():
                if v:
                    fb[key] = fb.get(key, 0) + v
    n = len(scored)
    t = torch.tensor(scored, dtype=torch.float64)
    return dict(rows=n, certified=ncert, certified_share=round(ncert / n, 6), share_scored=float(t.mean()),
                share_scored_certified_rows=(sum(cert_scored) / len(cert_scored)) if cert_scored else "",
                share_scored_p50=float(t.quantile(0.5)), fallbacks=";".join(f"{k}={v}" for k, v in sorted(fb.items())))


def summary(args) -> None:
    rows = list(csv.DictReader(open(args.csv)))
    key = lambda r: (r["fixture"], r["screen"], r["budget"], int(r["batch"]), r["mode"])  # noqa: E731
    by = {}
    for r in rows:
        by.setdefault(key(r), {})[r["commit"]] = r
    commits = [args.before, args.after]
    fx_info = {r["fixture"]: f"V {r['V']}, d {r['d']}, {r['dtype']}" for r in rows}
    lines = ["# Issue 42: learned heads' certified share before and after the arithmetic guards", "",
             f"Before `{args.before}`, after `{args.after}`. Machine: {rows[0]['machine']}.", "",
             "Same hidden states at both commits (benchmarks/lm_head.py's `hidden_states`, held-out stdlib text, "
             "dumped once, cast to bf16); head in bf16, off-switch off. Certified = rows certified / rows, in %; "
             "scored = mean share of V scored per row, in % (a dense row counts as 100%). Diff in points "
             "(after - before).", ""]
    worst = (0.0, None)
    for fx in dict.fromkeys(k[0] for k in by):
        lines += [f"## {fx} ({fx_info[fx]})", "",
                  "| screen | budget | batch | mode | rows | certified before | certified after | diff (pt) | "
                  "scored before | scored after | diff (pt) | fallbacks before | fallbacks after |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for k in sorted((k for k in by if k[0] == fx), key=lambda k: (k[1], float(k[2]), k[3], MODES.index(k[4]))):
            c = by[k]
            if not all(x in c for x in commits):
                continue
            b, a = c[args.before], c[args.after]
            cb, ca = 100 * int(b["certified"]) / int(b["rows"]), 100 * int(a["certified"]) / int(a["rows"])
            sb, sa = 100 * float(b["share_scored"]), 100 * float(a["share_scored"])
            if abs(ca - cb) > abs(worst[0]):
                worst = (ca - cb, k)
            flag = " **" if abs(ca - cb) > 0.1 else ""
            lines.append(f"| {k[1]} ({a['backend']}) | {k[2]} | {k[3]} | {k[4]} | {a['rows']} | {cb:.2f} | {ca:.2f} | "
                         f"{ca - cb:+.2f}{flag} | {sb:.4f} | {sa:.4f} | {sa - sb:+.4f} | {b['fallbacks']} | "
                         f"{a['fallbacks']} |")
        lines.append("")
    lines += [f"Largest difference in certified share: {worst[0]:+.2f} points ({worst[1]}).", ""]
    Path(args.md).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--out", required=True)
    d.add_argument("--fixtures", nargs="+", default=list(FIXTURES))
    d.add_argument("--positions", type=int, default=512)
    m = sub.add_parser("measure")
    m.add_argument("--hidden", required=True)
    m.add_argument("--commit", required=True)
    m.add_argument("--csv", required=True)
    m.add_argument("--fixtures", nargs="+", default=list(FIXTURES))
    m.add_argument("--screens", nargs="+", default=["auto", "int8", "int4", "fp16"])
    m.add_argument("--budgets", type=float, nargs="+", default=[0.05, 1.0])
    m.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    m.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    m.add_argument("--rows", type=int, default=256)
    m.add_argument("--dtype", default="bfloat16")
    m.add_argument("--threads", type=int, default=1)
    s = sub.add_parser("summary")
    s.add_argument("--csv", required=True)
    s.add_argument("--md", required=True)
    s.add_argument("--before", default="d25e922")
    s.add_argument("--after", default="7770316")
    args = p.parse_args()
    {"dump": dump, "measure": measure, "summary": summary}[args.cmd](args)


if __name__ == "__main__":
    main()
