"""Learned heads on a GPU: a model trained on the device, its own hidden states, the fused step
audited against cuBLAS and timed (issue 44: ">= 99% of greedy rows certified on learned heads
trained on the GPU ... and 0 mismatches in >= 100k certified rows").

    python benchmarks/gpu_learned.py --json results/gpu/gpu_learned.json \
        [--recipes demo] [--steps 800] [--batch 32] [--rows 102400] [--batches 1 8 64] [--budget-s 170]

Per recipe (:mod:`vllm_csv.demo_model`'s, e.g. ``demo``: V 65536, d 768, trained ``--steps``
steps of ``--batch`` sequences on the device instead of the CPU recipe's 60 of 8):

1. **train** the tokenizer and the model there (:func:`vllm_csv.demo_model.train`, its corpus the
   standard library's source up to the recipe's size);
2. **hidden states**: the model in bf16 reads held-out text (standard-library files the corpus
   leaves out: :func:`held_out_ids`), sequences of the recipe's length, teacher-forced; the
   final norm's outputs, what vLLM's ``LogitsProcessor`` hands the head, are the rows;
3. **greedy audit**: every row through :meth:`vllm_csv.gpu.step.FusedStep.run` (k = 1) in batches
   of each ``--batches`` size, each certified id against ``F.linear(h, W).argmax(-1)`` of the same
   batch (cuBLAS bf16, first maximum); and a top-8-with-values pass against the dense stable sort;
4. **speed** at each batch size on the first rows: dense (cuBLAS + argmax) against the step, both
   CUDA-graph replayed, rounds interleaved (as ``gpu_step.py``);
5. **diagnosis** (``--diagnose-rows``): why rows are not live, estimated per candidate rule
   (:func:`diagnose`);
6. **V2 draw** (where vLLM's V2 ``gumbel.py`` loads, ``VLLM_V2_GUMBEL_PY`` as ``run_gpu.sh`` sets
   it): :meth:`FusedStep.draw_v2` at each ``--temps`` on batches of 64 rows, each certified token
   against V2's ``gumbel_sample`` on the dense logits (same seeds and positions).

Rows (JSON list, ``gpu_step.py``'s form, ``head=learned:<recipe>``): ``measure=audit_*`` (rows,
certified, mismatches) and timed measures (ms, speed-up against ``dense``). Work stops starting
once ``--budget-s`` has passed; the JSON is written after every phase. Runs on the CPU under
``TRITON_INTERPRET=1`` for a smoke test (``--device cpu --recipes test --steps 3 --rows 256``: no
timing there).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import sysconfig
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_step import graphed, provenance, replay_ms, topk_wrong
from vllm_csv import CertifiedHead, HeadConfig, demo_model
from vllm_csv.gpu.step import FusedStep

RECIPES = {"demo": demo_model.DEMO, "test": demo_model.TEST,
           # a wider head: d 2048, as the 1-3B models' (V 65536 keeps the tokenizer's training short)
           "wide": replace(demo_model.DEMO, hidden_size=2048, heads=16)}


def held_out_ids(tok_path: Path, n_tokens: int, recipe) -> torch.Tensor:
    """``n_tokens`` token ids of text the recipe's corpus leaves out: the standard library's ``.py``
    files outside :func:`vllm_csv.demo_model.corpus_files` (its ``test`` package, where the
    machine's Python has it, and the files past the corpus's size cut), in sorted order, each
    followed by the end-of-text id."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id("<|endoftext|>")
    seen = set(demo_model.corpus_files(recipe.corpus_bytes, recipe.exclude))
    ids: list[int] = []
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if p in seen or "site-packages" in p.parts:
            continue
        try:
            ids += tok.encode(p.read_text(errors="replace")).ids + [eos]
        except OSError:
            continue
        if len(ids) >= n_tokens:
            break
    if len(ids) < n_tokens:
        raise SystemExit(f"only {len(ids)} held-out tokens (asked for {n_tokens})")
    return torch.tensor(ids[:n_tokens], dtype=torch.long)


