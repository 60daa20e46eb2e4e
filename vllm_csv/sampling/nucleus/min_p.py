"""vLLM's min-p on bounds: the tokens ``MinPLogitsProcessor`` certainly keeps or drops.

Bounds in and out as :mod:`vllm_csv.sampling.nucleus` says (dropped: ``-inf`` on both sides;
undecided: ``ylo = -inf``).

min-p (``MinPLogitsProcessor``): token ``i`` is dropped iff ``p_i < p_max * min_p`` with
``p = softmax(y)`` in fp32, i.e. (real arithmetic) iff ``y_i - m < log(min_p)``, ``m = max y``.
vLLM's fp32 evaluation (``y - m``, ``exp``, the division by the sum, the product with
``min_p``) moves ``log(p_i / (p_max min_p))`` by at most ``8u + u(|y_i| + |m|)`` (``u = 2^-24``)
while nothing underflows; we decide with the margin ``1e-5 + 2^-21 (|y_i| + |m|)``, and
certify nothing for ``min_p < 1e-20`` (its threshold could be subnormal).
``m`` lies in ``[max ylo, max yhi]``. One margin serves the whole row (:func:`min_p_bounds`):
``|y_i|`` and ``|m|`` are replaced by ``A = max(|max yhi|, -least finite ylo, -least finite
yhi, 0)`` (``row_stats``' ``absmax``), at least ``|y_i|`` for every token whose lower bound is
finite and at least ``|max ylo|`` (a token whose lower bound is ``-inf`` is never dropped); the thresholds ``max yhi + log(min_p) + eps`` (keep: ``ylo_i >=``) and
``max ylo + log(min_p) - eps`` (drop: ``yhi_i <``) are evaluated in float64 and rounded outwards
to fp32, so each token costs one fp32 comparison. (The float64 rounding of a threshold,
``< 2^-51 (A + 50)``, and of ``log``, is far inside the margin's slack over vLLM's error:
``1e-5 - 8u`` and ``(2^-21 - 2^-24)(|y_i| + |m|)``.)

min-p on part of the row (:func:`min_p_drops_on_part`, tensor parallelism: a rank sees its
shard only). The part's ``m0 = max ylo`` over it is at most ``m``. Token ``i`` is dropped
for every ``m >= m0`` once ``yhi_i - m0 < log(min_p) - eps`` with ``eps`` as above, ``|m|``
replaced by ``ym0 >= |m0|``: what vLLM's evaluation must keep below 0,
``yhi_i - m - log(min_p) + 8u + u(|y_i| + |m|)``, does not grow with ``m`` (its
``u |m| - m`` has slope ``-1 +- u``), and it is below 0 at ``m0``.

The outside blocks (:class:`~vllm_csv.sampling.outside.Outside`, tensor parallelism). The maximum
``m`` may be a block token, so ``m <= max(max yhi, max hi)``; a block is dropped as a whole
when ``hi - max ylo < log(min_p) - eps_b``, ``eps_b = 1e-5 + 2^-21 (absmax + |m|max)`` (at
least every block token's own margin: ``|y_j| <= absmax``), and kept as a whole when
``lo - m_hi >= log(min_p) + eps_b`` (every token's ``ylo_j >= lo``). A block not kept as a
whole may lose tokens (their ``ylo_j`` becomes ``-inf``, as a single token's does): its lower
mass is then only ``>= 0`` and its smallest lower bound ``-inf`` (``lel = lo = -inf``; its
upper side stays an upper bound), so top-p neither counts its lower mass before a token nor
places it after one.
"""

from __future__ import annotations

import math

import torch

from ...fp import round_down32, round_up32
from ...ops.masks import PER_CALL, MaskOps
from ..outside import Outside

MIN_P_FLOOR = 1e-20


def _min_p_margin(y_abs: torch.Tensor, m_abs: torch.Tensor) -> torch.Tensor:
    """min-p's decision margin for tokens with ``|y_i| <= y_abs`` when ``|m| <= m_abs`` (float64):
    ``1e-5 + 2^-21 (|y_i| + |m|)``, above vLLM's fp32 error ``8u + u(|y_i| + |m|)`` (module
    docstring)."""
    return 1e-5 + 2.0**-21 * (y_abs + m_abs)


def has_min_p(min_p: torch.Tensor) -> torch.Tensor:
    """``[R]`` bool: the rows with a min-p (``min_p > 0``)."""
    return min_p > 0


