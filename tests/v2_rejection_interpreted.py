"""vLLM's V2 rejection sampler (``vllm.v1.worker.gpu.spec_decode.rejection_sampler.RejectionSampler``:
``apply_sampling_params`` then ``rejection_sample``, its Triton kernels run by Triton's interpreter
on the CPU) on given logits: a helper of test_spec_decode_v2.py, run in a subprocess
(``python v2_rejection_interpreted.py CASE OUT``), set up as ``v2_interpreted.py`` sets up the V2
sampler (whose ``_sampler`` builds the sampler and states here, with no processor acting).

CASE (a ``torch.save``'d dict): ``SLOTS``, per slot ``temp`` and ``seeds``, the number of
speculative steps ``num_spec``, and ``batches``: a list of dicts, each with its vocabulary ``V``, the requests' ``slots``
(batch order), ``cu_num_logits`` (``[R + 1]``: request ``i``'s rows, its target rows then its bonus
row), ``input_ids`` (each row's input token: the row after a target row holds that row's draft
token), ``positions``, ``local_pos`` (a row's index within its request) and ``logits`` (``{name:
[N, V]}``). OUT gets, per batch and name, ``(sampled [R, num_spec + 1], num_sampled [R])``, and
V2's ``gather_draft_sampled`` of the batch (``"gather_draft_sampled"``: each row's input token,
``-1`` on a draft slot within the prefill).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def _rejection_sampler(c, V: int):
    """vLLM's V2 ``RejectionSampler`` around its ``Sampler`` with the slots' temperatures and
    seeds and no processor acting (:func:`standard`)."""
    import numpy as np
    import torch
    from v2_interpreted import _sampler

    S = c["SLOTS"]
    empty = [[] for _ in range(S)]
    return standard(_sampler({"SLOTS": S, "W": torch.empty(V, 1), "temp": c["temp"], "min_p": np.zeros(S),
                              "seeds": c["seeds"], "rep": np.ones(S), "freq": np.zeros(S), "pres": np.zeros(S),
                              "min_tokens": np.zeros(S, np.int32), "bias": [{} for _ in range(S)], "allowed": empty,
                              "stop": empty, "bad": empty, "prompt": [[1] for _ in range(S)], "output": empty}),
                    S, c["num_spec"])


def standard(sampler, S: int, num_spec: int):
    """vLLM's V2 ``RejectionSampler`` (made without ``__init__``: no CUDA) around ``sampler`` (of
    ``S`` slots, every prefill one token), verifying as ``standard`` does (no synthetic rates,
    no block verification, no FLy window, no adaptive verification, no watermark)."""
    import numpy as np
    from v2_interpreted import _uva
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

    sampler.compute_nans, sampler.logprobs_mode = False, "raw_logprobs"
    sampler.req_states = SimpleNamespace(prefill_len=_uva(np.ones(S, np.int32)))
    rs = RejectionSampler.__new__(RejectionSampler)
    rs.sampler, rs.watermark_key, rs.num_speculative_steps = sampler, None, num_spec
    rs.enable_adaptive_verification = rs.use_block_verification = False
    rs.synthetic_conditional_rates = None
    rs.fly_window_size, rs.fly_entropy_threshold, rs.fly_entropy_top_k = 0, 0.0, 0  # (0.33's FLy: off)
    return rs


@triton.jit
def _log1p(x):
    """libdevice's ``log1p`` for the interpreter, which has no libdevice (the resampling of
    probabilistic drafts calls it): ``log(u) x / (u - 1)`` with ``u = fl(1 + x)``, a few ulps from
    the real one with numpy's ``log`` (``x`` itself where ``u`` rounds to 1)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


def run(c: dict) -> list:
    import torch
    import triton
    import triton.language as tl
    import vllm.triton_utils as tu

    tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True  # before vLLM's V2 modules are imported
    tu.tldevice = SimpleNamespace(log1p=_log1p)  # (the interpreter has no libdevice)
    samplers, out = {}, []
    for b in c["batches"]:
        rs = samplers.get(b["V"]) or samplers.setdefault(b["V"], _rejection_sampler(c, b["V"]))
        slots = b["slots"].to(torch.int32)
        cu = b["cu_num_logits"].to(torch.int32)
        R, N = slots.numel(), int(cu[-1])
        expanded = torch.repeat_interleave(slots, torch.diff(cu))
        seq_lens = (b["positions"][cu[1:].long() - 1] + 1).to(torch.int32)
        batch = SimpleNamespace(
            num_reqs=R, req_ids=[str(i) for i in range(R)], idx_mapping=slots, idx_mapping_np=slots.numpy(),
            expanded_idx_mapping=expanded, expanded_local_pos=b["local_pos"].to(torch.int32),
            input_ids=b["input_ids"].to(torch.int32), positions=b["positions"].to(torch.int64),
            logits_indices=torch.arange(N, dtype=torch.int32), cu_num_logits=cu, cu_num_logits_np=cu.numpy(),
            seq_lens=seq_lens, seq_lens_cpu_upper_bound=seq_lens.clone(), num_draft_tokens=N - R)
        from vllm.v1.worker.gpu.spec_decode.rejection_sampler import gather_draft_sampled

        res = {"gather_draft_sampled": gather_draft_sampled(
            batch.input_ids, batch.positions, batch.logits_indices, batch.expanded_idx_mapping,
            batch.expanded_local_pos, rs.sampler.req_states.prefill_len.gpu)[0].long()}
        for name, logits in b["logits"].items():
            o = rs(logits.clone(), batch, b.get("draft_logits"))
            res[name] = (o.sampled_token_ids.clone(), o.num_sampled.clone())
        out.append(res)
    return out


if __name__ == "__main__":
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    torch.save(run(torch.load(sys.argv[1], weights_only=False)), sys.argv[2])
