"""vLLM's V2 logits processors (logit bias, allowed ids, min_tokens' stop tokens, penalties, bad
words) on the device draw's bounds (:meth:`vllm_csv.gpu.step.FusedStep.draw_v2`).

V2's sampler runs its processors on the fp32 logits before the temperature, min-p and the draw.
Each is monotone non-decreasing per token (a mask to ``-inf``, an fp32 addition, the repetition
penalty's ``x / r`` or ``x r`` by sign, subtractions of fixed amounts: the argument of
:func:`vllm_csv.vllm_plugin.v2.sampler._processors`, whose ``process(lo, hi)`` runs vLLM's own
processors on ``[R, V]`` bounds), so vLLM's processors run on a lower and an upper bound of every
token give bounds of what they make of the dense row. Here that is done twice, in torch on the
device (no host sync; ``[B, V]`` fp32 passes, a few tens of microseconds at ``V`` 152k and
``B`` 8 on an H100-class card, not measured yet):

1. :func:`processed_block_hi`: each block's screen bound (``block_upper``) spread over its tokens,
   processed, and the block's largest taken again: the bound :func:`~.draw_bounds.block_bounds`
   turns into a noisy bound (a token a bias raises raises its block, which then tends to be a
   candidate; one a penalty lowers lowers it);
2. :func:`processed_candidates`: the candidates' exact intervals (``score_blocks``) written into
   rows of ``-inf``, processed, and read back: what :func:`~.gumbel_draw.gumbel_draw` certifies on.

The tokens outside the candidates enter the certificate only through step 1's block bounds, which
hold every processed value of their block.
"""

from __future__ import annotations

import math

import torch

from .common import SUB, slot_ids


def processed_block_hi(process, block_hi: torch.Tensor, V: int) -> torch.Tensor:
    """``[B, nb]`` fp32: an upper bound of every processed value of each block's tokens.

    Parameters
    ----------
    process : callable
        ``process(lo, hi) -> (lo', hi')`` on ``[B, V]`` fp32 bounds (vLLM's processors on them).
    block_hi : torch.Tensor
        ``[B, nb]`` fp32, an upper bound of each block's dense logits (NaN: none, kept NaN).
    V : int
    """
    B, nb = block_hi.shape
    hi = block_hi.repeat_interleave(SUB, 1)[:, :V].contiguous()
    _, phi = process(torch.full_like(hi, -math.inf), hi)
    pad = torch.full((B, nb * SUB), -math.inf, dtype=torch.float32, device=hi.device)
    pad[:, :V] = phi
    out = pad.view(B, nb, SUB).amax(2)
    return torch.where(torch.isnan(block_hi), block_hi, out)


def processed_candidates(process, cand: torch.Tensor, count: torch.Tensor, lower: torch.Tensor,
                         upper: torch.Tensor, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lower', upper')`` ``[B, CAP * SUB]`` fp32: the candidates' exact intervals processed.

    Parameters
    ----------
    process : callable
        As :func:`processed_block_hi`.
    cand, count : torch.Tensor
        The candidate blocks (:func:`~.draw_bounds.draw_select`).
    lower, upper : torch.Tensor
        ``[B, CAP * SUB]`` fp32, their tokens' bounds (:func:`~.score.score_blocks`; slots past the
        count unread).
    V : int
    """
    B = lower.shape[0]
    ids = slot_ids(cand, count, V)
    valid = ids >= 0
    idx = ids.clamp_min(0)

    def row(x):  # (empty slots carry -inf to token 0: its maximum with token 0's own value leaves it)
        full = torch.full((B, V), -math.inf, dtype=torch.float32, device=x.device)
        return full.scatter_reduce_(1, idx, torch.where(valid, x.float(), -math.inf), "amax")

    plo, phi = process(row(lower), row(upper))
    lo = torch.where(valid, plo.gather(1, idx), -math.inf)
    hi = torch.where(valid, phi.gather(1, idx), -math.inf)
    return lo, hi
