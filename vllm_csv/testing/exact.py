"""What a certified row is checked against: the dense head's top-k, as vLLM computes the logits,
bit-for-bit equality of tensors, and the distance in fp32 ulps where a kernel's float64 sums may
differ from torch's in the last bit."""

from __future__ import annotations

import torch

from ..fp import same_bits  # noqa: F401  (re-exported: the tests read it here)


def dense_topk(W, b, h, k, softcap=None, scale=1.0):
    """The dense head's top-``k``: ``(ids [B, k], values [B, k], logits [B, V])``; the logits
    ``F.linear(h, W, b)``, soft-capped and scaled as vLLM does, sorted descending with ties to the
    lowest id."""
    z = torch.nn.functional.linear(h, W, b)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z = z * scale if scale != 1.0 else z
    vals, ids = torch.sort(z, dim=1, descending=True, stable=True)
    return ids[:, :k], vals[:, :k], z


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in fp32 ulps (0 where equal, NaN == NaN)."""
    both_nan = a.isnan() & b.isnan()
    ai, bi = a.float().view(torch.int32).long(), b.float().view(torch.int32).long()
    d = (ai - bi).abs().masked_fill(both_nan | (a == b), 0)
    return int(d.max()) if d.numel() else 0
