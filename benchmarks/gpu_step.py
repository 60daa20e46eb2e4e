"""The fused certified step on a GPU against vLLM's dense head: speed, certified share, exactness.

    python benchmarks/gpu_step.py --json results/gpu_step.json [--shapes 151936x1024 ...]
        [--batches 1 8 32 64] [--audit-rows 153600]

Speed, per (V x d, B), bf16, everything CUDA-graph replayed (one graph per measured call,
``--iters`` replays a round, rounds interleaved, median per-replay time):

==========  ===================================================================================
dense       cuBLAS ``F.linear(h, W)`` + ``argmax``: vLLM's dense head and greedy pick (baseline)
int8_gemm   ``torch._int_mm`` over the int8 copy (rows padded to 17): the one-byte ceiling
screen      the step's screen kernel alone (int8 GEMM + block maxima)
step        the fused greedy step (:meth:`vllm_csv.gpu.step.FusedStep.run`, five kernels)
step_topk64 the fused top-64 step with values certified bit for bit
step_pdl    ``--pdl``: the same step with every kernel launched dependently
            (:func:`vllm_csv.gpu.common.pdl`; its outputs checked against ``step``'s)
k_*         each kernel of the step alone (at the first shape, ``--breakdown-batches``)
==========  ===================================================================================

and, with one host read per iteration (what :meth:`FusedStep.topk` adds to decide the dense
rescue): ``step_sync`` (step + one copy of the ``[B]`` codes to the host) against ``dense_sync`` (dense + one read).
Hidden states: the tests' peaked rows (``h = 6 sqrt(d) w_t + 0.3 noise``, as
``benchmarks/screen_kernels.py``), random weights ``N(0, 1/d)``.

Audit (``--audit-rows``, at the first shape, B = 64): certified rows against the dense argmax of
the same batch (cuBLAS, first maximum), over families: peaked, soft (scale 2, noise 1), exact
ties (duplicated head rows), tiny (2^-60) and huge (2^40) norms, and a top-8-with-values pass
against the dense stable sort. Every row of the JSON names the device, versions and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.gpu import common as gpu_common
from vllm_csv.gpu import screen as gpu_screen
from vllm_csv.gpu.certify import certify_rows
from vllm_csv.gpu.common import batch_tile
from vllm_csv.gpu.quantize import quantize_rows
from vllm_csv.gpu.score import score_blocks
from vllm_csv.gpu.select import select_blocks
from vllm_csv.gpu.step import FusedStep
from timing import cuda_graph


def provenance() -> dict:
    import triton

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "commit": os.environ.get("VLLM_CSV_COMMIT", "unknown"),
            "dtype": "bfloat16"}


def graphed(fn):
    """``fn`` captured in a CUDA graph (:func:`timing.cuda_graph`); returns the graph."""
    return cuda_graph(fn)[0]


def replay_ms(g, iters: int, after=None) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if after is None:
        a.record()
        for _ in range(iters):
            g.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / iters
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        g.replay()
        after()  # a host read: waits for the replay
    return (time.perf_counter() - t0) * 1e3 / iters


def topk_wrong(h, W, ids, vals, code, k: int) -> tuple[int, int]:
    """``(certified, wrong)`` rows of a step's top-``k`` with values (:meth:`FusedStep.run` with
    ``need``): a certified row is wrong where an id or a value's bits differ from the dense
    head's stable descending sort of the same batch (cuBLAS, ties by the lowest id)."""
    dv, di = torch.sort(F.linear(h, W).float(), dim=1, descending=True, stable=True)
    cert = code == 0
    bad = cert[:, None] & ((ids[:, :k] != di[:, :k]) | (vals[:, :k] != dv[:, :k]))
    return int(cert.sum()), int(bad.any(1).sum())


def peaked(W, B, gen, scale=6.0, noise=0.3):
    V, d = W.shape
    t = torch.randint(0, V, (B,), device=W.device, generator=gen)
    h = scale * W[t].float() * d**0.5 + noise * torch.randn(B, d, device=W.device, generator=gen)
    return h.to(W.dtype)


