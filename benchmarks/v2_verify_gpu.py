"""V2's speculative verification of sampled requests on a GPU: the certificate against the dense head.

What it times, per batch of ``R`` requests with ``--drafts`` draft tokens each (``N = R (k + 1)``
rows), wall-clock with the device synchronised (the certificate's rounds read decisions on the
host, so its syncs are part of its time), median over ``--repeats``:

* dense: the bf16 head (``F.linear``, cuBLAS) on the ``N`` rows, what V2's rejection sampler reads;
* CSV: :func:`vllm_csv.sampling.verify_v2.certify_verification_v2` (screen, acceptance rounds,
  the draws after them) and the dense head on the rows of the requests it leaves, as the V2 hook
  (:mod:`vllm_csv.vllm_plugin.v2.verify`) writes them;
* CSV fused: the device path the hook takes on CUDA, one-hot and probabilistic drafts,
  :func:`vllm_csv.sampling.verify_v2_fused.verify_fused` (the fused step's kernels, one host read),
  and the same dense rows for the requests it leaves.

V2's own rejection kernels (``apply_sampling_params``, ``rejection_sample``) run after both,
unchanged, and are left out of both times: the ratio is that of the part CSV replaces. Every
certified request's accepted drafts and next token are checked against V2's verification
replayed in float64 on the dense rows (:func:`vllm_csv.testing.audit_verify.replay`); a
difference stops the run. The head's weights are random (peaked rows, hidden states near rows),
drafts the row's dense best token (``--accept`` of the time) or a random one of its next seven:
the certified share says little about a learned model; the time is the point.

Usage: python benchmarks/v2_verify_gpu.py [--vocab V] [--hidden D] [--requests 1 8 16] [--json PATH]
       (``--device cpu`` runs the same on the CPU: a smoke test, not a GPU figure)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from timing import times_ms


def _batch(W: torch.Tensor, R: int, k: int, temp: float, accept: float, probabilistic: bool, g, dev):
    """One batch of ``R`` requests of ``k`` drafts: hidden states, seeds, positions, temperatures,
    drafts, offsets, the drafter's logits (``probabilistic``) and the dense rows' ``x`` (V2's
    kernels' input, for the replay)."""
    from vllm_csv.testing.heads import hidden_near_rows

    N, cu = R * (k + 1), list(range(0, R * (k + 1) + 1, k + 1))
    h = hidden_near_rows(W, N, g, scale=2.0)
    dense = (h.float() @ W.float().T)
    top = dense.topk(8, 1).indices
    drafts = torch.full((N,), -1, dtype=torch.long)
    for i in range(R):
        for j in range(k):
            r = cu[i] + j
            best = bool(torch.rand(1, generator=g) < accept)
            drafts[r] = top[r, 0 if best else int(torch.randint(1, 8, (1,), generator=g))]
    seeds = torch.repeat_interleave(torch.randint(-2**62, 2**62, (R,), generator=g), k + 1)
    pos = torch.cat([torch.arange(k + 1) + int(torch.randint(0, 2**20, (1,), generator=g)) for _ in range(R)])
    t = torch.full((N,), temp)
    draft = dense + 0.5 * torch.randn(dense.shape, generator=g) if probabilistic else None
    return (h.to(dev), seeds.to(dev), pos.to(dev), t.to(dev), drafts.to(dev), cu,
            None if draft is None else draft.to(dev))


def main() -> None:
    from vllm_csv import CertifiedHead, HeadConfig
    from vllm_csv.sampling.head_adapter import HeadAdapter
    from vllm_csv.sampling.verify_v2 import certify_verification_v2
    from vllm_csv.sampling.verify_v2_fused import verify_fused
    from vllm_csv.testing.audit_verify import replay
    from vllm_csv.testing.heads import peaked_head
    from vllm_csv.testing.threads import use_test_threads

    use_test_threads()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--drafts", type=int, default=3)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--accept", type=float, default=0.7, help="share of drafts that are the row's best token")
    ap.add_argument("--screen", default="int8")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs CUDA (--device cpu runs a smoke test)")
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    W, g = peaked_head(a.vocab, a.hidden, seed=3)
    Wd = W.to(dev, torch.bfloat16)
    head = CertifiedHead(Wd, config=HeadConfig(screen=a.screen, off_switch=False))
    adapter = HeadAdapter(head)
    fused = head.fused_step()  # (CUDA's int8 head builds it; on a CPU the kernels' references, for the smoke test)
    if fused is None and dev.type == "cpu" and a.screen == "int8":
        from vllm_csv.gpu.step import FusedStep

        fused = FusedStep(head)
    rows_out = []
    for R in a.requests:
        for temp in a.temperatures:
            for probabilistic in (False, True):
                h, seeds, pos, t, drafts, cu, draft = _batch(W.bfloat16(), R, a.drafts, temp, a.accept, probabilistic,
                                                             g, dev)
                last = {}

                def dense():
                    return head.dense_logits(h)

                def finish(res, name):  # the requests left: their rows from the dense head
                    if not bool(res.certified.all()):
                        rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in range(R)
                                          if not bool(res.certified[i])]).to(dev)
                        res.values[rows] = head.dense_logits(h[rows])
                    last[name] = res

                def csv():
                    finish(certify_verification_v2(adapter, h, seeds, pos, t, drafts, cu, draft), "csv")

                def csv_fused():
                    finish(verify_fused(fused, h, seeds, pos, t, drafts, cu, draft_logits=draft), "fused")

                row = {"requests": R, "rows": len(t), "temperature": temp, "probabilistic": probabilistic,
                       "dense_ms": statistics.median(times_ms(dense, a.repeats, sync))}
                paths = [("csv", csv)] + ([("fused", csv_fused)] if fused is not None else [])
                x = head.dense_logits(h).float().cpu()
                x = torch.where(t.cpu()[:, None] == 1.0, x, x / t.cpu()[:, None])
                qx = None if draft is None else torch.where(t.cpu()[:, None] == 1.0, draft.cpu(), draft.cpu() / t.cpu()[:, None])
                want = replay(x, drafts.cpu(), seeds.cpu(), pos.cpu(), cu, qx)
                for name, fn in paths:
                    ms = statistics.median(times_ms(fn, a.repeats, sync))
                    res = last[name]
                    cert = res.certified.tolist()
                    wrong = sum(ok and (res.accepted[i], res.token[i]) != want[i] for i, ok in enumerate(cert))
                    if wrong:
                        sys.exit(f"{name} R={R} T={temp} probabilistic={probabilistic}: {wrong} certified requests "
                                 "differ from V2's verification replayed on the dense rows")
                    sfx = "" if name == "csv" else "_fused"
                    row.update({f"csv{sfx}_ms": ms, f"speedup{sfx}": row["dense_ms"] / ms,
                                f"certified_share{sfx}": sum(cert) / R, f"scored{sfx}": res.scored, f"wrong{sfx}": wrong})
                    print(f"R={R} ({row['rows']} rows) T={temp} {'probabilistic' if probabilistic else 'one-hot'} "
                          f"{name}: dense {row['dense_ms']:.3f} ms, CSV {ms:.3f} ms ({row['dense_ms'] / ms:.2f}x), "
                          f"certified {sum(cert)}/{R}, {res.scored} tokens scored")
                rows_out.append(row)
    if a.json:
        import os

        from provenance import commit, machine

        report = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke test)",
                  "torch": torch.__version__, "cuda": torch.version.cuda, "vocab": a.vocab, "hidden": a.hidden,
                  "screen": a.screen, "drafts": a.drafts, "accept": a.accept, "command": " ".join(sys.argv),
                  "commit": os.environ.get("VLLM_CSV_COMMIT") or commit(), "machine": machine(dev.type),
                  "rows": rows_out}
        Path(a.json).write_text(json.dumps(report, indent=1))
        if dev.type == "cuda":
            try:
                from record import record_run  # one row a measurement in benchmarks/results/results.csv
            except ImportError as e:  # (a GPU box without pydantic: the JSON above is the record)
                print(f"[record] not recorded ({e})")
            else:
                record_run("v2_verify_gpu", report, source=a.json)


if __name__ == "__main__":
    main()
