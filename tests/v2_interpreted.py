"""vLLM's V2 sampler pipeline with its own Triton kernels run by Triton's interpreter on the CPU,
with the V2 sampler hook in front of it: a helper of test_sampler_hook_v2.py, run in a
subprocess (``python v2_interpreted.py CASE OUT``).

vLLM disables Triton on a CPU platform (``vllm.triton_utils`` hands out placeholders), so this
process sets ``TRITON_INTERPRET=1`` and points ``vllm.triton_utils`` at the real Triton before
vLLM's V2 sampling modules are imported. The sampler and its states are vLLM's own classes with
host tensors in place of vLLM's pinned (UVA) buffers; ``Sampler.sample`` (processors,
temperature, min-p, ``gumbel_sample``) is vLLM's unchanged code.

CASE (a ``torch.save``'d dict): the head ``W`` ``[V, d]``, hidden states ``h`` ``[B, d]``, the
``screen``, the batch (``slots``, ``positions``, ``logits_indices``, ``input_ids``), the deferred
``rows`` and their ``modes``, the hook ``variants`` to run, ``SLOTS`` and, per slot,
``temp``, ``min_p``, ``seeds``, ``rep``, ``freq``, ``pres``, ``min_tokens``, ``bias`` (``{token: value}`` dicts),
``allowed`` (token lists), ``stop`` (stop token lists, masked while ``min_len`` is not reached),
``bad`` (single-token bad words), ``prompt`` and ``output`` (token lists: the penalties' counts),
optionally ``top_k`` and ``top_p`` per slot (vLLM's Triton top-k / top-p kernels then mask the
batch, :mod:`v2_top_masks_interpreted`), and optionally ``bitmask``: ``{row: [ceil(V / 32)] int32}``, the grammar's packed bitmask of
structured rows, applied to the head's output (the dense logits and the placeholders alike)
before the sampler, as V2's runner applies it (:func:`_grammar`).
OUT gets, per variant of the hook (``ok``; ``no_min_p``: the certificate told no min-p;
``fused``: the head's backend CUDA's, rows without processors drawn by the device draw
(:meth:`vllm_csv.gpu.step.FusedStep.draw_v2`); ``fused_no_min_p`` / ``fused_no_mask``: that draw
told no min-p / no grammar mask / no processors;
``no_process``: no processors; ``no_drop``: min-p's dropped tokens left in the written row;
``no_mask``: the certificate told no grammar mask; ``no_top`` / ``fused_no_top``: the
certificate / the device draw told no top-k or top-p rows; ``top_max_only``: the certificate told
every masked row's mask, but not the ``k`` of a top-k alone (the maximum's rule only); ``none``: no row certified, every row the
dense path's), the tokens drawn from the hook's rows and its counts, and the tokens drawn from
the dense logits.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"


def _uva(a):
    import torch

    return SimpleNamespace(np=a, gpu=torch.from_numpy(a))


def _sampler(c):
    """vLLM's V2 ``Sampler`` and states (made without ``__init__``: no CUDA), filled from ``c``."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu.sample.bad_words import BadWordsState
    from vllm.v1.worker.gpu.sample.logit_bias import LogitBiasState
    from vllm.v1.worker.gpu.sample.penalties import PenaltiesState
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.sample.states import SamplingStates
    from vllm.v1.worker.gpu.sample.thinking_budget import ThinkingBudgetState

    S, V = c["SLOTS"], c["W"].shape[0]
    ss = SamplingStates.__new__(SamplingStates)
    ss.max_num_reqs, ss.vocab_size = S, V
    ss.temperature, ss.min_p = _uva(np.asarray(c["temp"], np.float32)), _uva(np.asarray(c["min_p"], np.float32))
    ss.top_k = _uva(np.asarray(c.get("top_k", [V] * S), np.int32))
    ss.top_p = _uva(np.asarray(c.get("top_p", [1.0] * S), np.float32))
    ss.seeds, ss.seeds_set = _uva(np.asarray(c["seeds"], np.int64)), np.ones(S, bool)
    ss.num_logprobs = np.full(S, -1, np.int32)

    lb = LogitBiasState.__new__(LogitBiasState)
    prompt_len = np.array([len(p) for p in c["prompt"]], np.int32)
    lb.prompt_len_np = prompt_len
    lb.num_allowed_token_ids = _uva(np.array([len(a) for a in c["allowed"]], np.int32))
    lb.allowed_token_ids = SimpleNamespace(gpu=torch.zeros(S, 1024, dtype=torch.int32))
    lb.num_logit_bias = _uva(np.array([len(b) for b in c["bias"]], np.int32))
    lb.logit_bias_token_ids = SimpleNamespace(gpu=torch.zeros(S, 1024, dtype=torch.int32))
    lb.logit_bias = SimpleNamespace(gpu=torch.zeros(S, 1024))
    lb.min_lens = _uva(prompt_len + np.asarray(c["min_tokens"], np.int32))
    lb.num_stop_token_ids = _uva(np.array([len(s) for s in c["stop"]], np.int32))
    lb.restore_when_all_masked = _uva(np.zeros(S, np.int32))
    lb.stop_token_ids = SimpleNamespace(gpu=torch.zeros(S, 128, dtype=torch.int32))
    for i in range(S):
        lb.allowed_token_ids.gpu[i, :len(c["allowed"][i])] = torch.tensor(c["allowed"][i], dtype=torch.int32)
        ids, vals = list(c["bias"][i]), list(c["bias"][i].values())
        lb.logit_bias_token_ids.gpu[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        lb.logit_bias.gpu[i, :len(ids)] = torch.tensor(vals, dtype=torch.float32)
        lb.stop_token_ids.gpu[i, :len(c["stop"][i])] = torch.tensor(c["stop"][i], dtype=torch.int32)
    lb.use_logit_bias = (lb.num_allowed_token_ids.np > 0) | (lb.num_logit_bias.np > 0) | \
        ((lb.num_stop_token_ids.np > 0) & (np.asarray(c["min_tokens"]) > 0))

    pen = PenaltiesState.__new__(PenaltiesState)
    pen.repetition_penalty = _uva(np.asarray(c["rep"], np.float32))
    pen.frequency_penalty = _uva(np.asarray(c["freq"], np.float32))
    pen.presence_penalty = _uva(np.asarray(c["pres"], np.float32))
    pen.use_penalty = (pen.repetition_penalty.np != 1) | (pen.frequency_penalty.np != 0) | \
        (pen.presence_penalty.np != 0)
    pen.prompt_bin_mask = torch.zeros(S, (V + 31) // 32, dtype=torch.int32)
    pen.output_bin_counts = torch.zeros(S, V, dtype=torch.int32)
    for i in range(S):
        for t in c["prompt"][i]:
            pen.prompt_bin_mask[i, t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -2**31
        for t in c["output"][i]:
            pen.output_bin_counts[i, t] += 1

    bw = BadWordsState.__new__(BadWordsState)
    L = max(map(len, c["prompt"])) + max(map(len, c["output"])) + 1
    all_ids = torch.zeros(S, L, dtype=torch.int32)
    for i in range(S):
        seq = list(c["prompt"][i]) + list(c["output"][i])
        all_ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.int32)
    total = np.array([len(p) + len(o) for p, o in zip(c["prompt"], c["output"])], np.int32)
    bw.req_states = SimpleNamespace(all_token_ids=SimpleNamespace(gpu=all_ids), prompt_len=_uva(prompt_len),
                                    total_len=SimpleNamespace(gpu=torch.from_numpy(total)))
    nb = max(1, max(map(len, c["bad"])))
    bw.bad_word_token_ids = SimpleNamespace(gpu=torch.zeros(S, nb, dtype=torch.int32))
    bw.bad_word_offsets = SimpleNamespace(gpu=torch.zeros(S, nb + 1, dtype=torch.int32))
    bw.num_bad_words = _uva(np.array([len(b) for b in c["bad"]], np.int32))
    for i in range(S):
        n = len(c["bad"][i])
        bw.bad_word_token_ids.gpu[i, :n] = torch.tensor(c["bad"][i], dtype=torch.int32)
        bw.bad_word_offsets.gpu[i, :n + 1] = torch.arange(n + 1, dtype=torch.int32)

    tb = ThinkingBudgetState.__new__(ThinkingBudgetState)
    tb.enabled = False
    s = Sampler.__new__(Sampler)
    s.sampling_states, s.logits_processors, s.thinking_budget_state = ss, [lb, pen, bw], tb
    s.use_fp64_gumbel, s.trace_replay_state, s.return_sampling_mask = False, None, False
    s.use_flashinfer = s.use_xpu_sampler = False
    s.needs_logits_processing = (ss.temperature.np != 0) & (
        (ss.temperature.np != 1) | (ss.min_p.np != 0)) | lb.use_logit_bias | pen.use_penalty | (bw.num_bad_words.np > 0)
    return s


def _grammar(c: dict, B: int):
    """V2's ``StructuredOutputsWorker.apply_grammar_bitmask`` on a ``[B, V]`` batch of one logit
    row per request, on the rows of ``c["bitmask"]``, in place. V2's kernel
    (``_apply_grammar_bitmask_kernel``) is "adapted from" xgrammar's and writes what it writes
    (exactly ``-inf`` on the tokens whose bit is clear, below ``V``; nothing else), but Triton's
    interpreter cannot run its masked store ("mask has unsupported dtype"): xgrammar's own CPU
    kernel runs instead, on an fp32 copy (as vLLM's V1 path does on the CPU: an exact round
    trip for bf16)."""
    import torch
    import xgrammar

    order = sorted(c["bitmask"])
    words = c["bitmask"][order[0]].numel()
    bitmask = torch.full((B, words), -1, dtype=torch.int32)  # (rows without a grammar: every token allowed)
    for r in order:
        bitmask[r] = c["bitmask"][r]

    def apply(logits):
        x = logits.float()
        xgrammar.apply_token_bitmask_inplace(x, bitmask, indices=order)
        return logits.copy_(x)

    return apply


def run(c: dict) -> dict:
    import torch
    import triton
    import triton.language as tl
    import vllm.triton_utils as tu

    tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True  # before vLLM's V2 sampling modules are imported
    if "top_k" in c or "top_p" in c:  # vLLM's top-k / top-p kernels, runnable by the interpreter
        from pathlib import Path

        from v2_top_masks_interpreted import load

        from vllm_csv.vllm_plugin.v2 import known

        sys.modules["vllm.v1.sample.ops.topk_topp_triton"], origin = load()
        # (the hook's gate reads the loaded module's file, this copy with one line changed for the
        # interpreter: it is given the verdict on vLLM's own file instead)
        known._checked["top-k / top-p kernels"] = known.matching_release(
            known.masks_fingerprint(Path(origin).parent), known.KNOWN_MASKS)
    overlay = os.environ.get("VLLM_CSV_V2_SAMPLE_OVERLAY")  # another release's V2 sampling files (test_vllm033.py)
    if overlay:
        from vllm_csv.testing.vllm_v2 import overlay_vllm_v2_sample

        overlay_vllm_v2_sample(overlay)
    from vllm_csv import CertifiedHead, HeadConfig
    from vllm_csv.sampling import rows_v2
    from vllm_csv.sampling.head_adapter import HeadAdapter
    from vllm_csv.testing.fakes import Tally
    from vllm_csv.vllm_plugin import step as csv_step
    from vllm_csv.vllm_plugin.v2 import sampler as v2_sampler

    W, h, B = c["W"], c["h"], c["h"].shape[0]
    head = CertifiedHead(W, config=HeadConfig(screen=c["screen"], off_switch=False, budget=c.get("budget", 0.05)))
    slots = c["slots"].to(torch.int32)
    batch = SimpleNamespace(num_reqs=B, idx_mapping_np=slots.long().numpy(), expanded_idx_mapping=slots,
                            idx_mapping=slots, positions=c["positions"], logits_indices=c["logits_indices"],
                            input_ids=c["input_ids"], expanded_local_pos=torch.zeros(B, dtype=torch.int32),
                            seq_lens_cpu_upper_bound=torch.full((B,), 64, dtype=torch.int32))
    sampler = _sampler(c)
    rows = torch.tensor(c["rows"])
    dense = head.dense_logits(h)

    def draw(logits):
        return sampler.sample(logits.clone(), batch.expanded_idx_mapping, batch.idx_mapping, batch.idx_mapping_np,
                              batch.positions[batch.logits_indices], batch.input_ids[batch.logits_indices],
                              batch.expanded_local_pos, batch.seq_lens_cpu_upper_bound.numpy())[0]

    real = rows_v2.certify_rows_v2

    def none(*a, **k):
        r = real(*a, **k)
        return rows_v2.RowsResult(r.values, torch.zeros_like(r.certified), r.winner,
                                  ["uncertified"] * r.certified.numel(), r.scored)

    variants = {
        "ok": real,
        "no_min_p": lambda *a, min_p=None, **k: real(*a, **k),
        "no_process": lambda *a, process=None, **k: real(*a, **k),
        "no_mask": lambda *a, masked=None, **k: real(*a, **k),
        "no_top": lambda *a, top=None, **k: real(*a, **k),
        "top_max_only": lambda *a, top=None, **k: real(*a, top=None if top is None else top != 0, **k),
        "none": none,
        "fused": real, "fused_no_min_p": real, "fused_no_mask": real, "fused_no_process": real, "fused_no_top": real,
    }
    grammar = _grammar(c, B) if c.get("bitmask") else (lambda x: x)
    dense = grammar(dense)
    from vllm_csv.vllm_plugin.v2 import known

    out = {"dense": draw(dense), "rows": rows, "sampler_file": sys.modules[type(sampler).__module__].__file__,
           "release": known.matching_release(known.fingerprint())}
    for name in c["variants"]:
        logits = head.dense_logits(h).clone()
        logits[rows] = csv_step.PLACEHOLDER
        logits = grammar(logits)  # (V2's runner: the bitmask on the head's output, then the sampler)
        d = csv_step.Deferred(logits, h[rows].clone(), rows, list(c["modes"]), HeadAdapter(head),
                              lambda: head.dense_logits(h), Tally().account())
        bounds, draw_rows, backend, fused = rows_v2.min_p_bounds, v2_sampler.draw_rows, head.backend, head._fused
        if name.startswith("fused"):  # the CUDA backend's device draw (its kernels interpreted here)
            from vllm_csv.gpu.step import FusedStep
            from vllm_csv.head.backend import Cuda

            head.backend, head._fused = Cuda(), FusedStep(head)
            drawn = []  # the rows the device draw took

            def device_draw(*a, **k):
                drawn.append(int(a[1].shape[0]))
                if name == "fused_no_min_p":
                    return draw_rows(*a[:5], None, *a[6:], **k)  # (told no min-p)
                if name == "fused_no_mask":
                    return draw_rows(*a[:6], None, *a[7:], **k)  # (told no grammar mask)
                if name == "fused_no_process":
                    return draw_rows(*a[:7])  # (told no processors)
                if name == "fused_no_top":
                    return draw_rows(*a[:8])  # (told no top-k / top-p rows)
                return draw_rows(*a, **k)

            v2_sampler.draw_rows = device_draw
        if name == "no_drop":  # the certificate as it is; the written row keeps the dropped tokens
            rows_v2.min_p_bounds = lambda *a: (*bounds(*a)[:2], torch.zeros((), dtype=torch.bool))
        else:
            v2_sampler.certify_rows_v2 = variants[name]
        try:
            st = v2_sampler.resolve(sampler, d, logits, batch)
        finally:
            v2_sampler.certify_rows_v2, rows_v2.min_p_bounds, v2_sampler.draw_rows = real, bounds, draw_rows
            head.backend, head._fused = backend, fused
        out[name] = {"draw": draw(logits), "certified": dict(st.certified), "fallbacks": dict(st.fallbacks)}
        if name.startswith("fused"):
            out[name]["device_rows"] = sum(drawn)
    return out


if __name__ == "__main__":
    import torch

    torch.save(run(torch.load(sys.argv[1], weights_only=False)), sys.argv[2])
