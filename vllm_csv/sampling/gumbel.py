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

GOLDEN = 0x9E3779B97F4A7C15
GUMBEL_MIN = -3.63  # below -log(-log(2^-54)) = -3.6226
GUMBEL_MAX = 37.5  # above -log(-log(1 - 2^-54)) = 37.429


def _i64(x: int) -> int:
    """A uint64 constant as the int64 bit pattern torch stores (int64 arithmetic wraps
    like uint64 for +, *, ^)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 tensors holding uint64 bits."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors holding uint64 bits."""
    z = (z ^ _shr(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _i64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def noise_bits(seeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The 53 random bits behind token ``ids``' noise in rows seeded ``seeds``: ``[B, n]`` int64
    (``ids`` ``[B, n]`` or ``[n]``). The hash of :func:`splitmix64` in place on one buffer
    (each out-of-place op of a ``[B, V]`` int64 tensor costs an allocation as long as the op)."""
    key = splitmix64(seeds.long())[:, None]
    ids = ids.long()
    if ids.dim() == 1:
        ids = ids[None]
    z = torch.add(key, (ids + 1).mul_(_i64(GOLDEN)))  # [B, n]
    tmp = torch.empty_like(z)
    for shift, mult in ((30, _i64(0xBF58476D1CE4E5B9)), (27, _i64(0x94D049BB133111EB)), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp).bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(tmp)
        if mult is not None:
            z.mul_(mult)
    return z.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)


def noise_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """``g = -log(-log u)``, ``u = (bits + 0.5) 2^-53``, in float64 (same shape)."""
    u = (bits.double() + 0.5).mul_(2.0**-53)
    return u.log_().neg_().log_().neg_()


def bits_below(t: torch.Tensor) -> torch.Tensor:
    """Per row, an int64 ``b`` such that every token whose bits are ``< b`` has noise ``< t``
    (``t`` ``[B]`` float64), exactly and as :func:`noise_of_bits` computes it.

    ``g`` increases with ``u``: ``g < t`` iff ``u < exp(-exp(-t))``. We take
    ``t' = t - 1e-6`` and ``b = floor(exp(-exp(-t')) 2^53 - 0.5) - 2``: ``bits < b`` gives
    ``u < exp(-exp(-t'))`` with room for the double roundings of this threshold, so the real
    ``g < t - 1e-6``, and the computed ``g`` (within a few ulps, ``<= 1e-13`` for
    ``|g| <= 38``) is below ``t``. ``b <= 0`` (no token skipped) when ``t`` is below the
    noise's range (or NaN)."""
    t = torch.nan_to_num(t.double(), nan=-math.inf, posinf=math.inf)  # NaN: skip nothing
    u = torch.exp(-torch.exp(-(t - 1e-6)))
    return (torch.floor(u * 2.0**53 - 0.5) - 2).clamp(-1, 2.0**53).long()


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
