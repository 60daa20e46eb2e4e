"""V2 temperature sampling on a GPU, head + sample step: the dense V2 step against the fused
certified draw (issue 44's target: >= 1.3x the dense V2 step at B = 1 and 8).

    python benchmarks/v2_fused_draw_gpu.py --json results/gpu/v2_fused_draw.json \
        [--shapes 151936x1024 128256x4096] [--batches 1 8 32] [--temps 0.7 1.0] [--caps 8 16] [--grammar 0 0.5]
        [--bias 0 2]

``--grammar s``: structured-output rows, a grammar forbidding a share ``s`` of each row's vocabulary
(its two likeliest tokens among them), ``-inf`` written before the draw on both sides, as V2's
runner writes the bitmask before its sampler (the device draw then takes the mask).
``--bias b``: a processor on every row, a logit bias of up to ``+-b`` on 64 random tokens a row
and on its likeliest token, added in fp32 on both sides (the dense step's logits, as V2's
``LogitBiasState`` adds it; the device draw's blocks and candidates through ``process``, the
``[B, V]`` passes of :mod:`vllm_csv.gpu.processed`, which nothing had timed).

Per (V x d, B, T), bf16, both CUDA-graph replayed (one graph per measured call, ``--iters``
replays a round, rounds interleaved, median per-replay time):

==============  ===============================================================================
dense           cuBLAS ``F.linear(h, W)``, then vLLM V2's ``gumbel_sample`` (temperature in its
                kernel): the dense V2 step
fused_c<cap>    :meth:`vllm_csv.gpu.step.FusedStep.draw_v2` scoring ``cap`` candidate blocks: the
                int8 screen, every block's noisy bound, the candidates, exact scoring, the Gumbel
                replay and certificate (:mod:`vllm_csv.gpu.draw_bounds`,
                :mod:`vllm_csv.gpu.gumbel_draw`), six kernels; tokens and codes stay on the device
fused_sync_c<c> the same, eager, plus what a sampler needs to finish a step: one host read of
                "did any row fail" and, where one did, the dense step for the batch (its
                rows' draws taken from it); with the certified share this is the real cost
==============  ===============================================================================

Each measured batch also checks every certified token against the dense step's draw of the same
batch (same seeds and positions): mismatches are printed and counted (``mismatches_c<cap>``).
The head is random (peaked rows, the tests' ``peaked_head``; hidden states ``hidden_near_rows``
at ``--scale``): the certified share on a learned head with its own hidden states is
``benchmarks/gpu_learned.py``'s. The JSON is rewritten after every cell.

vLLM's ``gumbel.py`` comes from the installed vLLM or ``VLLM_V2_GUMBEL_PY`` (a copy;
``benchmarks/run_gpu.sh`` points it at ``tests/vllm_033/sample/gumbel.py`` where vLLM is absent).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_csv.testing.vllm_v2 import load_vllm_v2_gumbel
from timing import cuda_graph


def _graph(fn):
    """``fn`` captured in a CUDA graph (:func:`timing.cuda_graph`): a replay function and its outputs."""
    g, out = cuda_graph(fn)
    return g.replay, out


def _time(calls: dict, iters: int, rounds: int) -> dict:
    """Median per-call ms of each callable, rounds interleaved, CUDA events around ``iters`` calls."""
    times = {n: [] for n in calls}
    for _ in range(rounds):
        for n, f in calls.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(iters):
                f()
            e.record()
            torch.cuda.synchronize()
            times[n].append(s.elapsed_time(e) / iters)
    return {n: statistics.median(t) for n, t in times.items()}


def _added(bias: torch.Tensor):
    """The processors' map of a logit bias (``[B, V]`` fp32) on bounds: vLLM's fp32 addition,
    monotone, so bounds map to bounds."""
    return lambda lo, hi: (lo + bias, hi + bias)


def main() -> None:
    from vllm_csv import CertifiedHead, HeadConfig
    from vllm_csv.gpu.step import FusedStep
    from vllm_csv.testing.heads import hidden_near_rows, peaked_head

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["151936x1024", "128256x4096"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--temps", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--caps", type=int, nargs="+", default=[8, 16], help="candidate blocks scored (<= 16)")
    ap.add_argument("--scale", type=float, default=2.0, help="hidden_near_rows' scale (peakedness)")
    ap.add_argument("--grammar", type=float, nargs="+", default=[0.0],
                    help="shares of the vocabulary a grammar forbids in each row (0: none; its likeliest "
                         "tokens forbidden too), -inf written before the draw as V2's runner does")
    ap.add_argument("--bias", type=float, nargs="+", default=[0.0],
                    help="logit-bias magnitudes (0: no processor): rows drawn through the processors' map")
    ap.add_argument("--head", help="a torch.save'd [V, d] weight to use instead of a random head")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    v2 = load_vllm_v2_gumbel()
    if v2 is None or not torch.cuda.is_available():
        sys.exit("needs CUDA and vLLM's V2 gumbel.py (vLLM installed, or VLLM_V2_GUMBEL_PY)")
    dev = torch.device("cuda")
    rows_out = []

    def write(rows):  # after every cell: a run cut short by its timeout keeps what it measured
        if not a.json:
            return
        import triton

        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "triton": triton.__version__, "commit": os.environ.get("VLLM_CSV_COMMIT", "unknown"),
                  "head": a.head or "peaked_head (random)", "scale": a.scale, "command": " ".join(sys.argv),
                  "rows": rows}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1))
    for shape in ([None] if a.head else a.shapes):
        if a.head:
            W = torch.load(a.head).to(torch.bfloat16)
            g = torch.Generator().manual_seed(0)
        else:
            V, d = (int(x) for x in shape.split("x"))
            W, g = peaked_head(V, d, seed=3)
            W = W.to(torch.bfloat16)
        V, d = W.shape
        Wc = W.to(dev)
        head = CertifiedHead(Wc, config=HeadConfig(screen="int8", off_switch=False))
        step = head.fused_step() or FusedStep(head)
        for B in a.batches:
            h = hidden_near_rows(W, B, g, scale=a.scale).to(dev)
            seeds = torch.randint(-2**62, 2**62, (B,), generator=g).to(dev)
            pos = torch.randint(0, 2**20, (B,), generator=g).to(dev)
            idx = torch.arange(B, dtype=torch.int32, device=dev)
            for T, share, b in [(T, s, b) for T in a.temps for s in a.grammar for b in a.bias]:
                temp = torch.full((B,), T, device=dev)
                bias, process = None, None
                if b > 0:  # a logit bias on 64 random tokens a row and its likeliest one
                    bias = torch.zeros(B, V)
                    cols = torch.cat([torch.randint(0, V, (B, 64), generator=g),
                                      F.linear(h.float().cpu(), W.float()).argmax(1, keepdim=True)], 1)
                    bias.scatter_(1, cols, (torch.rand(B, 65, generator=g) * 2 - 1) * b)
                    bias = bias.to(dev)
                    process = _added(bias)
                masked = None
                if share > 0:  # a grammar: -inf on its forbidden tokens (the likeliest ones among them)
                    masked = torch.rand(B, V, generator=g) < share
                    masked.scatter_(1, F.linear(h.float().cpu(), W.float()).topk(2, dim=1).indices, True)
                    masked = masked.to(dev)

                def dense():
                    x = F.linear(h, Wc)
                    if masked is not None:
                        x = x.masked_fill(masked, float("-inf"))
                    if bias is not None:
                        x = x.float() + bias
                    return v2.gumbel_sample(x, idx, temp, seeds, pos, apply_temperature=True, is_drafting=False)

                replay_dense, want = _graph(dense)
                calls = {"dense": replay_dense}
                shares, mismatches = {}, {}
                for k in a.caps:
                    replay, (tok, code, count) = _graph(lambda k=k: step.draw_v2(h, seeds, pos, temp, cap=k,
                                                                                 masked=masked, process=process))
                    replay()
                    replay_dense()
                    torch.cuda.synchronize()
                    cert = code == 0
                    bad = int((cert & (tok != want)).sum())  # the audit: certified = dense draw
                    if bad:  # counted and reported (the run goes on: one device run a session)
                        print(f"MISMATCH V={V} d={d} B={B} T={T} grammar={share} bias={b} cap={k}: {tok[cert]} vs "
                              f"{want[cert]}", flush=True)
                    mismatches[k] = bad
                    shares[k] = float(cert.float().mean())
                    calls[f"fused_c{k}"] = replay

                    def synced(k=k):
                        tok, code, _ = step.draw_v2(h, seeds, pos, temp, cap=k, masked=masked, process=process)
                        if bool((code != 0).any()):  # the one host read
                            return torch.where(code == 0, tok, dense())
                        return tok

                    calls[f"fused_sync_c{k}"] = synced
                t = _time(calls, a.iters, a.rounds)
                row = {"V": V, "d": d, "batch": B, "temperature": T, "grammar": share, "bias": b, "dense_ms": t["dense"],
                       **{f"{n}_ms": v for n, v in t.items() if n != "dense"},
                       **{f"speedup_{n}": t["dense"] / v for n, v in t.items() if n != "dense"},
                       **{f"certified_c{k}": s for k, s in shares.items()},
                       **{f"mismatches_c{k}": m for k, m in mismatches.items()}}
                rows_out.append(row)
                write(rows_out)
                best = max((n for n in t if n != "dense"), key=lambda n: t["dense"] / t[n])
                print(f"V={V} d={d} B={B} T={T} grammar={share} bias={b}: dense {t['dense']:.4f} ms; "
                      + ", ".join(f"{n} {v:.4f} ms ({t['dense'] / v:.2f}x)" for n, v in t.items() if n != "dense")
                      + f"; certified {shares}; best {best}", flush=True)


if __name__ == "__main__":
    main()
