"""vLLM's min-p and top-k masks on bounds, given each row's thresholds, and the sums top-p's
decisions read (``csrc/cpu/nucleus_cpu.cpp``), beside their torch references. The thresholds,
the decisions and their proofs are :func:`vllm_csv.sampling.nucleus.min_p.min_p_bounds`',
:func:`~vllm_csv.sampling.nucleus.top_k.top_k_bounds`' and
:class:`~vllm_csv.sampling.nucleus.top_p_queries.TopPQueries`'.

Why fused: the reference is two comparisons and two ``where`` over ``[R, V]``; torch's ``where``
and ``masked_fill`` on bool masks run a scalar loop on the CPU (about 0.7 ms each for 8 rows of
65536 tokens on 2 cores, where one vectorised pass takes 30 us).

Each op ``X`` asks per call whether the kernels run on its tensors and takes ``X_cpu`` (the kernel
path alone) or ``X_ref``. :class:`MaskOps` binds them once for one device, with the other passes
the masks and the sampler's rounds run over bounds (:func:`~vllm_csv.ops.topk.row_topk`,
:func:`~vllm_csv.ops.bools.flat_nonzero`, :func:`~vllm_csv.ops.live.row_stats`): a sampler's view
of a head (:class:`vllm_csv.sampling.head_adapter.HeadAdapter`) builds it with the head
(:func:`mask_ops`); :data:`PER_CALL` asks each call, for callers with no binding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .bools import flat_nonzero, flat_nonzero_cpu, flat_nonzero_ref
from .build import cpu_supports, fake, uses_kernels
from .live import RowStats, row_stats, row_stats_cpu, row_stats_ref
from .topk import TopK, row_topk, row_topk_cpu, row_topk_ref

SUMS_CHUNK = 1 << 22  # top_p_sums_ref: elements of a chunk's [queries, n] temporaries


def min_p_cut_ref(lo: torch.Tensor, hi: torch.Tensor, keep_at: torch.Tensor,
                  drop_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds after a per-row cut.

    Parameters
    ----------
    lo, hi : torch.Tensor
        ``[R, n]`` float32 bounds.
    keep_at, drop_at : torch.Tensor
        ``[R]`` float32 thresholds (NaN: never).

    Returns
    -------
    (new_lo, new_hi): ``[R, n]`` float32; ``new_lo = lo`` where ``lo >= keep_at`` (certainly
    kept), else ``-inf``; ``new_hi = -inf`` where ``hi < drop_at`` and ``lo > -inf`` (certainly
    dropped), else ``hi``.
    """
    new_lo = torch.where(lo >= keep_at[:, None], lo, -math.inf)
    new_hi = hi.masked_fill((hi < drop_at[:, None]) & (lo > -math.inf), -math.inf)
    return new_lo, new_hi


