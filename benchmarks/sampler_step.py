"""One deferred sampler step (rows certified in vLLM's sampler) against vLLM's dense step, standalone.

    python benchmarks/sampler_step.py --batches 1 8 --threads 1 --json out.json
    python benchmarks/sampler_step.py --batches 8 --profile          # torch.profiler table
    python benchmarks/sampler_step.py --batches 8 --cprofile         # cProfile (Python time)
    SORT=tottime CALLERS=nan_to_num python benchmarks/sampler_step.py --batches 8 --cprofile
                                                                     # ... sorted, and who calls what

Rows: the deferred modes of ``benchmarks/serve.py``'s MIXED workload in turn (temperature,
top-p, min-p, penalties on greedy rows, logit_bias; ``--modes`` for others, e.g. ``top_k``, or
``greedy``: plain greedy rows, certified in the head as the plugin's layer does), on
real hidden states of the learned fixture (``vllm_csv.testing.fixtures``; ``--model DIR`` for
another model), bf16 head, the server's default screen.

* dense: vLLM's own head (:class:`lm_head.VllmDenseHead`, oneDNN on CPU) and then vLLM's
  ``Sampler.forward`` on the dense logits -- what a server without CSV does for these rows;
* CSV: the placeholder rows the plugin's head leaves, then the wrapped ``Sampler.forward``
  (:mod:`vllm_csv.vllm_plugin.v1.sampler`: screen, certificate, exact scoring, vLLM's
  sampler on the certified rows; dense head for the rows it cannot certify).

Both see the same metadata and the same seeds; the script checks they draw the same tokens.
``--suppress N``: a model that sets ``N`` fixed tokens to ``-inf`` after the head (Gemma 4's
``suppress_tokens``) on both sides; CSV then certifies greedy rows in the head over them (their
top ``1 + N``: ``Plan.over_mask``; the model's ``compute_logits`` wrapper checks them and hands
their argmaxes on: ``step.over_mask_tokens``) and defers the others, whose ``-inf`` the sampler
reads off the placeholders.
Timings are medians over ``--repeats`` interleaved runs, on whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch


MODES = ("temperature", "top_p", "min_p", "penalties", "logit_bias")  # serve.py's MIXED deferred modes
# top_k 20 (above: 0.9 top-p / 0.1 min-p too), T 0.8; greedy: plain greedy rows, certified in the head
ALL_MODES = MODES + ("top_k", "top_k_top_p", "top_k_min_p", "greedy")


def metadata(B: int, V: int, out_tokens: list[list[int]], prompt: torch.Tensor, cycle=MODES):
    """vLLM's SamplingMetadata for ``B`` rows cycling through ``cycle`` (default :data:`MODES`, with
    the parameters of serve.py's MIXED workload), as ``InputBatch`` builds it on CPU."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    from vllm_csv.testing.fakes import logit_bias_processor, min_p_processor

    modes = [cycle[i % len(cycle)] for i in range(B)]
    temp = torch.tensor([0.0 if m in ("penalties", "greedy") else 0.8 for m in modes])
    top_p = torch.tensor([0.9 if m in ("top_p", "top_k_top_p") else 1.0 for m in modes])
    top_k = torch.tensor([20 if m.startswith("top_k") else V for m in modes])
    min_p = torch.tensor([0.1 if m in ("min_p", "top_k_min_p") else 0.0 for m in modes])
    mp = min_p_processor(min_p)
    lb = logit_bias_processor({i: {10: 3.0, 50: -5.0, 300: 2.0} for i, m in enumerate(modes) if m == "logit_bias"})
    pen = [m == "penalties" for m in modes]
    gens = {i: torch.Generator().manual_seed(100 + i) for i in range(B) if temp[i] > 0}
    return modes, SamplingMetadata(
        temperature=temp, all_greedy=bool((temp == 0).all()), all_random=bool((temp > 0).all()),
        top_p=top_p if bool((top_p < 1).any()) else None, top_k=top_k if bool((top_k < V).any()) else None,
        generators=gens,
        max_num_logprobs=None, no_penalties=not any(pen), prompt_token_ids=prompt,
        frequency_penalties=torch.tensor([0.3 if p else 0.0 for p in pen]),
        presence_penalties=torch.tensor([0.5 if p else 0.0 for p in pen]),
        repetition_penalties=torch.tensor([1.2 if p else 1.0 for p in pen]),
        output_token_ids=out_tokens, allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors([mp, lb]), spec_token_ids=[[] for _ in range(B)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512, help="fixture hidden size")
    p.add_argument("--model", default=None, help="a Hugging Face model directory instead of the fixture")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=ALL_MODES, help="the rows' modes, in turn")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=40, help="distinct hidden-state batches (positions / B)")
    p.add_argument("--repeats", type=int, default=3, help="passes over the steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--screen", default="auto")
    p.add_argument("--budget", type=float, default=None, help="HeadConfig.budget (default: its default)")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of the CSV step")
    p.add_argument("--cprofile", action="store_true", help="cProfile of the CSV step")
    p.add_argument("--suppress", type=int, default=0,
                   help="a model that sets N fixed tokens to -inf after the head (Gemma 4's suppress_tokens): "
                        "both sides write them; CSV certifies greedy rows in the head over them "
                        "(Plan.over_mask), the others in the sampler")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)

    from vllm_csv.testing.fixtures import fixture
    from lm_head import VllmDenseHead, hidden_states
    from provenance import commit, machine
    from vllm.v1.sample.sampler import Sampler

    from vllm_csv import CertifiedHead, HeadConfig
    from vllm_csv.hf_head import load_lm_head
    from vllm_csv.sampling.head_adapter import HeadAdapter
    from vllm_csv.testing.fakes import Tally, hand_off
    from vllm_csv.vllm_plugin import patches, step as plugin_step

    model = Path(a.model) if a.model else fixture(a.hidden)
    lm = load_lm_head(model)
    W = lm.weight.to(torch.bfloat16)
    npos = a.steps * max(a.batches)
    H = hidden_states(model, npos, "cpu").to(torch.bfloat16)
    extra = {} if a.budget is None else {"budget": a.budget}
    head = CertifiedHead(W, config=HeadConfig(screen=a.screen, off_switch=False, **extra))
    vhead = VllmDenseHead(W)
    adapter = HeadAdapter(head)
    patches.install_samplers()
    sampler = Sampler()
    V = head.vocab_size
    g = torch.Generator().manual_seed(0)
    results = {"machine": machine("cpu"), "commit": commit(), "threads": a.threads, "screen": head.screen.name,
               "budget": head.config.budget, "model": model.name, "modes": a.modes, "suppress": a.suppress,
               "command": " ".join(sys.argv), "loadavg_before": os.getloadavg(), "rows": []}
    # the suppressed tokens: the dense argmax of the first rows, then others at random (they matter)
    top = vhead(H[: a.suppress]).float().argmax(-1).tolist() if a.suppress else []
    order = dict.fromkeys(top + torch.randperm(V, generator=torch.Generator().manual_seed(1)).tolist())
    suppressed = torch.tensor(list(order)[: a.suppress], dtype=torch.long)
    mask = torch.zeros(V, dtype=torch.bool)
    mask[suppressed] = True

    for B in a.batches:
        hs = [H[i * B:(i + 1) * B] for i in range(a.steps)]
        outs = [[torch.randint(0, V, (20,), generator=g).tolist() for _ in range(B)] for _ in range(a.steps)]
        prompt = torch.randint(0, V, (B, 16), generator=g)
        modes, md = metadata(B, V, outs[0], prompt, tuple(a.modes))

        def reset(s):
            md.output_token_ids[:] = outs[s]
            torch.manual_seed(s)
            for i, gen in md.generators.items():
                gen.manual_seed(100 + i + s)

        def post(logits):  # the model's compute_logits after the head (--suppress)
            return logits.index_fill_(1, suppressed, -float("inf")) if a.suppress else logits

        def dense_step(s):
            return sampler(logits=post(vhead(hs[s])), sampling_metadata=md).sampled_token_ids[:, 0]

        stats, head_stats = [], []  # the sampler's DeferredStats, the head's StepStats

        # greedy rows in the head (k = 1; over a suppression, the head leaves its tokens out: Plan.over_mask)
        exclude = suppressed if a.suppress else None
        in_head = torch.tensor([i for i, m in enumerate(modes) if m == "greedy"], dtype=torch.long)
        rows = torch.tensor([i for i, m in enumerate(modes) if m != "greedy"], dtype=torch.long)

        def csv_step(s):
            # as the plugin's layer: greedy rows certified in the head, the others deferred
            h = hs[s]
            every = in_head.numel() == B
            logits = torch.empty((B, V), dtype=W.dtype)
            handoff = over = None
            if in_head.numel():
                part, hst = head.sampler_logits(h if every else h[in_head],
                                                torch.ones(in_head.numel(), dtype=torch.long), exclude=exclude)
                head_stats.append(hst)
                if every:
                    logits = part
                    if head.last_top1 is not None and hst.certified == B:
                        handoff = plugin_step.Top1(logits, head.last_top1)
                else:
                    logits[in_head] = part.to(W.dtype)
                got = head.last_certified
                if exclude is not None and bool(got.any()):  # (the layer's _over_mask)
                    over = (in_head[got], None if head.last_top1 is None else head.last_top1[got])
                    logits[over[0][:, None], exclude[None]] = plugin_step.SUPPRESSED_PROBE
            if rows.numel():
                logits[rows] = plugin_step.PLACEHOLDER
                handoff = plugin_step.Deferred(
                    logits, h[rows].clone(), rows, [modes[i] for i in rows], adapter, lambda: vhead(h),
                    Tally(stats.append).account(), suppressed=mask if a.suppress else None)
            out = post(logits)
            if over is not None:  # (the plugin's compute_logits wrapper: patches.watch_logits)
                assert plugin_step.over_mask_tokens(out, over[0], exclude, over[1]) is not None
            hand_off(sampler, handoff)
            return sampler(logits=out, sampling_metadata=md).sampled_token_ids[:, 0]

        td, tc, mism = [], [], 0
        for rep in range(a.repeats + 1):  # the first pass warms up
            for s in range(a.steps):
                reset(s)  # the same seeds and outputs for both (untimed: manual_seed is slow)
                t0 = time.perf_counter()
                want = dense_step(s)
                t1 = time.perf_counter()
                reset(s)
                t2 = time.perf_counter()
                got = csv_step(s)
                t3 = time.perf_counter()
                mism += int((want != got).sum())
                if rep:
                    td.append((t1 - t0) * 1e3)
                    tc.append((t3 - t2) * 1e3)
                else:
                    stats.clear()
                    head_stats.clear()
        cert = sum(sum(st.certified.values()) for st in stats) + sum(st.certified for st in head_stats)
        fallbacks: dict[str, int] = {}
        for st in stats + head_stats:
            for r, n in st.fallbacks.items():
                fallbacks[r] = fallbacks.get(r, 0) + n
        row = {"batch": B, "dense_ms": statistics.median(td), "csv_ms": statistics.median(tc),
               "dense_min_ms": min(td), "csv_min_ms": min(tc),
               "certified_share": cert / max(1, sum(st.rows for st in stats) + sum(st.rows for st in head_stats)),
               # (no deferred rows, --modes greedy alone: nothing scored in the sampler)
               "scored_mean": statistics.mean(st.scored for st in stats) if stats else 0.0, "fallbacks": fallbacks,
               "mismatches": mism}
        row["speedup"] = row["dense_ms"] / row["csv_ms"]
        results["rows"].append(row)
        print(f"B={B}: dense {row['dense_ms']:.3f} ms, CSV {row['csv_ms']:.3f} ms ({row['speedup']:.2f}x), "
              f"certified {row['certified_share']:.1%}, |S| mean {row['scored_mean']:.1f}, "
              f"fallbacks {fallbacks}, mismatches {mism}")
        if a.profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for s in range(a.steps):
                    reset(s)
                    csv_step(s)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for s in range(a.steps):
                    reset(s)
                    dense_step(s)
            print("dense:\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        if a.cprofile:
            pr = cProfile.Profile()
            pr.enable()
            for s in range(a.steps):
                reset(s)
                csv_step(s)
            pr.disable()
            pstats.Stats(pr).sort_stats(os.environ.get("SORT", "cumulative")).print_stats(35)
            if os.environ.get("CALLERS"):
                pstats.Stats(pr).print_callers(os.environ["CALLERS"])
    results["loadavg_after"] = os.getloadavg()
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
        from record import record_run  # one row a measurement in benchmarks/results/results.csv
        record_run("sampler_step", results, source=a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
