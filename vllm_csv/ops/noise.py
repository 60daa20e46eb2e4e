"""The draw certificate's pass over the whole vocabulary (``csrc/cpu/gumbel_cpu.cpp``), beside
its torch reference; the sampled rows' whole certificate pass (:func:`draw_contenders`, the
vocabulary pass and what the certificate reads of it) and the noise bits of a few tokens
(:func:`noise_bits`), from the same file. The row statistics the certificate reads first and
each row's live columns are :mod:`vllm_csv.ops.live`'s (``live_cpu.cpp``); :class:`DrawOps`
binds them with :func:`draw_contenders`.

Why fused: :func:`vllm_csv.sampling.certificate.certify_draw` must look at every live token of a
sampled row, hashing its noise and comparing the raw bits with the row's threshold for the
token's level; in torch that is about twenty ``[R, V]`` int64 and float64 passes (the hash
alone is ten), 20-30 ms a step for 8 rows of 65536 tokens on a 2-core CPU, more than the dense
head. The kernel does it in one pass per row and returns only the few tokens kept.

The noise itself (vLLM's CPU Gumbel noise, :mod:`vllm_csv.sampling.gumbel`) is hashed from
``(seed, token)`` alone: its torch reference (:func:`noise_bits_ref`, :func:`noise_of_bits`,
:func:`bits_below`) lives here, beside the kernels that hash it, and the sampler reads it from
here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .build import fake, load_ops, uses_kernels
from .live import RowStats, pack_live, pack_live_cpu, pack_live_ref, row_stats, row_stats_cpu, row_stats_ref

GOLDEN = 0x9E3779B97F4A7C15


# ---- the noise's hash (vllm_csv.sampling.gumbel's module docstring), torch reference ----------
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


def noise_bits_ref(seeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
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


# ---- noise_candidates ---------------------------------------------------------------------------
def noise_candidates_ref(hi: torch.Tensor, seeds: torch.Tensor, hmax: torch.Tensor, table: torch.Tensor,
                         force: torch.Tensor, ids: torch.Tensor | None, inv_level: float):
    """The tokens whose noise may reach their row's threshold.

    Parameters
    ----------
    hi : torch.Tensor
        ``[R, n]`` float32 upper bounds (no NaN, no ``+inf``; ``-inf``: not a candidate).
    seeds : torch.Tensor
        ``[R]`` int64, the rows' draw seeds.
    hmax : torch.Tensor
        ``[R]`` float32, each row's largest upper bound.
    table : torch.Tensor
        ``[R, levels + 1]`` int64: a token ``level`` steps of ``1 / inv_level`` below ``hmax``
        is kept iff its noise bits are ``>= table[r, level]``
        (:func:`bits_below`).
    force : torch.Tensor
        ``[R, k]`` int64 columns kept whatever their bits (``-1``: none).
    ids : torch.Tensor, optional
        ``[R, n]`` int64 token id of each column (packed rows); default: the column itself.
    inv_level : float
        ``1 / LEVEL``, a power of two (the level is ``floor((hmax - hi) * inv_level)``, clamped
        to ``[0, levels]``, in float64: exact).

    Returns
    -------
    (rows, cols, bits): ``[m]`` int64 each, the kept tokens row by row, columns ascending, and
    their 53 noise bits (:func:`noise_bits_ref`).
    """
    R, n = hi.shape
    tok = torch.arange(n, device=hi.device) if ids is None else ids
    bits = noise_bits_ref(seeds, tok).expand(R, n)
    levels = table.shape[1] - 1
    gap = (hmax.double()[:, None] - hi.double()).mul_(inv_level).floor_().nan_to_num_(nan=levels).clamp_(0, levels)
    keep = (bits >= table.gather(1, gap.long())).logical_and_(hi > -math.inf)
    forced = torch.zeros((R, n + 1), dtype=torch.bool, device=hi.device)
    forced.scatter_(1, torch.where(force >= 0, force, n), True)
    keep |= forced[:, :n]
    rows, cols = keep.nonzero().unbind(1)
    return rows, cols, bits[rows, cols]


def noise_candidates(hi, seeds, hmax, table, force, ids, inv_level: float):
    """Same as :func:`noise_candidates_ref`; the fused kernel on the CPU where it is built."""
    if uses_kernels(hi):
        return load_ops().noise_candidates(hi, seeds, hmax, table, force, ids, inv_level)
    return noise_candidates_ref(hi, seeds, hmax, table, force, ids, inv_level)


class Contenders(NamedTuple):
    best: torch.Tensor  # [R] float64, the largest computed noisy lower bound (-inf: none finite)
    winner: torch.Tensor  # [R] int64, the lowest column attaining it (n: no candidate)
    count: torch.Tensor  # [R] int64, how many contenders the row has
    rows: torch.Tensor  # [m] int64, the contenders, row by row, columns ascending
    cols: torch.Tensor  # [m] int64


def draw_contenders_ref(lo: torch.Tensor, hi: torch.Tensor, seeds: torch.Tensor, hmax: torch.Tensor,
                        delta: torch.Tensor, top_v: torch.Tensor, top_i: torch.Tensor, ids: torch.Tensor | None,
                        direct: bool, level: float, levels: int) -> Contenders:
    """The sampled rows' part of :func:`vllm_csv.sampling.certificate.certify_draw` (its module
    docstring is the proof): each row's noisy bounds ``nlo = lo + g``, ``nhi = hi + g`` (float64)
    of the tokens that may matter, the best ``nlo``, the lowest column attaining it and the
    contenders, ``nhi >= best - 2 delta``.

    Parameters
    ----------
    lo, hi : torch.Tensor
        ``[R, n]`` float32 bounds of the draw's inputs (no NaN, no ``+inf``; ``-inf`` on both:
        masked).
    seeds : torch.Tensor
        ``[R]`` int64, the rows' draw seeds.
    hmax : torch.Tensor
        ``[R]`` float32, each row's largest ``hi``.
    delta : torch.Tensor
        ``[R]`` float64, :func:`~vllm_csv.sampling.gumbel.noise_margin` of the row.
    top_v, top_i : torch.Tensor
        ``[R, k]`` float32 and int64: the ``k`` largest ``lo`` and their columns (read unless
        ``direct``): their noisy lower bounds set the first threshold ``L``, and they are
        candidates whatever their noise (where ``top_v > -inf``).
    ids : torch.Tensor, optional
        ``[R, n]`` int64 token id of each column (packed rows); default: the column itself.
    direct : bool
        Every live token is a candidate (no thresholds: few columns).
    level, levels : float, int
        The thresholds' step below ``hmax`` and their count (:data:`~vllm_csv.sampling.
        certificate.LEVEL`, ``LEVELS``): a token ``q`` levels below is a candidate iff its noise
        may reach ``t + max(q - 0.01, 0) level``, ``t = L - 2 delta - hmax``
        (:func:`bits_below`, :func:`noise_candidates`).

    Returns
    -------
    Contenders
        ``best``, ``winner`` and ``count`` ``[R]``; the contenders' ``rows`` and ``cols`` ``[m]``.
    """
    R, n = hi.shape
    dev = hi.device
    if direct:  # few columns (a later round's, on the contenders): every live token's noise
        ri, ci = (hi > -math.inf).nonzero().unbind(1)
        bits = noise_bits_ref(seeds, torch.arange(n, device=dev) if ids is None else ids)[ri, ci]
    else:
        top_tok = top_i if ids is None else ids.gather(1, top_i)
        L = (top_v.double() + noise_of_bits(noise_bits_ref(seeds, top_tok))).amax(1)  # <= best
        t = L - 2 * delta - hmax.double()
        k = torch.arange(levels + 1, dtype=torch.float64, device=dev)
        table = bits_below(t[:, None] + (k - 0.01).clamp_min(0) * level)  # [R, levels + 1]
        force = top_i.masked_fill(top_v == -math.inf, -1)
        ri, ci, bits = noise_candidates(hi, seeds, hmax, table, force, ids, 1 / level)
    # the noisy scores of those only, flat (a few percent of the row once bounds are tight)
    g = noise_of_bits(bits)
    flat = ri * n + ci  # (take: half the time of lo[ri, ci] here)
    nlo = torch.take(lo, flat).double().add_(g)  # -inf where lo = -inf
    nhi = torch.take(hi, flat).double().add_(g)
    best = torch.full((R,), -math.inf, dtype=torch.float64, device=dev).scatter_reduce_(0, ri, nlo, "amax")
    top_at = nlo == best[ri]
    w = torch.full((R,), n, dtype=torch.long, device=dev).scatter_reduce_(0, ri[top_at], ci[top_at], "amin")
    cont = nhi >= (best - 2 * delta)[ri]
    count = torch.zeros(R, dtype=torch.long, device=dev).index_add_(0, ri, cont.long())
    return Contenders(best, w, count, ri[cont], ci[cont])


def draw_contenders(lo, hi, seeds, hmax, delta, top_v, top_i, ids, direct: bool, level: float,
                    levels: int) -> Contenders:
    """Same as :func:`draw_contenders_ref`, in one kernel call on the CPU where it is built (the
    reference's sixty-odd small ops cost about 0.5 ms a call whatever the batch; ``std::log`` may
    differ from torch's by an ulp, which the noise margin covers, so a token within an ulp of a
    threshold may be listed by one and not the other: both are sound)."""
    fn = draw_contenders_cpu if uses_kernels(hi) else draw_contenders_ref
    return fn(lo, hi, seeds, hmax, delta, top_v, top_i, ids, direct, level, levels)


def draw_contenders_cpu(lo, hi, seeds, hmax, delta, top_v, top_i, ids, direct: bool, level: float,
                        levels: int) -> Contenders:
    """:func:`draw_contenders` on the kernels (the build not asked again: :class:`DrawOps`)."""
    return Contenders(*torch.ops.vllm_csv_cpu.draw_contenders(lo, hi, seeds, hmax, delta, top_v, top_i, ids, direct,
                                                              level, levels))


def noise_bits(seeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """:func:`noise_bits_ref` (``[B, n]`` int64 from ``seeds [B]``
    and ``ids [B, n]`` or ``[n]``), one kernel call on the CPU where it is built: for the few
    tokens a certificate hashes on their own, the reference's dozen small ops cost more than
    the hashing."""
    if uses_kernels(seeds):
        return load_ops().noise_bits(seeds, ids)
    return noise_bits_ref(seeds, ids)


# ---- the certificate's passes, bound once --------------------------------------------------------
class DrawOps(NamedTuple):
    """The passes :func:`vllm_csv.sampling.certificate.certify_draw` runs over a row's bounds,
    bound once for the tensors of one device: the kernel paths (``*_cpu``) where the CPU kernels
    run on them, else the torch references. A sampler's view of a head
    (:class:`vllm_csv.sampling.head_adapter.HeadAdapter`) binds them when it is built
    (:func:`draw_ops`); :data:`PER_CALL` asks each call, for callers with no binding."""

    row_stats: Callable[..., RowStats]
    pack_live: Callable[..., torch.Tensor]
    draw_contenders: Callable[..., Contenders]


def draw_ops(like: torch.Tensor) -> DrawOps:
    """The :class:`DrawOps` for bounds on ``like``'s device (the kernels if they are built and
    run there: :func:`~vllm_csv.ops.build.uses_kernels`)."""
    if uses_kernels(like):
        return DrawOps(row_stats_cpu, pack_live_cpu, draw_contenders_cpu)
    return DrawOps(row_stats_ref, pack_live_ref, draw_contenders_ref)


PER_CALL = DrawOps(row_stats, pack_live, draw_contenders)  # each call picks kernel or reference


# ---- fake implementations (shapes only: tracing, torch.compile) -------------------------------
@fake("noise_candidates")
def _(hi, seeds, hmax, table, force, ids, inv_level):
    m = torch.library.get_ctx().new_dynamic_size()
    return (hi.new_empty(m, dtype=torch.long), hi.new_empty(m, dtype=torch.long),
            hi.new_empty(m, dtype=torch.long))


@fake("noise_bits")
def _(seeds, ids):
    return seeds.new_empty(seeds.shape[0], ids.shape[-1], dtype=torch.long)
