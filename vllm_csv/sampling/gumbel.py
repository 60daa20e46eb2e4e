"""vLLM's CPU Gumbel noise, recomputable for any token of a row.

vLLM 0.32's CPU sampler (``TopKTopPSampler.forward_cpu``) draws one seed per row and
calls ``torch.ops._C.fused_gumbel_argmax(logits_f32, seeds)``, which returns

    argmax_i  double(x_i) + g_i         (strict ">" in index order: ties keep the lowest index,
                                          -inf tokens never win, an all -inf row gives 0)

with ``g_i = -log(-log u_i)``, ``u_i = (bits_i + 0.5) 2^-53``,
``bits_i = sm(key + (i + 1) * 0x9E3779B97F4A7C15) >> 11``, ``key = sm(seed)`` and ``sm``
SplitMix64's finaliser (all in uint64 arithmetic). Token ``i``'s noise depends only on
``(seed, i)``, so the noise of any sub-vocabulary is computable without the rest.
``tests/test_sampling_gumbel.py`` checks this replica against vLLM's own kernel.

Range: ``u`` lies in ``[2^-54, 1 - 2^-54]``, so ``-log u`` lies in ``[~2^-54, 37.43]`` and
``g`` in ``[-log(37.43), 37.43] = [-3.623, 37.43]``: :data:`GUMBEL_MIN`, :data:`GUMBEL_MAX`
(rounded outwards).
"""

from __future__ import annotations

import math

import torch

from ..ops.noise import noise_bits_ref as noise_bits, noise_of_bits  # the noise's hash

GUMBEL_MIN = -3.63  # below -log(-log(2^-54)) = -3.6226
GUMBEL_MAX = 37.5  # above -log(-log(1 - 2^-54)) = 37.429


def gumbel_noise(seeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The noise ``g`` that ``fused_gumbel_argmax`` adds to tokens ``ids`` of rows seeded ``seeds``.

    Parameters
    ----------
    seeds : torch.Tensor
        ``[B]`` int64, the per-row seeds vLLM passes to the kernel.
    ids : torch.Tensor
        ``[B, n]`` or ``[n]`` (same columns for every row) int64 token ids.

    Returns
    -------
    torch.Tensor
        ``[B, n]`` float64. ``torch.log`` may differ from the kernel's ``std::log`` by an
        ulp or two; :func:`noise_margin` covers that.
    """
    return noise_of_bits(noise_bits(seeds, ids))


def gumbel_argmax(x: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Torch reference of ``fused_gumbel_argmax`` (``x [B, V]`` fp32, ``seeds [B]`` int64) ->
    ``[B]`` int64. Like the kernel it compares ``(x - c) + g`` with ``c`` a logit of the row
    (the kernel's running best; here the row's largest finite logit), so ties made by huge
    logits are broken by the noise, ``+inf`` tokens win in index order and ``-inf`` never
    (an all ``-inf`` row gives 0). Exact except where two noisy scores lie within
    :func:`noise_margin` of each other."""
    xd = x.double()
    fin = torch.isfinite(xd)
    c = xd.masked_fill(~fin, -math.inf).amax(1, keepdim=True)
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    return ((xd - c) + gumbel_noise(seeds, torch.arange(x.shape[1], device=x.device))).argmax(1)


def noise_margin(x_abs_max: torch.Tensor) -> torch.Tensor:
    """An upper bound on how far the kernel's comparison of two noisy scores can stray from
    the exact real comparison of ``x_i + g_i`` with ``x_j + g_j``, for ``|x| <= x_abs_max``.

    The kernel compares ``(double(x_i) - double(x_b)) + g_i > g_b`` (or ``x + g`` directly):
    at most two double roundings of values below ``2 (|x|max + 38)``, each within
    ``2^-53`` of it, and ``g`` from ``log`` within 4 ulps of the exact value (glibc's and
    Sleef's ``log`` are within 1 ulp, composed twice and scaled by ``1/|log u|``); so the
    computed difference is within ``2^-48 (|x|max + 38)`` of the real one. We use
    ``2^-44 (|x|max + 64)``: 16x that. Returns float64 of the shape of ``x_abs_max``."""
    return (x_abs_max.double() + 64.0) * 2.0**-44
