"""The dense engine's own arithmetic after its GEMM, and sound comparisons through it.

vLLM's LM head produces ``zt = fl_dtype(<w, h> (+ b))`` in the model dtype and then, in that
dtype and in this order (``LogitsProcessor.forward``)::

    z = z / softcap; z = tanh(z); z = z * softcap      # soft-cap (Gemma-2), if set
    z *= scale                                           # if scale != 1

A certificate compares the dense values of two groups of tokens: a lower bound ``low`` of
the tokens it returns and an upper bound ``high`` of every other token. Both are compared
*as the engine computes them*, never in another precision:

* Rounding to the dtype is monotone, so an upper bound ``x`` of a real value gives the upper
  bound ``fl_dtype(x)`` of its rounded value, overflow to ``inf`` included.
* Division and multiplication by a positive constant are correctly rounded, hence monotone;
  torch's ``tanh`` is within one fp32 ulp of the real ``tanh`` on either of its code paths
  (vectorised and scalar), so two evaluations at ordered points are ordered up to two fp32
  ulps, which after rounding to a 16-bit dtype is at most one of its ulps. :meth:`bound`
  therefore steps the ``tanh`` output two ulps outwards (``nextafter``).
* Monotone maps can merge distinct values into ties (overflow to ``inf``, soft-cap
  saturation, underflow of ``z / softcap``), and the dense argmax breaks ties by the lowest
  index. :meth:`separated` demands ``low > high`` strictly at every stage, on the bounds
  carried through the engine's own ops: a tie anywhere is never certified.

This module is pure math on tensors: no policy, no state beyond the dtype and constants.
"""

from __future__ import annotations

import math

import torch

from .ops.cpu_step import single_valued

# Largest bound of a product or partial sum the dense fp32 accumulation may reach
# (DenseEngine.accumulator_safe): a quarter of fp32's range.
ACC_LIMIT = torch.finfo(torch.float32).max / 4



def flush_slack(d: int) -> float:
    """An absolute bound on what an engine that flushes subnormals to zero (FTZ: AVX512-BF16 and
    AMX dot products, any x86 process after ``torch.set_flush_denormal(True)``) changes in one
    dot product of length ``d`` with a bias, against gradual underflow: each of the ``d``
    products and ``d + 1`` partial sums and the result may lose at most ``2^-126``; doubled.
    Every interval of the head carries it (``CertifiedHead._tiny``, ``_tiny32``), so one
    certificate holds for IEEE and FTZ engines alike; it is far below any logit a model makes
    (``2^-112`` at ``d = 4096``). Inputs that such an engine reads as zero (DAZ: subnormal
    entries of ``h``, ``W`` or ``b``) are refused instead (``cpu_step.prepare_rows``, the
    head's ``certifiable``)."""
    return 2.0 * (2 * d + 4) * 2.0**-126


# Steps of nextafter applied to a tanh output: covers the implementation's error (one fp32
# ulp each way, and a differing vectorised/scalar path) in every dtype.
TANH_ULPS = 2