@torch.no_grad()
def hidden_states(model_dir: Path, n_rows: int, recipe, dev: torch.device):
    """``(h [n_rows, d], W [V, d])`` bf16 on ``dev``: the model's final-norm outputs over held-out
    text and its LM head's weight."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev).eval()
    n_seq = math.ceil(n_rows / recipe.seq_len)
    x = held_out_ids(model_dir / "tokenizer.json", n_seq * recipe.seq_len, recipe).view(n_seq, recipe.seq_len)
    hs = [model.model(input_ids=x[i:i + 64].to(dev)).last_hidden_state.reshape(-1, model.config.hidden_size)
          for i in range(0, n_seq, 64)]
    W = model.lm_head.weight.detach().contiguous()
    return torch.cat(hs)[:n_rows].contiguous(), W


def greedy_audit(st: FusedStep, W, h, B: int, n_rows: int) -> dict:
    """Certified ids of the first ``n_rows`` rows, in batches of ``B``, against the dense argmax of
    the same batch; the codes of the rows that were not certified, counted."""
    k1 = torch.ones(B, dtype=torch.int32, device=h.device)
    need0 = torch.zeros(B, dtype=torch.int8, device=h.device)
    rows = cert = mism = 0
    codes: dict[int, int] = {}
    for i in range(0, n_rows - B + 1, B):
        x = h[i:i + B]
        ids, _, code, _ = st.run(x, k1, need0, 1)
        dense = F.linear(x, W).argmax(-1)
        c = code == 0
        rows += B
        cert += int(c.sum())
        mism += int((c & (ids[:, 0] != dense)).sum())
        for v in code[~c].tolist():
            codes[v] = codes.get(v, 0) + 1
    return {"rows": rows, "certified": cert, "mismatches": mism, "codes": {str(k): v for k, v in sorted(codes.items())}}


def topk_audit(st: FusedStep, W, h, k: int, n_rows: int, B: int = 64) -> dict:
    """Top-``k`` ids and value bits of certified rows against the dense stable sort."""
    kk = torch.full((B,), k, dtype=torch.int32, device=h.device)
    need1 = torch.ones(B, dtype=torch.int8, device=h.device)
    rows = cert = mism = 0
    for i in range(0, n_rows - B + 1, B):
        x = h[i:i + B]
        ids, vals, code, _ = st.run(x, kk, need1, k)
        c, w = topk_wrong(x, W, ids, vals, code, k)
        rows += B
        cert += c
        mism += w
    return {"rows": rows, "certified": cert, "mismatches": mism}


def draw_audit(st: FusedStep, W, h, v2, T: float, n_rows: int, B: int = 64, seed: int = 0) -> dict:
    """V2's Gumbel draw at temperature ``T``, certified on the device, against ``gumbel_sample`` on
    the dense logits of the same batch (same seeds and positions)."""
    g = torch.Generator().manual_seed(seed)
    dev = h.device
    idx = torch.arange(B, dtype=torch.int32, device=dev)
    temp = torch.full((B,), T, device=dev)
    rows = cert = mism = 0
    for i in range(0, n_rows - B + 1, B):
        x = h[i:i + B]
        seeds = torch.randint(-2**62, 2**62, (B,), generator=g).to(dev)
        pos = torch.randint(0, 2**20, (B,), generator=g).to(dev)
        tok, code, _ = st.draw_v2(x, seeds, pos, temp)
        want = v2.gumbel_sample(F.linear(x, W), idx, temp, seeds, pos, apply_temperature=True, is_drafting=False)
        c = code == 0
        rows += B
        cert += int(c.sum())
        mism += int((c & (tok != want)).sum())
    return {"rows": rows, "certified": cert, "mismatches": mism}


@torch.no_grad()
def diagnose(st: FusedStep, h, n_rows: int, B: int = 64) -> list[dict]:
    """Why learned rows are not live: an estimate in float64 (the relative term ``delta``, ``tiny``
    and the bias slack left out, k = 1), per rule, of the tokens and 64-token blocks a row's
    candidates need, and the share of rows within the step's 16 blocks. Rules: ``global`` (the
    step's until ``b6eb19d``: ``rad_max ||h|| + act_coef e`` for every token), ``per_token``
    (token ``i``'s own radius and norm, ``r_i ||h|| + n_i e``), ``two_pass`` (the activation
    quantised twice, the residual by a second int8 code: ``e`` becomes the second residual's
    norm) and ``both`` (the step's since).
    Also the terms' medians and the head's per-token radius against its maximum."""
    from vllm_csv.gpu.common import SUB, batch_tile
    from vllm_csv.gpu.quantize import quantize_rows_ref

    errors = st.head.errors
    r_tok = errors.rad_total(st.screen.r_exact)[0].double()
    n_tok = st.screen.n.double().reshape(-1)
    rad_max, act_coef = float(r_tok.max()), float(n_tok.max()) * (1 + errors.delta)
    qT = st.q.float().T  # (fp32 products: an estimate; exact below 2^24)
    s_tok = st.s.double()
    V = st.V
    rules = ("global", "per_token", "two_pass", "both")
    toks = {r: [] for r in rules}
    blks = {r: [] for r in rules}
    terms = {"rad_term": [], "act_term": [], "act_term_two_pass": [], "gap_y1_y2": [], "peak_to_rms": []}
    for i in range(0, n_rows - B + 1, B):
        x = h[i:i + B]
        p, t, _, hn, ok = quantize_rows_ref(x, True, batch_tile(B), st.guard_scale, st.babs_max)
        p1, t1 = p[0, :B].double(), t[0].double()
        y = (p1.float() @ qT).double() * t1[:, None] * s_tok[None]
        res = x.double() - t1[:, None] * p1
        e = res.norm(dim=1)  # one code (the estimate's; the kernel rounds it up)
        p2, t2 = p[1, :B].double(), t[1].double()
        e2 = (res - t2[:, None] * p2).norm(dim=1)
        y2 = y + (p2.float() @ qT).double() * t2[:, None] * s_tok[None]
        hn = hn.double()
        top2 = y.topk(2, dim=1).values
        terms["rad_term"] += (rad_max * hn).tolist()
        terms["act_term"] += (act_coef * e).tolist()
        terms["act_term_two_pass"] += (act_coef * e2).tolist()
        terms["gap_y1_y2"] += (top2[:, 0] - top2[:, 1]).tolist()
        xf = x.double()
        terms["peak_to_rms"] += (xf.abs().amax(1) / xf.pow(2).mean(1).sqrt()).tolist()
        for rule in rules:
            yy, ee = (y2, e2) if rule in ("two_pass", "both") else (y, e)
            if rule in ("global", "two_pass"):
                half = (rad_max * hn + act_coef * ee)[:, None].expand_as(yy)
            else:
                half = r_tok[None] * hn[:, None] + n_tok[None] * ee[:, None]
            lo = (yy - half).amax(1, keepdim=True)
            cand = (yy + half) >= lo
            toks[rule] += cand.sum(1).tolist()
            pad = (-V) % SUB
            blks[rule] += F.pad(cand, (0, pad)).view(B, -1, SUB).any(2).sum(1).tolist()

    def q(v, p):
        return float(torch.tensor(v, dtype=torch.float64).quantile(p))

    out = [{"measure": "diagnose_terms", **{f"{k}_p50": q(v, 0.5) for k, v in terms.items()},
            "radius_over_max_p50": float((r_tok / r_tok.max()).median()),
            "radius_over_max_p99": float((r_tok / r_tok.max()).quantile(0.99)) if V <= 2**24 else None}]
    for rule in rules:
        b = torch.tensor(blks[rule])
        out.append({"measure": f"diagnose_{rule}", "rows": len(b), "tokens_p50": q(toks[rule], 0.5),
                    "tokens_p99": q(toks[rule], 0.99), "blocks_p50": q(blks[rule], 0.5),
                    "blocks_p99": q(blks[rule], 0.99), "share_within_16_blocks": float((b <= 16).float().mean()),
                    "share_within_64_blocks": float((b <= 64).float().mean())})
    return out


def speed(st: FusedStep, W, h, B: int, iters: int, rounds: int) -> dict:
    """Median ms of dense (cuBLAS + argmax) and of the step on the first ``B`` rows, graph-replayed."""
    x = h[:B].clone()
    k1 = torch.ones(B, dtype=torch.int32, device=h.device)
    need0 = torch.zeros(B, dtype=torch.int8, device=h.device)
    graphs = {"dense": graphed(lambda: F.linear(x, W).argmax(-1)), "step": graphed(lambda: st.run(x, k1, need0, 1))}
    times = {n: [] for n in graphs}
    for _ in range(rounds):
        for n, gr in graphs.items():
            times[n].append(replay_ms(gr, iters))
    return {n: statistics.median(v) for n, v in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=["demo"], choices=sorted(RECIPES))
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=32, help="training sequences a step")
    p.add_argument("--rows", type=int, default=102400, help="held-out hidden states audited (greedy, B = 64)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--small-rows", type=int, default=4096, help="rows audited at batch sizes below 64")
    p.add_argument("--temps", type=float, nargs="*", default=[0.7, 1.0])
    p.add_argument("--draw-rows", type=int, default=12800)
    p.add_argument("--diagnose-rows", type=int, default=8192, help="rows of the live-share diagnosis (0: none)")
    p.add_argument("--no-speed", action="store_true", help="skip the timed phase")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=170.0, help="no new phase starts after this")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default="results/gpu/gpu_learned.json")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    if cuda:
        prov = provenance()
    else:
        prov = {"device": "cpu (Triton interpreter)", "torch": torch.__version__, "dtype": "bfloat16"}
    rows: list[dict] = []
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)

    def left() -> bool:
        return time.perf_counter() - t_start < a.budget_s

    def emit(**r):
        rows.append({**prov, **r})
        out.write_text(json.dumps(rows, indent=1))
        print(json.dumps({k: v for k, v in r.items()}), flush=True)

    from vllm_csv.testing.vllm_v2 import load_vllm_v2_gumbel

    v2 = load_vllm_v2_gumbel() if a.temps else None
    for name in a.recipes:
        if not left():
            break
        recipe = replace(RECIPES[name], steps=a.steps, batch=a.batch)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            tf32 = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True  # training only: the head is what it learns
            try:
                summary = demo_model.train(recipe, Path(tmp), progress=False, device=a.device)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = tf32
            head_name = f"learned:{name}"
            h, W = hidden_states(Path(tmp), a.rows, recipe, dev)
        V, d = W.shape
        base = {"V": V, "d": d, "head": head_name}
        emit(**base, B=None, measure="train", train_loss=summary["train_loss"], val_loss=summary["val_loss"],
             steps=recipe.steps, batch=recipe.batch, seconds=round(time.perf_counter() - t0, 1))
        head = CertifiedHead(W, config=HeadConfig(off_switch=False))
        st = FusedStep(head)
        if a.diagnose_rows and left():
            for r in diagnose(st, h, min(a.rows, a.diagnose_rows)):
                emit(**base, B=64, **r)
        for B in sorted(a.batches, reverse=True):  # B = 64 first: the 100k-row audit
            if not left():
                break
            n = a.rows if B == max(a.batches) else min(a.rows, a.small_rows)
            r = greedy_audit(st, W, h, B, n)
            emit(**base, B=B, measure="audit_learned_greedy", **r)
        if left():
            emit(**base, B=64, measure="audit_learned_top8_values", **topk_audit(st, W, h, 8, min(a.rows, 6400)))
        if cuda and not a.no_speed:
            for B in a.batches:
                if not left():
                    break
                t = speed(st, W, h, B, a.iters, a.rounds)
                for n, ms in t.items():
                    emit(**base, B=B, measure=n, ms=round(ms, 5), baseline="dense",
                         speedup_vs_baseline=round(t["dense"] / ms, 4))
        if v2 is None and a.temps:
            print("V2 draw skipped: no vLLM V2 gumbel.py (VLLM_V2_GUMBEL_PY)", flush=True)
        for T in a.temps if v2 is not None else ():
            if not left():
                break
            emit(**base, B=64, measure=f"audit_learned_v2_draw_T{T}", **draw_audit(st, W, h, v2, T, min(a.rows, a.draw_rows)))
        del h, W, head, st
        if cuda:
            torch.cuda.empty_cache()
    print(f"gpu_learned: {time.perf_counter() - t_start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
