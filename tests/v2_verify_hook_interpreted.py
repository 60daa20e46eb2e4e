"""The V2 verification hook (``vllm_csv/vllm_plugin/v2/verify.py``) in front of vLLM's V2
``RejectionSampler`` with vLLM's own V2 logits processors, their Triton kernels and the rejection
kernels run by Triton's interpreter on the CPU: a helper of test_spec_decode_v2.py, run in a
subprocess (``python v2_verify_hook_interpreted.py CASE OUT``).

CASE (a ``torch.save``'d dict): the head ``W``, the ``screen``, the speculative batch (``h``
``[N, d]``, request ``slots``, ``cu_num_logits``, ``input_ids``, ``positions``, ``local_pos``),
``num_spec``, the rows to defer (``rows``: whole sampled requests), ``draft_logits`` (optional,
``[SLOTS, num_spec, V]``: probabilistic drafts) and, per slot, what
``v2_interpreted._sampler`` reads (temperatures, seeds, min-p, biases, allowed ids, stop tokens,
bad words, penalties, prompts and outputs). OUT gets the tokens and accepted counts vLLM's
``RejectionSampler`` returns on the dense head's logits (``dense``) and on the hook's
(``hooked``), the hook's stats (``certified``, ``fallbacks``), and with ``no_process`` also on
the hook told no processors (``no_process``); with ``fused``, the head's backend is CUDA's (the
hook's device path, :mod:`vllm_csv.sampling.verify_v2_fused`), and ``device_path`` says it ran.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"


def run(c: dict) -> dict:
    import torch
    import triton
    import triton.language as tl
    import vllm.triton_utils as tu

    tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True  # before vLLM's V2 modules are imported
    from v2_interpreted import _sampler
    from v2_rejection_interpreted import _log1p, standard

    tu.tldevice = SimpleNamespace(log1p=_log1p)  # (the interpreter has no libdevice: the residual's log1p)

    from vllm_csv import CertifiedHead, HeadConfig
    from vllm_csv.sampling.head_adapter import HeadAdapter
    from vllm_csv.testing.fakes import Tally
    from vllm_csv.vllm_plugin import step as csv_step
    from vllm_csv.vllm_plugin.v2 import verify

    S, W, h = c["SLOTS"], c["W"], c["h"]
    head = CertifiedHead(W, config=HeadConfig(screen=c["screen"], off_switch=False, budget=c.get("budget", 0.5)))
    if c.get("fused"):  # CUDA's backend and the fused step it builds: the hook's device path
        from vllm_csv.gpu.step import FusedStep
        from vllm_csv.head.backend import Cuda

        head.backend, head._fused = Cuda(), FusedStep(head)
    taken = []
    real_fused = verify.verify_fused
    verify.verify_fused = lambda *a: taken.append(1) or real_fused(*a)
    rs = standard(_sampler(c), S, c["num_spec"])  # (vLLM's processors act: c's biases, penalties, ...)

    slots = c["slots"].to(torch.int32)
    cu = c["cu_num_logits"].to(torch.int32)
    R, N = slots.numel(), int(cu[-1])
    seq_lens = (c["positions"][cu[1:].long() - 1] + 1).to(torch.int32)
    batch = SimpleNamespace(
        num_reqs=R, req_ids=[str(i) for i in range(R)], idx_mapping=slots, idx_mapping_np=slots.numpy(),
        expanded_idx_mapping=torch.repeat_interleave(slots, torch.diff(cu)),
        expanded_local_pos=c["local_pos"].to(torch.int32), input_ids=c["input_ids"].to(torch.int32),
        positions=c["positions"].to(torch.int64), logits_indices=torch.arange(N, dtype=torch.int32),
        cu_num_logits=cu, cu_num_logits_np=cu.numpy(), seq_lens=seq_lens, seq_lens_cpu_upper_bound=seq_lens.clone(),
        num_draft_tokens=N - R)

    def verified(logits):
        o = rs(logits.clone(), batch, c.get("draft_logits"))
        return o.sampled_token_ids.clone(), o.num_sampled.clone()

    dense = head.dense_logits(h)
    out = {"dense": verified(dense)}
    rows = c["rows"]
    for name in ["hooked"] + (["no_process"] if c.get("no_process") else []):
        logits = dense.clone()
        logits[rows] = csv_step.PLACEHOLDER
        d = csv_step.Deferred(logits, h[rows].clone(), rows, ["spec_sampling"] * rows.numel(), HeadAdapter(head),
                              lambda: head.dense_logits(h), Tally().account())
        real = verify._processors
        if name == "no_process":
            verify._processors = lambda *a, **k: None
        try:
            st = verify.resolve(rs, d, logits, batch, c.get("draft_logits"))
        finally:
            verify._processors = real
        out[name] = verified(logits)
        out[name + "_stats"] = (dict(st.certified), dict(st.fallbacks))
    out["device_path"] = bool(taken)
    return out


if __name__ == "__main__":
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    torch.save(run(torch.load(sys.argv[1], weights_only=False)), sys.argv[2])
