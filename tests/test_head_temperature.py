"""Sampled top-k rows: what vLLM's sampler keeps after dividing by the temperature.

vLLM divides a sampled row's fp32 logits by its temperature, then keeps every token whose
value is *at least* the k-th largest (``apply_top_k_only``: ties at the k-th value are kept,
and the Gumbel draw picks among them). So for a sampled row the certified output must give
exactly the kept set and values that the dense logits give, including

* exact ties at the k-th value (a greedy row replays them: the argmax takes the lowest id;
  a sampled ``top_k = 1`` row must not);
* ties the division makes: ``fl(x / t)`` overflows to ``inf`` for huge logits and tiny
  temperatures, and loses precision in the subnormal range for tiny logits and huge ones.
"""

import pytest
import torch

from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.testing.audit import v2_divide
from vllm_csv.testing.heads import hidden_near_rows, peaked_head

apply_top_k_only = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler").apply_top_k_only


def kept(logits: torch.Tensor, k: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU sampler up to the draw: fp32, divide by the temperature, top-k mask."""
    x = logits.float().div_(temp[:, None])
    return apply_top_k_only(x, k.clone())


def kept_v2(logits: torch.Tensor, k: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """The same with a division as V2's Triton ``/`` may do it (:func:`~vllm_csv.testing.audit.v2_divide`)."""
    return apply_top_k_only(v2_divide(logits, temp[:, None]), k.clone())


def check(head, W, h, k, temp):
    """The head's row and the dense row keep the same set with the same values under V1's
    division and under a V2-like one."""
    B = h.shape[0]
    ks = torch.full((B,), k, dtype=torch.long)
    t = torch.full((B,), temp, dtype=torch.float32)
    out, stats = head.sampler_logits(h, ks, temperature=t)
    dense = torch.nn.functional.linear(h, W)
    for keep in (kept, kept_v2):
        a, b = keep(out, ks, t), keep(dense, ks, t)
        assert torch.equal(torch.isfinite(a), torch.isfinite(b)) and torch.equal(a, b), keep.__name__
    return stats


def tie_head(dtype=torch.bfloat16):
    """Rows 3 and 7 equal: an exact tie at the top for ``h = e_0``; row 5 third."""
    W = torch.zeros(512, 8)
    W[:, 1:] = torch.randn(512, 7, generator=torch.Generator().manual_seed(0)) * 0.01
    W[3, 0] = W[7, 0] = 4.0
    W[7, 1:] = W[3, 1:]
    W[5, 0] = 3.0
    return W.to(dtype)


def test_exact_tie_is_replayed_for_greedy_rows_only():
    W = tie_head()
    h = torch.zeros(2, 8, dtype=W.dtype)
    h[:, 0] = 1
    head = CertifiedHead(W, config=HeadConfig(screen="int8", off_switch=False))
    out, stats = head.sampler_logits(h, torch.ones(2, dtype=torch.long), temperature=torch.zeros(2))
    assert stats.certified == 2 and torch.isfinite(out).sum(1).tolist() == [1, 1] and out.argmax(1).tolist() == [3, 3]
    out, stats = head.sampler_logits(h, torch.ones(2, dtype=torch.long), temperature=torch.full((2,), 0.7))
    assert torch.isfinite(out).sum(1).tolist() == [2, 2]  # sampled top_k = 1: vLLM keeps both tied tokens
    stats = check(head, W, h, 1, 0.7)
    check(head, W, h, 2, 0.7)  # the tie is inside the top 2: certified or not, the same kept set


def test_tie_at_the_kth_value_is_kept_and_certified():
    """Token 9 first, tokens 3 and 7 tied second: for ``top_k = 2`` vLLM keeps all three. The
    kept-set certificate returns exactly those (the strict one could not separate 3 from 7)."""
    W = tie_head(torch.float32)
    W[9, 0] = 5.0
    W = W.to(torch.bfloat16)
    h = torch.zeros(2, 8, dtype=W.dtype)
    h[:, 0] = 1
    head = CertifiedHead(W, config=HeadConfig(screen="int8", budget=1.0, off_switch=False))
    stats = check(head, W, h, 2, 0.9)
    out, _ = head.sampler_logits(h, torch.full((2,), 2), temperature=torch.full((2,), 0.9))
    assert stats.certified == 2 and torch.isfinite(out[0]).nonzero().squeeze(1).tolist() == [3, 7, 9]


@pytest.mark.parametrize("k", [1, 2, 5])
def test_overflow_made_by_the_temperature(k):
    """Logits near 2e34 (far below the bf16 overflow guard) divided by 1e-5 overflow fp32: the
    top tokens all become ``inf`` and vLLM keeps them all."""
    W, g = peaked_head(1024, 16, seed=1, dtype=torch.float32)
    W[:8, 0] = torch.linspace(2.0e34, 1.5e34, 8)
    W = W.to(torch.bfloat16)
    h = torch.zeros(3, 16, dtype=W.dtype)
    h[:, 0] = 1
    head = CertifiedHead(W, config=HeadConfig(screen="int8", off_switch=False))
    stats = check(head, W, h, k, 1e-5)
    assert stats.certified == 0
    stats = check(head, W, h, k, 1.0)  # no overflow: the same rows certify
    assert stats.certified == 3 or k != 1


def test_underflow_made_by_the_temperature():
    """Logits near 1e-30 divided by 1e13 are fp32 subnormals: neighbouring bf16 values merge."""
    W = torch.zeros(256, 4)
    W[:6, 0] = torch.tensor([1.0, 0.99609375, 0.9921875, 0.98828125, 0.984375, 0.98046875]) * 1e-30
    W[6:, 0] = -1e-30
    W = W.to(torch.bfloat16)
    h = torch.zeros(2, 4, dtype=W.dtype)
    h[:, 0] = 1
    head = CertifiedHead(W, config=HeadConfig(screen="int8", off_switch=False))
    for k in (1, 2, 3):
        check(head, W, h, k, 1e13)


@pytest.mark.parametrize("temp", [0.3, 1.0, 1.7])
def test_ordinary_temperatures_still_certify(temp):
    W, g = peaked_head(4096, 64, seed=2, dtype=torch.bfloat16)
    h = hidden_near_rows(W, 16, g)
    head = CertifiedHead(W, config=HeadConfig(screen="int8", off_switch=False))
    stats = check(head, W, h, 1, temp)
    assert stats.certified >= 14


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [2, 5, 20])
def test_sampled_top_k_matches_vllms_mask(k, dtype):
    """Many rows, coarse weights (bf16/fp16 ties are frequent), several temperatures: the kept
    set and its values are vLLM's, certified or not."""
    W, g = peaked_head(2048, 32, seed=k, dtype=torch.float32)
    W = (W * 8).round() / 8  # few distinct values: ties at every rank
    W = W.to(dtype)
    h = torch.cat([hidden_near_rows(W, 48, g, noise=0.0), hidden_near_rows(W, 16, g)]).to(dtype)
    head = CertifiedHead(W, config=HeadConfig(screen="int8", budget=1.0, off_switch=False))
    certified = sum(check(head, W, h, k, t).certified for t in (0.25, 1.0, 3.0))
    assert certified > 0
