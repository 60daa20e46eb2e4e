"""vLLM's V2 verification arithmetic with its Triton code run by Triton's interpreter on the CPU: a
helper of test_verify_v2.py, run in a subprocess (``python v2_verify_interpreted.py CASE OUT``).

CASE (a ``torch.save``'d dict): ``seeds`` and ``pos`` (``[N]`` int64) and ``x`` (``[M, V]`` float32
processed rows) with ``drafts`` (``[M]`` int64). OUT gets ``rand``: ``tl.rand(seed, pos)`` and
vLLM's ``tl_rand32(seed, pos, includes_zero=False)`` (``[N]`` float32 each); ``logprob``: V2's
``x_d - lse`` of each row (``_compute_local_logits_stats_kernel``, then
``_compute_global_logprobs_and_logsumexp`` as ``_rejection_kernel`` calls it, one-hot drafts)."""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

tl_rand32 = rsu = None  # vLLM's, bound by run() (vllm.triton_utils must point at Triton first)


@triton.jit
def rand_kernel(out_raw, out_v2, seeds, pos):
    i = tl.program_id(0)
    s, p = tl.load(seeds + i), tl.load(pos + i)
    tl.store(out_raw + i, tl.rand(s, p))
    tl.store(out_v2 + i, tl_rand32(s, p, includes_zero=False))


@triton.jit
def logprob_kernel(out, x_ptr, stride, drafts, lmax, lmax_stride, lsum, lsum_stride, nblocks, PADDED: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    d = tl.load(drafts + i).to(tl.int64)
    lp, _, _, _ = rsu._compute_global_logprobs_and_logsumexp(
        d, True, i, 0, 0, 1.0, x_ptr, stride, lmax, lmax_stride, lsum, lsum_stride,
        None, 0, 0, None, 0, None, 0, nblocks, PADDED, False)
    tl.store(out + i, lp)


def run(c: dict) -> dict:
    global tl_rand32, rsu
    import torch
    import vllm.triton_utils as tu

    tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True  # before vLLM's V2 modules are imported
    from vllm.v1.worker.gpu.sample.gumbel import tl_rand32
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as rsu

    seeds, pos = c["seeds"], c["pos"]
    raw, v2 = torch.empty(seeds.numel()), torch.empty(seeds.numel())
    rand_kernel[(seeds.numel(),)](raw, v2, seeds, pos)
    x, drafts = c["x"].contiguous(), c["drafts"]
    M, V = x.shape
    nb = triton.cdiv(V, 8192)  # (rejection_sample's VOCAB_BLOCK_SIZE)
    lmax, lsum = torch.empty(M, nb), torch.empty(M, nb)
    arg = torch.empty(M, nb, dtype=torch.int64)
    temp = torch.ones(1)
    mapping = torch.zeros(M, dtype=torch.int32)
    # every row a target row: local position 1 (0.32 reads it against num_speculative_steps,
    # 0.33 reads the next row's against 0, up to num_logits): both given M + 1
    local = torch.ones(M + 1, dtype=torch.int32)
    rsu._compute_local_logits_stats_kernel[(M, nb)](
        arg, nb, lmax, nb, lsum, nb, lmax, nb, lsum, nb, x, V, None, 0, 0, mapping, local, temp, V,
        M + 1, BLOCK_SIZE=8192, HAS_DRAFT_LOGITS=False)
    lp = torch.empty(M)
    logprob_kernel[(M,)](lp, x, V, drafts, lmax, nb, lsum, nb, nb, PADDED=triton.next_power_of_2(nb))
    return {"rand": (raw, v2), "logprob": lp}


if __name__ == "__main__":
    import torch

    torch.save(run(torch.load(sys.argv[1], weights_only=False)), sys.argv[2])
