"""min-p / top-p keep-drop decisions from bounds never contradict vLLM's own masks."""

import math

import pytest
import torch

from vllm_csv.sampling import nucleus
from vllm_csv.sampling.nucleus import min_p_bounds, top_p_bounds

pytest.importorskip("vllm")
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch  # noqa: E402


def vllm_min_p(y, min_p):
    probs = torch.softmax(y, dim=-1)
    return ~(probs < probs.amax(-1, keepdim=True) * min_p[:, None])


def rows(seed, R=64, V=2048):
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1e-3, 0.3, 1.0, 3.0, 30.0])[torch.arange(R) % 5][:, None]
    y = torch.randn(R, V, generator=g) * scale
    y[:, :7] = y[:, 7:14]  # exact ties
    y[::4, 100:400] = -math.inf  # masked tokens
    return y, g


def decisions(lo, hi, y):
    """(certainly kept, certainly dropped); masked tokens (-inf in y) are left out."""
    return torch.isfinite(lo), ~torch.isfinite(hi) & torch.isfinite(y)


@pytest.mark.parametrize("width", [0.0, 1e-4, 0.05])
def test_top_p_decisions_are_sound(width):
    y, g = rows(0)
    p = torch.rand(y.shape[0], generator=g) * 0.98 + 0.01
    kept = torch.isfinite(apply_top_k_top_p_pytorch(y.clone(), None, p))
    lo, hi = top_p_bounds(y - width, y + width, p)
    k, d = decisions(lo, hi, y)
    assert not (k & ~kept).any() and not (d & kept).any()
    if width == 0.0:
        assert (k | d | ~torch.isfinite(y)).float().mean() > 0.99  # nearly everything decided


@pytest.mark.parametrize("width", [0.0, 1e-4, 0.05])
def test_min_p_decisions_are_sound(width):
    y, g = rows(1)
    mp = torch.rand(y.shape[0], generator=g) * 0.5
    mp[::7] = 0.0
    kept = vllm_min_p(y, mp)
    lo, hi = min_p_bounds(y - width, y + width, mp)
    k, d = decisions(lo, hi, y)
    assert not (k & ~kept).any() and not (d & kept).any()
    if width == 0.0:
        assert (k | d | ~torch.isfinite(y)).float().mean() > 0.99


def test_a_negative_margin_is_caught(monkeypatch):
    """Broken bound: the top-p margin made negative (-0.02): wrong decisions appear."""
    monkeypatch.setattr(nucleus, "gamma", lambda n: -0.01)
    y, g = rows(2, R=256)
    p = torch.rand(y.shape[0], generator=g) * 0.98 + 0.01
    kept = torch.isfinite(apply_top_k_top_p_pytorch(y.clone(), None, p))
    k, d = decisions(*top_p_bounds(y, y, p), y)
    assert (k & ~kept).any() or (d & kept).any()
