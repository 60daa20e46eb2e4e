"""The sampler's reading of a suppressing model's ``-inf`` on its deferred rows, before and after
``fill.upstream_mask`` (one pass), in process, on synthetic placeholder logits.

* before: ``fill.grammar_mask`` (``[R, V]`` comparison and ``any``), ``fill.suppression_holds``
  (``masked != suppressed`` and ``any``), then the screen's bounds masked by two ``[R, V]``
  ``masked_fill_`` (``scoring.screen_bounds`` with a full mask);
* after: ``fill.upstream_mask`` (each row's ``-inf`` count, ``csrc/cpu/bools_cpu.cpp``
  ``neg_inf_rows``, and a gather at the tokens), the bounds filled by columns (the broadcast
  mask ``screen_bounds`` reads).

Both on the same tensors, interleaved; prints the minimum and the median of ``--repeats`` of each
and writes them with ``--json``.

    python benchmarks/upstream_mask.py --rows 8 --vocab 65536 --suppress 8 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from types import SimpleNamespace

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--suppress", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from vllm_csv.ops.build import kernels_available
    from vllm_csv.sampling.scoring import screen_bounds
    from vllm_csv.vllm_plugin.fill import grammar_mask, suppression_holds, upstream_mask

    R, V = a.rows, a.vocab
    g = torch.Generator().manual_seed(0)
    x = torch.randn(R, V, generator=g).to(getattr(torch, a.dtype))
    s = torch.zeros(V, dtype=torch.bool)
    s[torch.randperm(V, generator=g)[: a.suppress]] = True
    x[:, s] = -math.inf
    d = SimpleNamespace(suppressed=s, modes=["sampled"] * R)
    rows = torch.arange(R)
    lo, hi = torch.randn(R, V, generator=g), torch.randn(R, V, generator=g)
    adapter = SimpleNamespace(intervals=lambda h: (lo.clone(), hi.clone(), None, None))

    def before():
        m = grammar_mask(d, x, rows, True)
        assert suppression_holds(d, m)
        return screen_bounds(adapter, None, m)

    def after():
        m, holds = upstream_mask(d, x, rows, True)
        assert holds
        return screen_bounds(adapter, None, m)

    b, c = before(), after()
    assert torch.equal(b[0], c[0]) and torch.equal(b[1], c[1])  # (the same bounds)
    times: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(a.repeats):
        for name, fn in (("before", before), ("after", after)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    out = {"args": vars(a), "machine": platform.processor() or platform.machine(), "kernels": kernels_available(),
           **{f"{k}_ms_min": min(v) * 1e3 for k, v in times.items()},
           **{f"{k}_ms_median": statistics.median(v) * 1e3 for k, v in times.items()}}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
