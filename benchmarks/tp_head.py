"""Sharded LM head (tensor parallelism) beside the single-rank head, on real hidden states.

    python benchmarks/tp_head.py --hidden 256 --tp 1 2 --batches 1 8 --json results/tp_head.json

For each tensor-parallel size it reports the certified share of greedy rows (top-1, the
default budget) over held-out positions, and the LM-head step time of the CSV path
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
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_csv.head import CertifiedHead, HeadConfig  # noqa: E402
from vllm_csv.hf_head import load_lm_head  # noqa: E402
from vllm_csv.sharded import Shard, ShardedHead, TorchGroup  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(rank: int, size: int, W, b, H, batches, screen, repeats, store: str | None, threads: int, q=None):
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
            logits, st = head.sampler_logits(H[s : s + B], ones, dense)
            cert, rows = cert + st.certified, rows + B
            scored += st.scored
        hb, ones = H[:B], torch.ones(B, dtype=torch.long)
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
    p.add_argument("--hidden", type=int, default=256, help="fixture model (benchmarks/fixtures.py)")
    p.add_argument("--model", default=None, help="a Hugging Face model directory instead of a fixture")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--positions", type=int, default=1024)
    p.add_argument("--screen", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from lm_head import hidden_states  # benchmarks/lm_head.py: held-out text through the model

    if args.model:
        model_dir = Path(args.model)
    else:
        from fixtures import fixture

        model_dir = fixture(args.hidden)
    dtype = getattr(torch, args.dtype)
    lm = load_lm_head(model_dir)
    W = lm.weight[: lm.vocab_size].to(dtype).contiguous()
    b = None if lm.bias is None else lm.bias[: lm.vocab_size].to(dtype)
    H = hidden_states(model_dir, args.positions, "cpu").to(dtype)
    threads = torch.get_num_threads()
    results = {"model": model_dir.name, "V": W.shape[0], "d": W.shape[1], "dtype": args.dtype,
               "screen": args.screen, "positions": int(H.shape[0]), "threads": threads, "tp": {}}
    for size in args.tp:
        if size == 1:
            res = run(0, 1, W, b, H, args.batches, args.screen, args.repeats, None, threads)
        else:
            import torch.multiprocessing as mp

            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            store = tempfile.mktemp(prefix="tp-head-store-")
            procs = [ctx.Process(target=run, args=(r, size, W, b, H, args.batches, args.screen, args.repeats,
                                                   store, max(1, threads // size), q)) for r in range(size)]
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