def speed(a, prov, rows):
    for shape in a.shapes:
        V, d = map(int, shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        W = (torch.randn(V, d, device="cuda", generator=gen) / d**0.5).bfloat16()
        t0 = time.perf_counter()
        head = CertifiedHead(W, config=HeadConfig(off_switch=False))
        st = FusedStep(head)
        prep_s = time.perf_counter() - t0
        for B in a.batches:
            h = peaked(W, B, gen)
            k1 = torch.ones(B, dtype=torch.int32, device="cuda")
            need0 = torch.zeros(B, dtype=torch.int8, device="cuda")
            p = torch.zeros((max(17, B), d), dtype=torch.int8, device="cuda")
            qT = st.screen.q_gemm.t()
            out = {}
            graphs = {
                "dense": graphed(lambda: out.__setitem__("dense", F.linear(h, W).argmax(-1))),
                "int8_gemm": graphed(lambda: torch._int_mm(p, qT)),
                "step": graphed(lambda: out.__setitem__("step", st.run(h, k1, need0, 1))),
            }
            pq = quantize_rows(h, True, batch_tile(B), head.errors.guard_scale, head.errors.babs_max)
            graphs["screen"] = graphed(lambda: st.screen_bounds(pq[0], pq[1], pq[2], pq[3], B))
            if a.pdl:  # the same step, its kernels launched dependently (captured with the flag on)
                prev, gpu_common._PDL = gpu_common._PDL, True
                try:
                    graphs["step_pdl"] = graphed(lambda: out.__setitem__("step_pdl", st.run(h, k1, need0, 1)))
                except Exception as e:  # noqa: BLE001 - recorded, the rest of the run goes on
                    print(f"step_pdl: {type(e).__name__}: {str(e)[:300]}", flush=True)
                finally:
                    gpu_common._PDL = prev
            if B in a.topk_batches:
                k64 = torch.full((B,), 64, dtype=torch.int32, device="cuda")
                need1 = torch.ones(B, dtype=torch.int8, device="cuda")
                graphs["step_topk64"] = graphed(lambda: out.__setitem__("topk", st.run(h, k64, need1, 64)))
            if shape == a.shapes[0] and B in a.breakdown_batches:  # each kernel of the step alone
                pp, tt, ee, hn, ok = pq
                um, lm = st.screen_bounds(pp, tt, ee, hn, B)
                lim, babs, cap = st.consts["limit"], st.consts["babs_max"], st.cap_for(1)
                cand, count, tau, okb, live = select_blocks(um, lm, k1, ok, lim, babs, cap, 1)
                sc = score_blocks(h, st.weight, None, cand, count, st.coef, st.gam, st.tiny32)
                BB = batch_tile(B)
                graphs["k_quantize"] = graphed(lambda: quantize_rows(h, True, BB, head.errors.guard_scale, head.errors.babs_max))
                graphs["k_select"] = graphed(lambda: select_blocks(um, lm, k1, ok, lim, babs, cap, 1))
                graphs["k_score"] = graphed(lambda: score_blocks(h, st.weight, None, cand, count, st.coef,
                                                                 st.gam, st.tiny32))
                graphs["k_certify"] = graphed(lambda: certify_rows(*sc, cand, count, k1, need0, tau, okb,
                                                                   live, V, 1, W.dtype))
            times = {n: [] for n in graphs}
            for _ in range(a.rounds):  # interleaved: drift hits every column alike
                for n, g in graphs.items():
                    times[n].append(replay_ms(g, a.iters))
            med = {n: statistics.median(v) for n, v in times.items()}
            sync_iters = max(20, a.iters // 4)
            med["dense_sync"] = statistics.median(
                [replay_ms(graphs["dense"], sync_iters, lambda: out["dense"][0].item()) for _ in range(3)])
            med["step_sync"] = statistics.median(
                [replay_ms(graphs["step"], sync_iters, lambda: bool(out["step"][2].cpu().any())) for _ in range(3)])
            graphs["dense"].replay()
            graphs["step"].replay()
            torch.cuda.synchronize()
            ids, _, code, count = out["step"]
            cert = code == 0
            mism = int((cert & (ids[:, 0] != out["dense"])).sum())
            extra = {"certified": int(cert.sum()), "rows": B, "mismatches": mism,
                     "scored_mean": float(FusedStep.scored(count).float().mean()),
                     "screen_config": list(gpu_screen._tuned.get((V, d, batch_tile(B), str(W.device)), ())),
                     "prep_s": round(prep_s, 2)}
            if "step_pdl" in graphs:
                graphs["step_pdl"].replay()
                torch.cuda.synchronize()
                extra["pdl_differs"] = int(not all(torch.equal(x, y) for x, y in zip(out["step_pdl"], out["step"])))
            if "topk" in out:
                graphs["step_topk64"].replay()
                torch.cuda.synchronize()
                tid, tv, tcode, _ = out["topk"]
                extra["topk64_certified"], extra["topk64_mismatches"] = topk_wrong(h, W, tid, tv, tcode, 64)
            for n, ms in med.items():
                base = med["dense_sync"] if n == "step_sync" else med["dense"]
                rows.append({**prov, "V": V, "d": d, "B": B, "measure": n, "ms": round(ms, 5),
                             "baseline": "dense" if n != "step_sync" else "dense_sync",
                             "speedup_vs_baseline": round(base / ms, 4), **extra})
            print(f"{V}x{d} B={B:3d} " + " ".join(f"{n}={ms * 1e3:.1f}us" for n, ms in med.items())
                  + f" | step {med['dense'] / med['step']:.2f}x, ceiling {med['dense'] / med['int8_gemm']:.2f}x,"
                  f" sync {med['dense_sync'] / med['step_sync']:.2f}x"
                  + (f" | pdl {med['dense'] / med['step_pdl']:.2f}x differs {extra['pdl_differs']}"
                     if "step_pdl" in med else "") + f" | tile {extra['screen_config']}"
                  f" | cert {extra['certified']}/{B}"
                  f" mism {mism}" + (f" top64 cert {extra.get('topk64_certified')} mism {extra.get('topk64_mismatches')}"
                                     if "topk" in out else ""), flush=True)
        del W, head, st
        torch.cuda.empty_cache()


def audit(a, prov, rows):
    V, d = map(int, a.shapes[0].split("x"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    W = (torch.randn(V, d, device="cuda", generator=gen) / d**0.5).bfloat16()
    dup = torch.randint(0, V - 1, (2000,), device="cuda", generator=gen)
    W[dup + 1] = W[dup]  # exact ties between neighbours
    head = CertifiedHead(W, config=HeadConfig(off_switch=False))
    st = FusedStep(head)
    B = 64
    k1 = torch.ones(B, dtype=torch.int32, device="cuda")
    need0 = torch.zeros(B, dtype=torch.int8, device="cuda")
    fams = ("peaked", "soft", "ties", "tiny", "huge")
    tally = {f: [0, 0, 0] for f in fams}  # rows, certified, mismatches
    t0 = time.perf_counter()
    for i in range(a.audit_rows // B):
        fam = fams[i % len(fams)]
        if fam == "soft":
            h = peaked(W, B, gen, scale=2.0, noise=1.0)
        elif fam == "ties":
            t = dup[torch.randint(0, len(dup), (B,), device="cuda", generator=gen)]
            h = (6 * W[t].float() * d**0.5 + 0.3 * torch.randn(B, d, device="cuda", generator=gen)).bfloat16()
        else:
            h = peaked(W, B, gen)
            if fam != "peaked":
                h = (h.float() * (2.0**-60 if fam == "tiny" else 2.0**40)).bfloat16()
        ids, _, code, _ = st.run(h, k1, need0, 1)
        dense = F.linear(h, W).argmax(-1)
        cert = code == 0
        tally[fam][0] += B
        tally[fam][1] += int(cert.sum())
        tally[fam][2] += int((cert & (ids[:, 0] != dense)).sum())
    # top-8 with values against the dense stable sort
    k8 = torch.full((B,), 8, dtype=torch.int32, device="cuda")
    need1 = torch.ones(B, dtype=torch.int8, device="cuda")
    t8 = [0, 0, 0]
    for i in range(max(1, a.audit_rows // B // 10)):
        h = peaked(W, B, gen, scale=3.0, noise=0.5)
        ids, vals, code, _ = st.run(h, k8, need1, 8)
        c, w = topk_wrong(h, W, ids, vals, code, 8)
        t8[0] += B
        t8[1] += c
        t8[2] += w
    for f, (n, c, m) in list(tally.items()) + [("top8_values", tuple(t8))]:
        rows.append({**prov, "V": V, "d": d, "B": B, "measure": f"audit_{f}", "rows": n, "certified": c,
                     "mismatches": m})
        print(f"audit {f}: {c}/{n} certified, {m} mismatches", flush=True)
    print(f"audit took {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["151936x1024", "128256x2048", "128256x4096", "262144x2560"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--topk-batches", type=int, nargs="*", default=[1, 64])
    p.add_argument("--breakdown-batches", type=int, nargs="*", default=[1, 64],
                   help="at the first shape, also time each kernel of the step alone (k_*)")
    p.add_argument("--pdl", action="store_true", help="also time the step with dependent launches (step_pdl)")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--audit-rows", type=int, default=153600)
    p.add_argument("--json", default="results/gpu_step.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    prov = provenance()
    print(json.dumps(prov), flush=True)
    rows: list[dict] = []
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    try:
        speed(a, prov, rows)
        if a.audit_rows:
            audit(a, prov, rows)
    finally:
        Path(a.json).write_text(json.dumps(rows, indent=1))
        try:  # one row a measurement in benchmarks/results/results.csv
            from record import record_run
        except ImportError as e:  # (a GPU box without pydantic: the JSON above is the record)
            print(f"[record] not recorded ({e})")
        else:
            record_run("gpu_step", rows, source=a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
