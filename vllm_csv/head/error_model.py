"""The error model: how wide a token's interval is, and why.

A screen gives a centre ``y_i`` and a radius with ``|<w_i, h> + b_i - y_i| <= r_i ||h|| + ...``
in real arithmetic (each screen's docstring proves its own). The dense engine computes
``zt_i = fl(<w_i, h> + b_i)``: fp32 accumulation in any order, the result rounded to the model
dtype, the bias added inside the accumulation or after a first rounding
(:mod:`vllm_csv.dense_engine`). :class:`ErrorModel` holds every term that widens the screen's
interval into one that holds ``zt_i``:

* the dense GEMM's accumulation error ``gamma_{d+2} ||w_i|| ||h||`` (:attr:`ErrorModel.acc_err`,
  per token, divided by ``||h||``): :meth:`ErrorModel.rad_total` adds it to the screen radius;
* two output-dtype roundings and the screen's own relative terms, taken of ``|y_i| + |b_i|``
  (``delta = 2^(2-p) + 8u``, :attr:`ErrorModel.delta`): a bound of the *pre-bias* product, so a
  bias that cancels ``<w_i, h>`` does not shrink them (:meth:`ErrorModel.bias_slack`);
* absolute terms for subnormal roundings and what a flush-to-zero engine drops
  (:attr:`ErrorModel.tiny`, :attr:`ErrorModel.tiny32`; :func:`vllm_csv.dense_engine.flush_slack`);
* the exact scores' float64 error (:attr:`ErrorModel.score_coef`, :func:`vllm_csv.ops.step.score_intervals`);
* the accumulator guard (:meth:`ErrorModel.accumulator_safe`): a row is certified only when
  ``||h|| max_i ||w_i|| + max |b|`` bounds every product and partial sum of the dense GEMM well
  inside fp32, and ``127 d ||h||`` those of an integer screen's GEMM (:attr:`ErrorModel.guard_scale`).

Half-width of token ``i`` for a screen output ``(y, radius r, rel, n, e)``
(:meth:`vllm_csv.head.bounds.intervals`)::

    m_i = rad_total_i ||h|| + (delta + rel) (|y_i| + |b_i|) + n_i (1 + delta) e + tiny
    rad_total_i = (r_i + acc_err_i) (1 + delta)

Everything here is computed once per head (and once per screen tensor: a screen hands out one
or two fixed radius tensors); nothing reads a step's state. ``docs/guarantee.md`` states the
arithmetic this models.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..dense_engine import SCREEN_STRETCH, DenseEngine, flush_slack
from ..fp import FP32_UNIT_ROUNDOFF, gamma, round_up32, significand_bits
from ..screens.copy_error import row_norms


def _per_tensor(cache: dict, t: torch.Tensor, fn):
    """``fn(t)``, computed once per tensor (not per step): screens hand out fixed per-token
    tensors, one or two (a screen that picks one of two copies by batch size)."""
    hit = cache.get(id(t))
    if hit is None or hit[0] is not t:  # (the tensor is kept: its id is not reused meanwhile)
        hit = cache[id(t)] = (t, fn(t))
    return hit[1]


class Widths(NamedTuple):
    """:meth:`ErrorModel.widths`: a step's terms of the half-width (module docstring)."""

    rad: torch.Tensor  # [V] rad_total, (r + acc_err)(1 + delta)
    rad_max: float  # its maximum
    delta: float  # delta + the screen's rel
    bslack: torch.Tensor  # [V] the bias slack (all zeros without a bias)
    bmax: float  # its maximum (0.0 without a bias)
    safe: torch.Tensor  # [B] bool, accumulator_safe of the rows