class DenseEngine:
    """The arithmetic of vLLM's dense head in ``dtype`` with ``softcap`` and ``scale``.

    Parameters
    ----------
    dtype : torch.dtype
        The model (logits) dtype.
    softcap : float or None
        ``LogitsProcessor.soft_cap``.
    scale : float
        ``LogitsProcessor.scale`` (``> 0``).
    """

    def __init__(self, dtype: torch.dtype, softcap: float | None, scale: float):
        self.dtype, self.softcap, self.scale = dtype, softcap, scale
        fmax = torch.finfo(dtype).max
        # Largest |pre-transform value| the certificate accepts: a quarter of the dtype's
        # range (and of fp32's, where the bounds are computed), so that neither the GEMM's
        # output, nor the bias added after it, nor the scale can overflow.
        lim = min(fmax, torch.finfo(torch.float32).max) / 4
        if softcap is None:
            lim /= max(1.0, scale)
        self.limit = lim
        # soft-cap bounds the output by softcap * scale: it must stay finite.
        self.ok = softcap is None or softcap * scale < min(fmax, torch.finfo(torch.float32).max) / 4

    # ---- the accumulator -------------------------------------------------------------------
    @staticmethod
    def accumulator_safe(hnorm: torch.Tensor, wmax: float, babs_max: float) -> torch.Tensor:
        """``[B]`` bool: the dense GEMM's fp32 accumulator cannot overflow on any token of these
        rows, in any order: every product and partial sum of ``<w_i, h> + b_i`` is at most
        ``||w_i|| ||h|| + |b_i|`` (Cauchy-Schwarz) before roundings, which at most double it, so
        ``fl(hnorm * wmax) + babs_max <= ACC_LIMIT`` (a quarter of fp32's range) keeps them finite.

        The one overflow guard of the dense accumulation for every path (``topk``,
        ``sampler_logits``, the plugin's rows through :meth:`CertifiedHead._prepare`, and the
        fused GPU step's ``quantize_rows``, which repeats this expression). A finite row can
        otherwise overflow inside the GEMM (products of opposite signs to ``-inf`` and ``inf``, a
        NaN logit that the dense argmax takes) while its largest screen value stays small.
        ``hnorm`` and ``wmax`` are fp32 upper bounds (``wmax`` with its own slack, as
        :attr:`CertifiedHead._wmax_up`); NaN compares False."""
        return hnorm * wmax + babs_max <= ACC_LIMIT

    # ---- the engine's computation ------------------------------------------------------
    def round(self, x: torch.Tensor) -> torch.Tensor:
        """``fl_dtype(x)`` (round to nearest: monotone), returned in fp32."""
        return x.to(self.dtype).float()

    def transform(self, z: torch.Tensor) -> torch.Tensor:
        """Exactly vLLM's ``LogitsProcessor`` soft-cap and scale, on ``z`` in the model dtype."""
        if self.softcap is not None:
            z = z / self.softcap
            z = torch.tanh(z)
            z = z * self.softcap
        if self.scale != 1.0:
            z = z * self.scale
        return z

    def bound(self, x: torch.Tensor, up: bool) -> torch.Tensor:
        """An upper (``up``) or lower bound of :meth:`transform` at any dense value on that side
        of ``x`` (fp32 holding model-dtype values): the engine's ops with the ``tanh`` output
        stepped :data:`TANH_ULPS` ulps outwards. Returns fp32."""
        z = x.to(self.dtype)
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap)
            toward = torch.full_like(z, math.inf if up else -math.inf)
            for _ in range(TANH_ULPS):
                z = torch.nextafter(z, toward)
            z = z * self.softcap
        if self.scale != 1.0:
            z = z * self.scale
        return z.float()

    # ---- sound comparisons ---------------------------------------------------------------
    def separated(self, low: torch.Tensor, high: torch.Tensor, temperature: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """``[B]`` bool: every dense value ``>= low`` beats every dense value ``<= high`` strictly,
        before and after the transform (and the temperature), with ties (also ties made by
        overflow, saturation or underflow) never accepted.

        Parameters
        ----------
        low : torch.Tensor
            ``[B]`` fp32, model-dtype values: lower bounds of the returned tokens' dense values.
        high : torch.Tensor
            ``[B]`` fp32, any real upper bound of every other token's *rounded* dense value
            (rounded here: ``fl_dtype`` is monotone, so ``fl_dtype(high)`` bounds it too).
        temperature : torch.Tensor, optional
            ``[B]`` fp32: rows with ``t > 0`` are compared as vLLM's sampler sees them,
            ``fl32(fl32(x) / t)`` (monotone in ``x``) of the transformed bounds.
        """
        high = self.round(high)
        ok = low > high
        if self.softcap is not None or self.scale != 1.0 or temperature is not None:
            lo_t, hi_t = self.bound(low, up=False), self.bound(high, up=True)
            ok &= lo_t > hi_t
            if temperature is not None:
                t = torch.where(temperature > 0, temperature, 1.0).to(torch.float32)
                ok &= (lo_t / t > hi_t / t) | (temperature <= 0)
        return ok & torch.isfinite(low)

    # Where the dense value is known bit for bit (same value, same sign of zero).
    single_valued = staticmethod(single_valued)
