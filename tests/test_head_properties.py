"""Property-based: for any head, bias, soft-cap and hidden state, certified top-k == dense top-k."""

import torch
from hypothesis import given, settings, strategies as st

from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.fp import gamma
from vllm_csv.testing.exact import dense_topk


@settings(max_examples=60, deadline=None)
@given(V=st.integers(2, 700), d=st.integers(1, 40), B=st.integers(1, 6), k=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1), screen=st.sampled_from(["int8", "int4", "fp16"]),
       bias=st.booleans(), softcap=st.sampled_from([None, 0.5, 30.0]), scale=st.sampled_from([1.0, 0.3]),
       hscale=st.sampled_from([1e-6, 1.0, 50.0, 1e12]), dup=st.booleans())
def test_certified_topk_equals_dense(V, d, B, k, seed, screen, bias, softcap, scale, hscale, dup):
    k = min(k, V)
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, d, generator=g) * torch.rand(V, 1, generator=g) * 3
    if dup and V > 2:
        W[V // 2 :] = W[: V - V // 2].clone()
    b = torch.randn(V, generator=g) if bias else None
    h = torch.randn(B, d, generator=g) * hscale
    head = CertifiedHead(W, b, config=HeadConfig(screen=screen, budget=0.5), softcap=softcap, scale=scale)
    res = head.topk(h, k, values=False)  # fp32 head: ids certified, values to rounding
    ids, vals, z = dense_topk(W, b, h, k, softcap, scale)
    # Sub-vocabulary logits come from another GEMM call (another accumulation order on
    # some shapes): equal up to the fp32 accumulation bound, and each returned token is
    # the dense one or a floating-point near-tie of it.
    tol = 2 * gamma(d + 2) * W.norm(dim=1).max() * h.norm(dim=1, keepdim=True) * abs(scale) + 1e-6 * vals.abs()
    assert ((res.values - vals).abs() <= tol).all()
    ours = z.gather(1, res.ids)
    assert (ours >= vals - tol).all()
