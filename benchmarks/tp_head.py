"""Sharded LM head (tensor parallelism) beside the single-rank head, on real hidden states.

    python benchmarks/tp_head.py --hidden 256 --tp 1 2 --batches 1 8 --json results/tp_head.json

    python benchmarks/tp_head.py --hidden 256 --tp 1 2 --batches 8 --mode top_p --temperature 1.0

For each tensor-parallel size it reports the certified share of greedy rows (top-1, the
default budget) over held-out positions (``--mode sampling|top_p|min_p``: of rows certified
in the sampler instead, :func:`~vllm_csv.sampling.rows.certify_rows` at TP = 1 and
:func:`~vllm_csv.sampling.sharded_rows.certify_rows_sharded` at TP > 1, with the temperature
as the only processing, one seed a row; there the time reported is the certification's, and
``dense_ms`` is the dense head's alone, not the dense sampler's), and the LM-head step time of the CSV path
(:meth:`ShardedHead.sampler_logits` / :meth:`CertifiedHead.sampler_logits`) against the dense
path of the same TP size, measured in the same run: at TP = 1 ``F.linear`` (+ the engine's
transform), at TP > 1 vLLM's dense TP head written out (shard GEMM, gloo all-gather of the
``[B, P]`` shard logits, slice, transform). TP > 1 runs one process a rank
(``torch.distributed`` gloo, FileStore), the machine's threads split between them.
Timings are medians; on a shared machine they are noisy (say so with the numbers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_csv.head import CertifiedHead, HeadConfig
from vllm_csv.hf_head import load_lm_head
from vllm_csv.sharded import Shard, ShardedHead, TorchGroup
from timing import median_ms


def sampler_rows(head, size: int, hb: torch.Tensor, mode: str, temperature: float, seed: int):
    """One batch of rows certified in the sampler: ``(certified count, scored)``."""
    from vllm_csv.sampling.head_adapter import HeadAdapter
    from vllm_csv.sampling.rows import certify_rows
    from vllm_csv.sampling.sharded_rows import ShardedAdapter, certify_rows_sharded

    B = hb.shape[0]
    seeds = torch.randint(0, 2**31, (B,), generator=torch.Generator().manual_seed(seed))
    greedy = torch.zeros(B, dtype=torch.bool)
    min_p = torch.full((B,), 0.1 if mode == "min_p" else 0.0)
    top_p = torch.full((B,), 0.9 if mode == "top_p" else 1.0)

    def temp(lo, hi, rows=None):  # (one temperature for every row)
        return lo / temperature, hi / temperature

    if size == 1:
        res = certify_rows(HeadAdapter(head), hb, temp, seeds, greedy, elementwise=True, min_p=min_p, top_p=top_p)
    else:
        res = certify_rows_sharded(ShardedAdapter(head), hb, temp, min_p, top_p, seeds, greedy)
    return int(res.certified.sum()), res.scored


def run(rank: int, size: int, W, b, H, batches, screen, repeats, store: str | None, threads: int, q=None,
        mode: str = "greedy", temperature: float = 1.0):
    torch.set_num_threads(threads)
    V = W.shape[0]
    cfg = HeadConfig(screen=screen, off_switch=False)
    if size == 1:
        head = CertifiedHead(W, b, config=cfg)

        def dense(h):
            return head.transform(F.linear(h, head.weight, head.bias))
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
        shard = Shard.vllm_layout(V, rank, size)
        padded = torch.zeros(size * shard.rows, W.shape[1], dtype=W.dtype)
        padded[:V] = W
        w = padded[shard.start : shard.start + shard.rows].contiguous()
        bb = None
        if b is not None:
            bp = torch.zeros(size * shard.rows, dtype=b.dtype)
            bp[:V] = b
            bb = bp[shard.start : shard.start + shard.rows].contiguous()
        comm = TorchGroup()
        head = ShardedHead(w, bb, shard, comm, config=cfg)
        def dense(h):
            g = comm.all_gather(F.linear(h, w, bb))
            return head.engine.transform(g.permute(1, 0, 2).reshape(h.shape[0], -1)[:, :V])
    out = {}
    for B in batches:
        cert = rows = 0
        scored = []
        for s in range(0, H.shape[0] - B + 1, B):
            ones = torch.ones(B, dtype=torch.long)
            if mode != "greedy":
                c, n = sampler_rows(head, size, H[s : s + B], mode, temperature, s)
                cert, rows = cert + c, rows + B
                scored += [n] * c
                continue
            logits, st = head.sampler_logits(H[s : s + B], ones, dense)
            cert, rows = cert + st.certified, rows + B
            scored += st.scored
        hb, ones = H[:B], torch.ones(B, dtype=torch.long)
        if mode != "greedy":
            csv_ms = median_ms(lambda: sampler_rows(head, size, hb, mode, temperature, 0), repeats)
        else:
            csv_ms = median_ms(lambda: head.sampler_logits(hb, ones, dense), repeats)
        dense_ms = median_ms(lambda: dense(hb), repeats)
        out[str(B)] = {"certified": cert, "rows": rows, "certified_share": cert / rows,
                       "scored_mean": statistics.mean(scored) if scored else None,
                       "csv_ms": round(csv_ms, 3), "dense_ms": round(dense_ms, 3),
                       "speedup_vs_dense": round(dense_ms / csv_ms, 3)}
    if size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    if q is not None:
        q.put((rank, out))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256, help="fixture model (vllm_csv.testing.fixtures)")
    p.add_argument("--model", default=None, help="a Hugging Face model directory instead of a fixture")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--positions", type=int, default=1024)
    p.add_argument("--screen", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--mode", choices=("greedy", "sampling", "top_p", "min_p"), default="greedy",
                   help="rows certified in the head (greedy) or in the sampler (top_p 0.9, min_p 0.1)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampler modes' temperature")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from lm_head import hidden_states  # benchmarks/lm_head.py: held-out text through the model

    if args.model:
        model_dir = Path(args.model)
    else:
        from vllm_csv.testing.fixtures import fixture

        model_dir = fixture(args.hidden)
    dtype = getattr(torch, args.dtype)
    lm = load_lm_head(model_dir)
    W = lm.weight[: lm.vocab_size].to(dtype).contiguous()
    b = None if lm.bias is None else lm.bias[: lm.vocab_size].to(dtype)
    H = hidden_states(model_dir, args.positions, "cpu").to(dtype)
    threads = torch.get_num_threads()
    from provenance import machine

    results = {"provenance": machine(), "model": model_dir.name, "V": W.shape[0], "d": W.shape[1], "dtype": args.dtype,
               "screen": args.screen, "positions": int(H.shape[0]), "threads": threads, "mode": args.mode,
               "temperature": args.temperature, "tp": {}}
    for size in args.tp:
        if size == 1:
            res = run(0, 1, W, b, H, args.batches, args.screen, args.repeats, None, threads, None, args.mode,
                      args.temperature)
        else:
            import torch.multiprocessing as mp

            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            store = tempfile.mktemp(prefix="tp-head-store-")
            procs = [ctx.Process(target=run, args=(r, size, W, b, H, args.batches, args.screen, args.repeats,
                                                   store, max(1, threads // size), q, args.mode,
                                                   args.temperature)) for r in range(size)]
            for pr in procs:
                pr.start()
            got = dict(q.get(timeout=1800) for _ in procs)
            for pr in procs:
                pr.join()
            res = got[0]
            assert all(got[r][B]["certified"] == res[B]["certified"] for r in got for B in res), "ranks disagree"
        results["tp"][str(size)] = res
        for B, r in res.items():
            print(f"TP={size} B={B}: certified {r['certified_share']:.4f} ({r['certified']}/{r['rows']}) "
                  f"csv {r['csv_ms']:.2f} ms dense {r['dense_ms']:.2f} ms x{r['speedup_vs_dense']:.2f}",
                  file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
        from record import record_run  # one row a measurement in benchmarks/results/results.csv
        record_run("tp_head", results, source=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
