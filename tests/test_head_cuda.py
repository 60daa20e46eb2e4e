"""The certified head on a GPU: same tokens as the dense cuBLAS head, in fp32, bf16 and fp16.

On CUDA the screen runs the csrc kernel (when built) and the dense head is cuBLAS, whose
accumulation order differs between the full GEMM and the sub-vocabulary GEMM: the
comparison is on the *dense* values of the returned tokens, so a returned token must be a
dense top-k token or an exact dense tie with one. Skipped without a CUDA device.
"""

import math

import pytest
import torch

from vllm_csv import CertifiedHead, HeadConfig, build_index
from vllm_csv.fp import gamma
from vllm_csv.testing.heads import hidden_near_rows, peaked_head

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make(W, b, screen, **kw):
    V = kw.get("vocab_size") or W.shape[0]
    idx = build_index(W[:V].float().cpu(), None if b is None else b[:V].float().cpu(), progress=False) \
        if screen == "ball" else None
    return CertifiedHead(W, b, config=HeadConfig(screen=screen, budget=1.0, off_switch=False), index=idx, **kw)


def assert_dense_topk(head, W, b, h, k, softcap=None, scale=1.0):
    res = head.topk(h, k)
    z = torch.nn.functional.linear(h, W, b)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    if scale != 1.0:
        z = z * scale
    want = torch.sort(z.float(), dim=1, descending=True, stable=True).values[:, :k]
    got = z.float().gather(1, res.ids)
    assert torch.equal(got, want), (got - want).abs().max()
    return res


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("screen", ["int8", "int4", "fp16", "ball"])
@pytest.mark.parametrize("V,d", [(32000, 256), (5003, 1024), (4099, 129)])
def test_cuda_matches_dense(dtype, screen, V, d):
    W, g = peaked_head(V, d, seed=V + d)
    h = torch.cat([hidden_near_rows(W, 48, g), torch.randn(16, d, generator=g)])  # peaked + near-ties
    W, h = W.to("cuda", dtype), h.to("cuda", dtype)
    head = make(W, None, screen)
    for k in (1, 4):
        res = assert_dense_topk(head, W, None, h, k)
    if screen == "int8":
        # the set (greedy's argmax, what vLLM's sampler reads): an fp32 row's values are never the
        # dense bits for sure (cuBLAS sums a sub-vocabulary in another order), so values=True
        # certifies few fp32 rows by design
        ids = head.topk(h, 1, values=False)
        assert ids.certified[:48].float().mean() > 0.9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_bias_softcap_padding_nonfinite(dtype):
    V, pad, d = 7001, 63, 512
    W, g = peaked_head(V + pad, d, seed=1)
    W[V:] = 100.0
    b = torch.randn(V + pad, generator=g)
    b[V:] = 1e4
    h = hidden_near_rows(W[:V], 40, g)
    h[0, 1] = math.nan
    h[1, 2] = math.inf
    h[2] *= 1e30
    W, b, h = W.to("cuda", dtype), b.to("cuda", dtype), h.to("cuda", dtype)
    for screen in ("int8", "int4", "fp16", "ball"):
        head = make(W, b, screen, vocab_size=V, softcap=5.0, scale=0.5)
        res = head.topk(h, 2)
        assert not res.certified[:2].any()
        assert_dense_topk(head, W[:V], b[:V], h[2:], 2, softcap=5.0, scale=0.5)
        assert int(res.ids.max()) < V


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cublas_head_error_within_fp32_accumulation_bound(dtype):
    """The assumption every bound rests on: cuBLAS's LM-head GEMM (all the batch shapes the
    runtime uses, incl. ones that favour split-K) errs by at most ``gamma_{d+2} ||w|| ||h||``
    plus two output roundings from the exact product."""
    g = torch.Generator().manual_seed(0)
    for B, V, d in [(1, 32000, 4096), (8, 128, 8192), (64, 1024, 16384), (7, 50257, 2048), (256, 4096, 4096)]:
        W = torch.randn(V, d, generator=g).to(dtype)
        h = torch.randn(B, d, generator=g).to(dtype)
        y = torch.nn.functional.linear(h.cuda(), W.cuda()).double().cpu()
        exact = h.double() @ W.double().T
        bound = gamma(d + 2) * W.double().norm(dim=1)[None] * h.double().norm(dim=1)[:, None]
        ulp = exact.abs() * torch.finfo(dtype).eps + 1e-30  # two roundings to the output dtype
        assert ((y - exact).abs() <= bound + ulp).all(), (B, V, d, float(((y - exact).abs() - bound).max()))