def min_p_bounds(ylo: torch.Tensor, yhi: torch.Tensor, min_p: torch.Tensor, outside: Outside | None = None,
                 ops: MaskOps = PER_CALL):
    """Apply min-p (``[R]`` float32, ``0`` = off) to bounds; see the module docstring.
    Returns ``(ylo, yhi)``, or ``(ylo, yhi, outside)`` when an outside block is given (see
    "the outside blocks" in the module docstring).

    Per-row thresholds, one fp32 comparison per token (:func:`~vllm_csv.ops.masks.min_p_cut`).
    A row without min-p keeps its bounds, but for NaN lower bounds, which become ``-inf`` (a
    lower bound still). ``ops``: the passes bound once (:attr:`.HeadAdapter.masks`); default:
    each call picks kernel or reference."""
    on = has_min_p(min_p)
    if not bool(on.any()) or ylo.shape[1] == 0:
        return (ylo, yhi) if outside is None else (ylo, yhi, outside)
    st = ops.row_stats(ylo, yhi, 1)  # one pass: max ylo, max yhi (NaN if the row has one), A
    mlo, mhi = st.lmax.double(), st.hmax.double()
    if outside is not None:  # a block may hold the maximum: m <= max(max yhi, its hi)
        mhi = torch.maximum(mhi, outside.max_hi())
    # A = max(|max yhi|, -min finite ylo, -min finite yhi, 0) >= |y_i| for every token whose
    # lower bound is finite, and >= |max ylo|
    absmax = st.absmax.double()
    logmp = torch.log(min_p.double().clamp_min(MIN_P_FLOOR))
    ym = torch.maximum(absmax, mhi.abs())
    eps = _min_p_margin(absmax, ym)
    usable = on & (min_p >= MIN_P_FLOOR)
    # kept iff ylo_i >= max yhi + log(min_p) + eps (rounded up to fp32: a larger threshold keeps
    # less); dropped iff yhi_i < max ylo + log(min_p) - eps (rounded down) and ylo_i > -inf. Rows
    # without min-p: every lower bound kept, nothing dropped; unusable rows (min_p below the
    # floor, or a NaN / +inf bound): nothing kept nor dropped.
    keep_at = round_up32(mhi + logmp + eps)
    keep_at = torch.where(usable & (keep_at < math.inf), keep_at, math.nan).masked_fill_(~on, -math.inf)
    drop_at = round_down32(mlo + logmp - eps).masked_fill_(~usable, -math.inf)
    new_lo, new_hi = ops.min_p_cut(ylo, yhi, keep_at, drop_at)
    if outside is None:
        return new_lo, new_hi
    # each block as one token: every y_j <= its hi, lo <= ylo_j and |y_j| <= its absmax
    mlo, mhi, logmp, ym = mlo[:, None], mhi[:, None], logmp[:, None], ym[:, None]
    eps_b = _min_p_margin(outside.absmax, ym)
    drop_b = (outside.hi - mlo) < logmp - eps_b
    keep_b = (outside.lo - mhi) >= logmp + eps_b
    unsure = ~(keep_b & usable[:, None]) & on[:, None]  # may lose tokens: its lower side is unknown
    return new_lo, new_hi, outside.drop(drop_b & (usable & on)[:, None]).forget_lower(unsure)


def min_p_drops_on_part(ylo: torch.Tensor, yhi: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``[R, n]`` bool: tokens of part of each row (``ylo, yhi`` ``[R, n]`` float32, the rest
    of the row unseen) that min-p (``[R]`` float32, ``0`` = off) drops whatever the rest holds
    (module docstring, "min-p on part of the row")."""
    usable = (min_p > 0) & (min_p >= MIN_P_FLOOR)
    if ylo.shape[1] == 0 or not bool(usable.any()):
        return torch.zeros_like(yhi, dtype=torch.bool)
    m0 = ylo.amax(1, keepdim=True).double()
    ym0 = torch.maximum(m0.abs(), yhi.amax(1, keepdim=True).double().abs())
    logmp = torch.log(min_p.double().clamp_min(MIN_P_FLOOR))[:, None]
    eps = _min_p_margin(torch.maximum(ylo.abs(), yhi.abs()).double(), ym0)
    return ((yhi.double() - m0) < logmp - eps) & usable[:, None]