@dataclass
class ErrorModel:
    """The error terms of one head ``W [V, d]`` (model dtype ``dtype``), bias ``b``.

    Build with :meth:`of_head`. Mutation tests replace a term with :meth:`replace` (a new model
    with fresh caches) and assign it to the head's ``errors``.

    Attributes
    ----------
    gamma : float
        ``gamma_{d+2}`` at the dense GEMM's unit roundoff.
    gamma64 : float
        ``4 gamma_{d+2}`` at float64's: the exact scores' own sums.
    delta : float
        ``2^(2-p) + 8u``: two roundings to the model dtype (``p`` its significand bits) and the
        fp32 arithmetic of the bounds.
    tiny, tiny32 : float
        Absolute terms (model dtype, fp32): subnormal roundings and flush-to-zero.
    acc_err : torch.Tensor
        ``[V]`` fp32: ``gamma ||w_i||``, rounded up; times ``||h||`` it bounds the dense GEMM's
        accumulation error of ``<w_i, h>``.
    guard_scale : float
        The accumulator guard's scale (:meth:`accumulator_safe`): ``max_i ||w_i||`` rounded up
        or, where larger, ``SCREEN_STRETCH d`` (an integer screen's first product: its codes
        stretch ``h`` to ``+-127``, so ``|fl(acc) t| <= 127 d max|h| <= 127 d ||h||``, whatever the
        head's rows; it overflowed fp32 on a CUDA screen at ``max|h| ~ 1e34``, a ``-inf`` centre and
        a NaN bound that Triton's maximum drops), with room for the guard's own product's rounding.
    babs : torch.Tensor
        ``[V]`` fp32: ``max(|b_i|, the screen's per-token offset)``: the pre-bias magnitude of
        every relative error is at most ``|y_i|`` plus this.
    babs_max : float
        ``max(babs)``.
    """

    gamma: float
    gamma64: float
    delta: float
    tiny: float
    tiny32: float
    acc_err: torch.Tensor
    guard_scale: float
    babs: torch.Tensor
    babs_max: float
    _rad_cache: dict = field(default_factory=dict, repr=False, compare=False)
    _nmax_cache: dict = field(default_factory=dict, repr=False, compare=False)
    _slack_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of_head(cls, weight: torch.Tensor, bias: torch.Tensor | None, offset_abs: torch.Tensor | None = None,
                unit_roundoff: float = FP32_UNIT_ROUNDOFF) -> ErrorModel:
        """The model of ``weight [V, d]`` (its real rows), ``bias [V]`` and a screen's per-token
        offset ``offset_abs [V]`` (its bias term, None for most screens)."""
        V, d = weight.shape
        g = gamma(d + 2, unit_roundoff)
        wn64 = row_norms(weight)  # (chunked: no float64 copy of all of W)
        babs = torch.zeros(V, device=weight.device) if bias is None else bias.float().abs()
        if offset_abs is not None:
            babs = torch.maximum(babs, offset_abs)
        return cls(
            gamma=g,
            gamma64=4 * gamma(d + 2, 2.0**-53),  # float64 sums of the exact scores
            delta=2.0 ** (2 - significand_bits(weight.dtype)) + 8 * FP32_UNIT_ROUNDOFF,
            tiny=2 * torch.finfo(weight.dtype).tiny + flush_slack(d),
            tiny32=2 * torch.finfo(torch.float32).tiny + flush_slack(d),
            acc_err=(g * wn64).float() * (1 + 4 * FP32_UNIT_ROUNDOFF),
            guard_scale=max(float(round_up32(wn64.max())), SCREEN_STRETCH * d) * (1 + 2.0**-20) if V else 0.0,
            babs=babs,
            babs_max=float(babs.max()) if V else 0.0)

    def replace(self, **changes) -> ErrorModel:
        """A copy with ``changes`` and empty caches (mutation tests: remove one term)."""
        return dataclasses.replace(self, _rad_cache={}, _nmax_cache={}, _slack_cache={}, **changes)

    @property
    def score_coef(self) -> float:
        """``gamma_{d+2} + 4 gamma64_d``: the exact scores' error coefficient of ``sum |w_ji h_i|``."""
        return self.gamma + self.gamma64

    def rad_total(self, r: torch.Tensor) -> tuple[torch.Tensor, float]:
        """``(rad_total [V], max)`` for the screen radius ``r [V]``: ``(r + acc_err)(1 + delta)``,
        the screen radius, the accumulation error and two output roundings of the radius term.
        Computed once per radius tensor."""
        def total(r):
            t = (r + self.acc_err) * (1 + self.delta)
            return t, float(t.max()) if t.numel() else 0.0
        return _per_tensor(self._rad_cache, r, total)

    def max_of(self, n: torch.Tensor) -> float:
        """``max(n)`` of a per-token screen constant (computed once per tensor)."""
        return _per_tensor(self._nmax_cache, n, lambda n: float(n.max()) if n.numel() else 0.0)

    def bias_slack(self, rel: float) -> tuple[torch.Tensor, float]:
        """``[V]`` absolute slack ``(delta + rel + gamma) |b_i| (1 + 4u)`` and its maximum: the
        relative terms of the pre-bias product (``|<w_i, h>| <= |y_i| + |b_i|``) and the dense
        accumulation's error on the bias term."""
        if rel not in self._slack_cache:
            c = (self.delta + rel + self.gamma) * (1 + 4 * FP32_UNIT_ROUNDOFF)
            s = self.babs * c
            self._slack_cache[rel] = (s, float(s.max()) if s.numel() else 0.0)
        return self._slack_cache[rel]

    def spread(self, rad_max: float, hnorm: torch.Tensor, act: float, rel: float) -> torch.Tensor:
        """``[B]`` the part of every token's half-width that does not scale with ``|y_i|``:
        ``rad_max ||h|| + act + tiny + max_i bslack_i`` (``act``: the activation term's bound,
        ``max n (1 + delta) e``). Then ``|hi_i - y_i|, |lo_i - y_i| <= (delta + rel) |y_i| + spread``."""
        return rad_max * hnorm + act + self.tiny + self.bias_slack(rel)[1]

    def widths(self, radius: torch.Tensor, rel: float, hnorm: torch.Tensor) -> Widths:
        """Every term a step's intervals take from the model, for a screen output's ``radius
        [V]`` and ``rel`` and the rows' ``hnorm [B]``, in one call
        (:func:`vllm_csv.head.bounds.intervals`): :meth:`rad_total`, ``delta + rel``,
        :meth:`bias_slack` and :meth:`accumulator_safe`."""
        rad, rad_max = self.rad_total(radius)
        bslack, bmax = self.bias_slack(rel)
        return Widths(rad, rad_max, self.delta + rel, bslack, bmax, self.accumulator_safe(hnorm))

    def accumulator_safe(self, hnorm: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: no product or partial sum of the dense GEMM can overflow fp32, nor an
        integer screen's scaled product (:meth:`DenseEngine.accumulator_safe` with
        :attr:`guard_scale`). A row that may overflow there is one with inf."""
        return DenseEngine.accumulator_safe(hnorm, self.guard_scale, self.babs_max)
