"""``vllm-csv``: build the offline index (and other tools)."""

from __future__ import annotations

import argparse
import sys
import time

from .errors import CSVError
from .vocabulary import CLUSTER_FRACTION


def _build_index(args) -> int:
    from .cache import index_path
    from .hf_head import load_lm_head
    from .index import build_index, default_num_clusters

    t0 = time.perf_counter()
    head = load_lm_head(args.model_dir, args.bias)
    w = head.weight[: head.vocab_size]
    b = None if head.bias is None else head.bias[: head.vocab_size]
    if args.dtype:  # the weights as vLLM serves them: the index is fingerprinted (and bounds) those
        import torch

        dt = getattr(torch, args.dtype)
        w, b = w.to(dt), None if b is None else b.to(dt)
    parts = [(None, w, b)]
    if args.tensor_parallel_size > 1:  # one index per shard, over its real rows (vLLM's layout)
        from .sharded import Shard

        parts = []
        for r in range(args.tensor_parallel_size):
            sh = Shard.vllm_layout(w.shape[0], r, args.tensor_parallel_size)
            if sh.real:
                rows = sh.real_rows
                parts.append((sh, w[rows], None if b is None else b[rows]))
    for sh, pw, pb in parts:
        C = default_num_clusters(pw.shape[0]) if args.clusters is None else args.clusters
        where = "" if sh is None else f" shard {sh.rank} of {sh.size} (rows {sh.real_rows.start}...{sh.real_rows.stop})"
        print(f"LM head {head.source}{where}: V={pw.shape[0]} d={pw.shape[1]} {pw.dtype}, "
              f"bias={'yes' if pb is not None else 'no'}; clustering into {C} ({args.method} k-means)", file=sys.stderr)
        idx = build_index(pw, pb, C, method=args.method, iters=args.iters, seed=args.seed, progress=not args.quiet)
        out = args.output
        if out and sh is not None:
            from .cache import shard_index_path

            out = shard_index_path(out, sh.rank, sh.size)
        out = idx.save(out or index_path(idx.fingerprint, C))
        s = idx.sizes.float()
        print(f"wrote {out} in {time.perf_counter() - t0:.1f}s: {idx.num_clusters} clusters, size "
              f"min/median/max {int(s.min())}/{int(s.median())}/{int(s.max())}, radius median "
              f"{idx.radii.median():.4g} max {idx.radii.max():.4g}, fingerprint {idx.fingerprint}", file=sys.stderr)
        print(out)
    return 0


def _serve(args) -> int:
    from .serve import serve

    return serve(args.model, args.host, args.port, args.once, args.vllm_args, args.timeout)


def _build_kernels(args) -> int:
    from .ops import build

    if build.build_kernels() or build.os.environ.get(build.ENV, "1") == "0":
        return 0
    return 1  # (the build failed: its log line says why; the torch reference would run)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-csv", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-index", help="cluster the LM head of a Hugging Face model directory")
    b.add_argument("model_dir", help="directory with config.json and *.safetensors")
    b.add_argument("--clusters", type=int, default=None, help=f"number of clusters (default {CLUSTER_FRACTION} x V)")
    b.add_argument("--output", default=None, help="index file (default: the cache, keyed by fingerprint)")
    b.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="dtype the model is served in (vllm serve --dtype; default: the checkpoint's). An index "
                        "is valid only for the weights as served, e.g. an fp32 checkpoint served in bf16 needs "
                        "--dtype bfloat16")
    b.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="write one index per vocabulary shard of vllm serve --tensor-parallel-size N (with "
                        "--output PATH: PATH's name gets .tpN-rankR; the cache needs no name)")
    b.add_argument("--bias", choices=("auto", "yes", "no"), default="auto",
                   help="index lm_head.bias: auto (where vLLM's model of the architecture adds it: GPT-J), yes "
                        "(vLLM's Transformers backend, --model-impl transformers, adds it always), no")
    b.add_argument("--method", choices=("torch", "sklearn"), default="torch", help="k-means implementation")
    b.add_argument("--iters", type=int, default=25, help="Lloyd iterations (default 25)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=_build_index)
    k = sub.add_parser("build-kernels", help="build the CPU kernels now (else the first CPU server or test "
                       "builds them: 1-3 minutes, once per version and machine)")
    k.set_defaults(func=_build_kernels)
    s = sub.add_parser("serve", help="serve a model with CSV-Decode on (default: the embedded demo model)")
    s.add_argument("model", nargs="?", default=None, help="Hugging Face model directory (default: demo model)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--once", action="store_true", help="answer the demo request, then stop the server")
    s.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for start-up")
    s.set_defaults(func=_serve, vllm_args=[])  # further `vllm serve` arguments: after `--`
    s.epilog = "Further arguments for `vllm serve` go after `--`, e.g. `vllm-csv serve MODEL --once -- --dtype bfloat16`."
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:  # everything after `--` is vLLM's, whatever comes before (MODEL, --once)
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = parser()
    args = p.parse_args(argv)
    if extra and not hasattr(args, "vllm_args"):
        p.error(f"`vllm-csv {args.command}` takes no arguments after `--`")
    if extra:
        args.vllm_args = extra
    try:
        return args.func(args)
    except CSVError as e:
        print(f"vllm-csv: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("vllm-csv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
