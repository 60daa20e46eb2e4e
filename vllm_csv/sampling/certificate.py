"""Which token vLLM's draw picks, certified from bounds on every token's input to the draw.

A row's draw sees fp32 values ``y_i`` (the dense head's logits after vLLM's logits
processors, and, for a sampled row, divided by the temperature). We know
``ylo_i <= y_i <= yhi_i`` for every token (``-inf`` on both for masked tokens).

Greedy rows (``torch.ops._C.greedy_argmax``: exact fp32 comparisons, ties to the lowest
index). With ``w = argmax ylo``: if ``ylo_w > yhi_j`` for every ``j != w``, then
``y_w >= ylo_w > yhi_j >= y_j``: ``w`` is the unique maximum and the draw returns it.

Sampled rows (``fused_gumbel_argmax``, :mod:`.gumbel`). The draw maximises
``s_i = y_i + g_i`` (``g_i`` known from the seed). With ``nlo_i = ylo_i + g_i``,
``nhi_i = yhi_i + g_i`` (computed in float64, each within ``delta / 16`` of the real sum,
``delta`` = :func:`~vllm_csv.sampling.gumbel.noise_margin` of the row's largest ``|y|``),
``w = argmax nlo`` and ``best = nlo_w``: if ``nhi_j < best - 2 delta`` for every
``j != w``, the real ``s_w - s_j > 2 delta - delta / 8``, more than the kernel's
comparison error (``<= delta / 16``, :func:`~vllm_csv.sampling.gumbel.noise_margin`),
so the kernel returns ``w`` whatever order it compares in. Noise is computed only where it
can matter: ``g >= GUMBEL_MIN`` gives ``best >= max ylo + GUMBEL_MIN =: L0``, and a token
with ``yhi_j + GUMBEL_MAX < L0 - 2 delta`` has ``nhi_j < best - 2 delta`` whatever its noise.

Rows with ``+inf`` or NaN bounds, or with no finite token, are never certified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .gumbel import GUMBEL_MAX, GUMBEL_MIN, gumbel_noise, noise_margin


@dataclass
class DrawCertificate:
    winner: torch.Tensor  # [R] int64: the token the draw returns where certified
    certified: torch.Tensor  # [R] bool
    contenders: torch.Tensor  # [R, V] bool: the winner and every token not yet ruled out
    finite: torch.Tensor  # [R] bool: bounds usable (no +inf / NaN, at least one finite token)


def certify_draw(ylo: torch.Tensor, yhi: torch.Tensor, seeds: torch.Tensor, greedy: torch.Tensor
                 ) -> DrawCertificate:
    """Certify the token of each row's draw from bounds on its inputs.

    Parameters
    ----------
    ylo, yhi : torch.Tensor
        ``[R, V]`` float32, ``ylo <= y <= yhi`` elementwise, ``-inf`` on both for masked tokens.
    seeds : torch.Tensor
        ``[R]`` int64, the seeds the sampler will pass to ``fused_gumbel_argmax`` (ignored
        for greedy rows).
    greedy : torch.Tensor
        ``[R]`` bool, rows drawn by ``greedy_argmax`` rather than the Gumbel kernel.

    Returns
    -------
    DrawCertificate
        ``certified[r]`` proves the draw returns ``winner[r]``; otherwise ``contenders[r]`` are
        the tokens whose bounds must be tightened (scored exactly) to decide.
    """
    R, V = ylo.shape
    dev = ylo.device
    neg = torch.tensor(-math.inf, device=dev)
    finite = (~torch.isnan(ylo).any(1) & ~torch.isnan(yhi).any(1) & ~torch.isposinf(yhi).any(1)
              & (ylo > -math.inf).any(1))
    ylo = torch.where(finite[:, None], ylo, neg)
    yhi = torch.where(finite[:, None], yhi, neg)
    lmax = ylo.amax(1)
    winner = ylo.argmax(1)  # first maximum: the greedy winner candidate
    contenders = yhi >= lmax[:, None]  # greedy rows: j with yhi_j >= ylo_w
    certified = finite & (contenders.sum(1) == 1)  # only w itself (yhi_w >= ylo_w always)
    samp = finite & ~greedy
    if bool(samp.any()):
        rows = samp.nonzero().squeeze(1)
        lo_r, hi_r = ylo[rows], yhi[rows]
        absmax = torch.maximum(lo_r.masked_fill(lo_r == -math.inf, 0).abs().amax(1),
                               hi_r.masked_fill(hi_r == -math.inf, 0).abs().amax(1))
        delta = noise_margin(absmax)  # [r] float64
        L0 = lmax[rows].double() + GUMBEL_MIN
        pre = (hi_r.double() + GUMBEL_MAX) >= (L0 - 2 * delta)[:, None]
        cols = pre.any(0).nonzero().squeeze(1)
        g = gumbel_noise(seeds[rows], cols)  # [r, n] float64
        nlo = lo_r[:, cols].double() + g
        nhi = (hi_r[:, cols].double() + g).masked_fill(~pre[:, cols], -math.inf)
        nlo = nlo.masked_fill(~pre[:, cols], -math.inf)
        best, w = nlo.max(1)
        cont = torch.zeros((rows.numel(), V), dtype=torch.bool, device=dev)
        cont[:, cols] = nhi >= (best - 2 * delta)[:, None]
        winner[rows] = cols[w]
        contenders[rows] = cont
        certified[rows] = (cont.sum(1) == 1) & (best > -math.inf)
    contenders &= finite[:, None]
    return DrawCertificate(winner, certified, contenders, finite)