def min_p_cut(lo: torch.Tensor, hi: torch.Tensor, keep_at: torch.Tensor,
              drop_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as :func:`min_p_cut_ref`; one pass on the CPU where the kernel is built."""
    if uses_kernels(lo):
        return min_p_cut_cpu(lo, hi, keep_at, drop_at)
    return min_p_cut_ref(lo, hi, keep_at, drop_at)


def min_p_cut_cpu(lo: torch.Tensor, hi: torch.Tensor, keep_at: torch.Tensor,
                  drop_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`min_p_cut` on the kernels (the build not asked again: :class:`MaskOps`)."""
    return torch.ops.vllm_csv_cpu.min_p_cut(lo, hi, keep_at, drop_at)


def top_k_cut_ref(lo: torch.Tensor, hi: torch.Tensor, hk: torch.Tensor, hk1: torch.Tensor,
                  lk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds after a row's top-k decisions.

    Parameters
    ----------
    lo, hi : torch.Tensor
        ``[R, n]`` float32 bounds.
    hk, hk1, lk : torch.Tensor
        ``[R]`` float32: the ``k``-th and ``(k + 1)``-th largest upper bounds ``H_k``, ``H_(k+1)``
        and the ``k``-th largest lower bound ``L_k`` of the row.

    Returns
    -------
    (new_lo, new_hi): ``[R, n]`` float32; ``new_lo = lo`` where ``lo >= H_(k+1)`` if ``hi >= H_k``
    (the token is among the ``k`` highest upper bounds: the others' ``k``-th is ``H_(k+1)``), else
    where ``lo >= H_k`` (certainly kept), and ``-inf`` elsewhere; ``new_hi = -inf`` where
    ``hi < L_k`` (certainly dropped), else ``hi``.
    """
    new_lo = lo.masked_fill(~(lo >= torch.where(hi >= hk[:, None], hk1[:, None], hk[:, None])), -math.inf)
    new_hi = hi.masked_fill(hi < lk[:, None], -math.inf)
    return new_lo, new_hi


def top_k_cut(lo: torch.Tensor, hi: torch.Tensor, hk: torch.Tensor, hk1: torch.Tensor,
              lk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as :func:`top_k_cut_ref`; one pass on the CPU where the kernel is built (the reference's
    ``where``, comparisons and two ``masked_fill`` took about 4 ms for 8 rows of 65536 tokens on 2
    cores)."""
    if uses_kernels(lo):
        return top_k_cut_cpu(lo, hi, hk, hk1, lk)
    return top_k_cut_ref(lo, hi, hk, hk1, lk)


def top_k_cut_cpu(lo: torch.Tensor, hi: torch.Tensor, hk: torch.Tensor, hk1: torch.Tensor,
                  lk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_k_cut` on the kernels (the build not asked again: :class:`MaskOps`)."""
    return torch.ops.vllm_csv_cpu.top_k_cut(lo, hi, hk, hk1, lk)


def top_p_sums_ref(lo: torch.Tensor, hi: torch.Tensor, el: torch.Tensor, eh: torch.Tensor,
                   qrow: torch.Tensor, qcol: torch.Tensor) -> torch.Tensor:
    """The four masses top-p decides a token on (:mod:`vllm_csv.sampling.nucleus.top_p`, "top-p"),
    each summed over the whole row.

    Parameters
    ----------
    lo, hi : torch.Tensor
        ``[R, n]`` float32 bounds.
    el, eh : torch.Tensor
        ``[R, n]`` float64 masses ``e^(lo - c)``, ``e^(hi - c)`` (shifted by the row's ``c``).
    qrow, qcol : torch.Tensor
        ``[Q]`` int64: the queried tokens, token ``i = qcol[q]`` of row ``qrow[q]``.

    Returns
    -------
    torch.Tensor
        ``[Q, 4]`` float64: with ``a = lo_i``, ``b = hi_i``, ``n_hi = sum_{j != i, hi_j >= a} eh_j``
        (the upper masses of the tokens that may sort after ``i``), ``r_lo = sum_{hi_j < a} el_j``
        (the lower masses of those that sort before it; ``i``'s own is the caller's to add),
        ``n_lo = sum_{lo_j > b} el_j`` (those that must sort after it), ``r_hi = sum_{lo_j <= b} eh_j``.
    """
    step = max(1, SUMS_CHUNK // max(1, lo.shape[1]))  # queries a chunk: [step, n] temporaries
    zero = torch.zeros((), dtype=el.dtype, device=el.device)
    out = []
    for q0 in range(0, qrow.shape[0], step):
        r, c = qrow[q0:q0 + step], qcol[q0:q0 + step]
        lo_q, hi_q, el_q, eh_q = (t[r] for t in (lo, hi, el, eh))  # [q, n]
        a = lo_q.gather(1, c[:, None])
        b = hi_q.gather(1, c[:, None])
        up, after = hi_q >= a, lo_q > b
        own = torch.zeros_like(up).scatter_(1, c[:, None], True)
        out.append(torch.stack([torch.where(up & ~own, eh_q, zero).sum(1), torch.where(up, zero, el_q).sum(1),
                                torch.where(after, el_q, zero).sum(1), torch.where(after, zero, eh_q).sum(1)], 1))
    return torch.cat(out) if out else el.new_zeros((0, 4))


def top_p_sums(lo: torch.Tensor, hi: torch.Tensor, el: torch.Tensor, eh: torch.Tensor,
               qrow: torch.Tensor, qcol: torch.Tensor) -> torch.Tensor:
    """Same as :func:`top_p_sums_ref` (the float64 sums in another order); one pass over the row
    per query on the CPU where the kernel is built."""
    if uses_kernels(lo):
        return top_p_sums_cpu(lo, hi, el, eh, qrow, qcol)
    return top_p_sums_ref(lo, hi, el, eh, qrow, qcol)


def top_p_sums_cpu(lo: torch.Tensor, hi: torch.Tensor, el: torch.Tensor, eh: torch.Tensor,
                   qrow: torch.Tensor, qcol: torch.Tensor) -> torch.Tensor:
    """:func:`top_p_sums` on the kernels (the build not asked again: :class:`MaskOps`)."""
    return torch.ops.vllm_csv_cpu.top_p_sums(lo, hi, el, eh, qrow, qcol)


def unlisted_masses_ref(lo: torch.Tensor, hi: torch.Tensor, c: torch.Tensor, ih: torch.Tensor) -> torch.Tensor:
    """The masses of the tokens off top-p's list
    (:class:`vllm_csv.sampling.nucleus.top_p_queries.TopPQueries`, whose ``_unlisted`` bounds the
    exact sums from these).

    Parameters
    ----------
    lo, hi : torch.Tensor
        ``[R, n]`` float32 bounds.
    c : torch.Tensor
        ``[R, 1]`` float32: each row's shift (at least every ``hi`` of the row, or 0).
    ih : torch.Tensor
        ``[R, K]`` int64: each row's listed tokens (distinct).

    Returns
    -------
    torch.Tensor
        ``[R, 2]`` float64: ``sum_j fl32(exp(fl32(lo_j - c)))`` and the same of ``hi`` over the
        tokens ``j`` not listed, the fp32 terms summed in float64 (``-inf`` -> 0).
    """
    def side(y: torch.Tensor) -> torch.Tensor:
        # (the listed terms zeroed after the exp, in place: one [R, n] temporary)
        return torch.sub(y, c).exp_().scatter_(1, ih, 0.0).sum(1, dtype=torch.float64)

    return torch.stack([side(lo), side(hi)], 1)


def unlisted_masses(lo: torch.Tensor, hi: torch.Tensor, c: torch.Tensor, ih: torch.Tensor) -> torch.Tensor:
    """Same as :func:`unlisted_masses_ref`, the float64 sums in another order and the exp SLEEF's
    (1 ulp, as torch's own on AVX-512 CPUs): one pass over both sides on CPUs where the kernel
    runs (AVX-512, and libtorch exports ``Sleef_expf16_u10``), the reference elsewhere."""
    # (the op answers from what it found once, at its first call)
    if uses_kernels(lo) and cpu_supports("sleef_expf16"):
        return unlisted_masses_cpu(lo, hi, c, ih)
    return unlisted_masses_ref(lo, hi, c, ih)


def unlisted_masses_cpu(lo: torch.Tensor, hi: torch.Tensor, c: torch.Tensor, ih: torch.Tensor) -> torch.Tensor:
    """:func:`unlisted_masses` on the kernels, where the CPU runs them (``cpu_supports("sleef_expf16")``,
    asked once by :func:`mask_ops`; the build not asked again)."""
    return torch.ops.vllm_csv_cpu.unlisted_masses(lo, hi, c, ih)


# ---- the passes bound once --------------------------------------------------------------------
class MaskOps(NamedTuple):
    """The passes vLLM's masks on bounds (:mod:`vllm_csv.sampling.nucleus`) and the sampler's
    rounds (:mod:`vllm_csv.sampling.rounds`) run over a row's bounds, bound once for the tensors of
    one device: the kernel paths (``*_cpu``) where the CPU kernels run on them, else the torch
    references. A sampler's view of a head (:class:`vllm_csv.sampling.head_adapter.HeadAdapter`)
    binds them when it is built (:func:`mask_ops`); :data:`PER_CALL` asks each call, for callers
    with no binding."""

    min_p_cut: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    top_k_cut: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    top_p_sums: Callable[..., torch.Tensor]
    unlisted_masses: Callable[..., torch.Tensor]
    row_topk: Callable[..., TopK]
    flat_nonzero: Callable[..., torch.Tensor]
    row_stats: Callable[..., RowStats]


def mask_ops(like: torch.Tensor) -> MaskOps:
    """The :class:`MaskOps` for bounds on ``like``'s device (the kernels if they are built and run
    there: :func:`~vllm_csv.ops.build.uses_kernels`; :func:`unlisted_masses`' where the CPU also
    runs SLEEF's exp)."""
    if uses_kernels(like):
        unlisted = unlisted_masses_cpu if cpu_supports("sleef_expf16") else unlisted_masses_ref
        return MaskOps(min_p_cut_cpu, top_k_cut_cpu, top_p_sums_cpu, unlisted, row_topk_cpu, flat_nonzero_cpu,
                       row_stats_cpu)
    return MaskOps(min_p_cut_ref, top_k_cut_ref, top_p_sums_ref, unlisted_masses_ref, row_topk_ref, flat_nonzero_ref,
                   row_stats_ref)


PER_CALL = MaskOps(min_p_cut, top_k_cut, top_p_sums, unlisted_masses, row_topk, flat_nonzero, row_stats)  # each
# call picks kernel or reference


# ---- fake implementations (shapes only: tracing, torch.compile) -------------------------------
@fake("min_p_cut")
def _(lo, hi, keep_at, drop_at):
    return torch.empty_like(lo), torch.empty_like(hi)


@fake("top_k_cut")
def _(lo, hi, hk, hk1, lk):
    return torch.empty_like(lo), torch.empty_like(hi)


@fake("top_p_sums")
def _(lo, hi, el, eh, qrow, qcol):
    return lo.new_empty(qrow.shape[0], 4, dtype=torch.float64)


@fake("unlisted_masses")
def _(lo, hi, c, ih):
    return lo.new_empty(lo.shape[0], 2, dtype=torch.float64)
