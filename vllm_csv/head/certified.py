"""The certified LM head: exact logits on a certified sub-vocabulary, dense otherwise.

Notation (SPEC.md, ``docs/guarantee.md``): head ``W [V, d]``, bias ``b``, hidden ``h``; the
dense engine computes ``zt_i = fl(<w_i, h> + b_i)`` (fp32 accumulation, output rounded to the
model dtype, the bias added inside the accumulation or after a first rounding) and then, in the
model dtype, vLLM's soft-cap and scale (:mod:`vllm_csv.dense_engine`).

:class:`CertifiedHead` binds the parts, once, when it is built: the screen
(:mod:`vllm_csv.screens`), the error model (:mod:`.error_model`), the engine's arithmetic and
its probe, the backend (:mod:`.backend`: torch reference, CPU kernels or CUDA). Its methods are
the public interfaces (:mod:`.selector`): the bounds (:meth:`CertifiedHead.intervals`,
:meth:`CertifiedHead.score`, :mod:`.bounds`), the selection (:meth:`CertifiedHead.select`,
:mod:`.selection`, :mod:`.certificate`), and the steps of the public API
(:meth:`CertifiedHead.topk`; :meth:`CertifiedHead.sampler_logits`, :mod:`.runtime`).

What a certified row returns (``[V]``): the dense head's values on its top-k ``T`` (bit for
bit when the row asked for values) and ``-inf`` on every other token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..cpu_malloc import tune_malloc
from ..dense_engine import DenseEngine, fp32_matmul_is_ieee, probe_engine
from ..errors import CSVError
from ..off_switch import OffSwitch
from ..ops.rows import has_subnormal
from ..screens import make_screen
from . import bounds, certificate, runtime, selection
from .backend import backend_for
from .error_model import ErrorModel
from .types import HeadConfig, Intervals, Scores, Selection, StepStats, TopKResult

logger = logging.getLogger("vllm.csv_decode")


class CertifiedHead:
    """Batched certified top-k over ``W [V, d]`` (rows beyond ``vocab_size`` are padding).

    Pipeline of a step (:meth:`sampler_logits`): screen every token (``y``, bounds) ->
    per-row threshold and candidate set ``S`` -> exact scores on ``S`` through the engine's
    rounding -> certificate (:func:`.certificate.certify`) -> ``[B, V]`` output, dense head on
    the whole batch for the rows that are not certified.

    Parameters
    ----------
    weight : torch.Tensor
        ``[V', d]`` the LM head (model dtype), ``V' >= vocab_size``.
    bias : torch.Tensor, optional
        ``[V']``.
    vocab_size : int, optional
        The real rows (default all).
    config : HeadConfig, optional
    index : CSVIndex, optional
        Screen ``ball``'s cluster index.
    softcap, scale : float
        vLLM's logit soft-cap and scale.
    two_sided : bool
        The ball in its two-sided form (every other screen is two-sided).
    engine_linear : callable, optional
        ``linear(h, w)``: the engine's own GEMM, probed at construction (default ``F.linear``).
    engine_rows : int, optional
        The rows of the weight that GEMM multiplies on the head, padding included (default
        ``V'`` with ``engine_linear``, else ``vocab_size``: :meth:`dense_logits` multiplies the real
        rows): the probe takes a head of that class (:func:`~vllm_csv.dense_engine.probe_shape_rows`).

    Attributes
    ----------
    errors : ErrorModel
        The error terms (public: mutation tests replace it).
    backend : Backend
        What runs the step (chosen here, logged once).
    screen
        The screen; ``screen_name``, ``screen_backend`` name it.
    off_switch : OffSwitch or None
        The plugin's off-switch, carried for it (``config.off_switch``); the head never asks it.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 vocab_size: int | None = None, config: HeadConfig | None = None, index=None,
                 softcap: float | None = None, scale: float = 1.0, two_sided: bool = False,
                 engine_linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 engine_rows: int | None = None):
        self.config = config or HeadConfig()
        if weight.device.type == "cpu":
            tune_malloc()
        V = vocab_size or weight.shape[0]
        if weight.dim() != 2 or not 1 <= V <= weight.shape[0]:
            raise CSVError(f"bad LM head shape {tuple(weight.shape)} for vocab size {V}")
        if not scale > 0 or (softcap is not None and not softcap > 0):
            raise CSVError(f"scale and softcap must be positive, got {scale}, {softcap}")
        self.weight = weight[:V]
        self.bias = None if bias is None else bias[:V]
        self.vocab_size, self.hidden_size = V, weight.shape[1]
        self.softcap, self.scale = softcap, scale
        self.dtype = weight.dtype
        self.engine = DenseEngine(self.dtype, softcap, scale)
        self.backend = backend_for(weight.device)
        # NaN/inf in the head or the bias: the dense argmax may pick them; no bound covers them.
        # The dense op on crafted heads (dense_engine.probe_engine; engine_linear(h, w): the
        # engine's own GEMM, vLLM's in the plugin, F.linear by default): an arithmetic outside the
        # bounds' model (partial sums in the model dtype, TF32 inputs) certifies nothing.
        self.engine_probe = probe_engine(engine_linear or F.linear, self.dtype, self.hidden_size, weight.device,
                                         head_rows=engine_rows or (weight.shape[0] if engine_linear else V))
        if not self.engine_probe.fp32_accumulation:
            logger.warning("CSV certifies nothing on this head: the dense engine's arithmetic is %s",
                           self.engine_probe.describe())
        # Subnormal weights or bias: an engine that reads them as zero (DAZ) computes another head.
        self.certifiable = bool(torch.isfinite(self.weight).all()) and self.engine.ok and (
            self.bias is None or bool(torch.isfinite(self.bias).all())) and not bool(
            has_subnormal(self.weight)) and (self.bias is None or not bool(has_subnormal(self.bias)))
        self.screen = make_screen(self.config.screen, self.weight, self.bias, index, two_sided)  # (ball's form)
        # screens that can leave a per-row power-of-two scale to the selection (one [B, V] pass less)
        self.defer_row_scale = bool(getattr(self.screen, "defers_row_scale", False))
        self.errors = ErrorModel.of_head(self.weight, self.bias, getattr(self.screen, "offset_abs", None),
                                         self.config.unit_roundoff)
        self.errors.rad_total(self.screen.radius)  # (computed once, here)
        self.off_switch = OffSwitch() if self.config.off_switch else None
        self.last_certified: torch.Tensor | None = None  # [B] bool (host) of the last sampler_logits step
        self.last_top1: torch.Tensor | None = None  # [B] int64 of the last step (runtime.sampler_logits)
        self._fused = None  # the fused GPU step, built on the first CUDA call (_fused_for)

    @property
    def acc_err(self) -> torch.Tensor:
        """``[V]`` :attr:`ErrorModel.acc_err` (the same tensor)."""
        return self.errors.acc_err

    @property
    def screen_name(self) -> str:
        return self.screen.name

    @property
    def screen_backend(self) -> str | None:
        """What computes the screen, where it has a choice (int8 on x86: ``vnni`` or ``fbgemm``)."""
        return getattr(self.screen, "backend", None)

    @property
    def max_certified_k(self) -> int:
        """The largest ``top_k`` certified in the head; rows planned above it are dense
        (``unsupported``)."""
        return min(self.config.max_topk, self.vocab_size)

    # ---- the dense engine's computation ------------------------------------------------
    def transform(self, z: torch.Tensor) -> torch.Tensor:
        """vLLM's soft-cap and scale, exactly as its ``LogitsProcessor`` applies them."""
        return self.engine.transform(z)

    def dense_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, V]``: the dense head (``F.linear``, then soft-cap and scale)."""
        return self.engine.transform(F.linear(hidden, self.weight, self.bias))

    def output(self, exact: torch.Tensor) -> torch.Tensor:
        """:func:`.certificate.output`: the transform of a selection's ``exact``, ``-inf`` kept."""
        return certificate.output(self.engine, exact)

    def arithmetic_ok(self) -> bool:
        """The dense engine's arithmetic is, now, the one the bounds assume. An fp32 head needs
        torch's float32 matmul in IEEE fp32 (:func:`~vllm_csv.dense_engine.fp32_matmul_is_ieee`:
        the legacy precision ``"highest"``, or the new per-backend ``fp32_precision`` ``"ieee"``):
        at ``"high"`` or ``"medium"`` (vLLM sets it
        from ``VLLM_FLOAT32_MATMUL_PRECISION``) cuBLAS runs fp32 GEMMs in TF32 and oneDNN may use
        bf16 passes, a unit roundoff of ``2^-11`` or worse, and an fp32 row 2^-12 ahead of another
        was certified there (issue 42). Read on every step (a host read of a Python setting), so a
        change after start-up is a change of engine; such steps certify nothing (reason
        ``arithmetic``). bf16 and fp16 GEMMs accumulate in fp32 whatever this setting. And the
        engine's probe (:func:`~vllm_csv.dense_engine.probe_engine`, at start-up) found the
        accumulation the bounds assume."""
        return arithmetic_ok(self.engine_probe, self.dtype, self.weight.device.type)

    # ---- bounds (selector.Bounds) -------------------------------------------------------
    def prepare(self, hidden: torch.Tensor):
        """``(hidden, hnorm, ok)`` ``[B, d], [B], [B]``: :func:`.bounds.prepare` for this head."""
        return bounds.prepare(self.backend, self.errors, hidden, self.certifiable and self.arithmetic_ok())

    def intervals(self, hidden: torch.Tensor, tight: bool = False) -> Intervals:
        """:func:`.bounds.intervals` of ``hidden [B, d]`` (rows prepared there: :meth:`prepare`). ``tight``:
        a screen that picks a looser copy for small batches
        (:class:`~vllm_csv.screens.by_batch.ByBatchScreen`) uses its tight one whatever the batch."""
        screen = getattr(self.screen, "tight", self.screen) if tight else self.screen
        return bounds.intervals(screen, self.errors, self.engine, self.backend, hidden,
                                self.certifiable and self.arithmetic_ok())

    def score(self, hidden: torch.Tensor, ids: torch.Tensor, hnorm: torch.Tensor) -> Scores:
        """:func:`.bounds.score` of columns ``ids [S]`` for ``hidden [B, d]`` (``hnorm`` unused:
        the per-column bound is tighter; kept for the interface)."""
        return bounds.score(self.errors, self.engine, self.backend, self.weight, self.bias, hidden, ids)

    # ---- selection (selector.Selector) --------------------------------------------------
    @property
    def can_exclude(self) -> bool:
        """Whether :meth:`select` takes ``exclude`` (the two-sided threshold search)."""
        return self.screen.two_sided

    def select(self, hidden: torch.Tensor, k: torch.Tensor, need_values: torch.Tensor,
               temp: torch.Tensor | None = None, exclude: torch.Tensor | None = None) -> Selection:
        """Certify ``hidden [B, d]`` for ``k [B]`` (:mod:`.selection`): the fused GPU step where it
        applies, else the two-sided threshold, else (the one-sided ball) the growing set.
        ``exclude [n]``: tokens left out (:attr:`can_exclude`; the two-sided search, unfused)."""
        if exclude is not None:
            if not self.can_exclude:
                raise CSVError(f"screen {self.screen_name} cannot leave tokens out of the certificate")
            return selection.select_two_sided(self, hidden, k, need_values, temp, exclude)
        fused = self._fused_for(hidden, k, temp)
        if fused is not None:
            return selection.select_fused(fused, hidden, k, need_values)
        if self.screen.two_sided:
            return selection.select_two_sided(self, hidden, k, need_values, temp)
        return selection.select_one_sided(self, hidden, k, need_values, temp)

    def _fused_for(self, hidden: torch.Tensor, k: torch.Tensor, temp: torch.Tensor | None):
        """The fused GPU step (:meth:`fused_step`) for the rows it certifies
        (:meth:`~vllm_csv.gpu.step.FusedStep.supports`), else None: no fused step, sampled rows
        with a temperature, ``k`` above 64."""
        if not hidden.shape[0]:
            return None
        fused = self.fused_step()
        return fused if fused is not None and fused.supports(int(k.max()), temp) else None

    def fused_step(self):
        """The fused GPU step (:class:`vllm_csv.gpu.step.FusedStep`, built once, on the first call),
        or None: not the CUDA backend (bound when the head was built), ``gpu_fused`` off, no
        Triton, a screen other than the exact int8 copy (the one ``auto`` and ``int8`` give on
        CUDA). Why it is not built is logged once."""
        if not (self.backend.fused_gpu and self.config.gpu_fused):
            return None
        if self._fused is None:
            from ..screens.quantized import QuantizedScreen

            self._fused = False
            if not (isinstance(self.screen, QuantizedScreen) and self.screen.int_gemm):  # (what was asked for)
                logger.info("CSV fused GPU step off: screen %s", self.screen_name)
            else:
                try:
                    from ..gpu.step import FusedStep

                    self._fused = FusedStep(self)
                except (ImportError, CSVError) as e:
                    logger.info("CSV fused GPU step off: %s", e)
        return self._fused or None

    # ---- public API ---------------------------------------------------------------------
    def topk(self, hidden: torch.Tensor, k: int, values: bool = True) -> TopKResult:
        """Certified top-``k`` ids and values per row; uncertified rows are computed densely.

        Parameters
        ----------
        hidden : torch.Tensor
            ``[B, d]`` hidden states, model dtype.
        k : int
            ``1 <= k <= V``.
        values : bool
            Certify the values too: on certified rows ``ids`` (in order) and ``values`` are the
            dense head's. With ``False`` only the *set* of ``ids`` is certified (for ``k = 1``:
            the argmax, greedy); values are then within the dense values' rounding interval,
            and the order within the set follows them.
        """
        B = hidden.shape[0]
        if not 1 <= k <= self.vocab_size:
            raise CSVError(f"k must be in [1, {self.vocab_size}], got {k}")
        dev = hidden.device
        if B == 0:  # (no row: the dense head's empty answer, as F.linear gives it)
            vals, ids = certificate.stable_topk(self.dense_logits(hidden), k)
            none = torch.zeros(0, dtype=torch.bool, device=dev)
            return TopKResult(ids, vals, none, none, torch.zeros(0, dtype=torch.long, device=dev))
        sel = self.select(hidden, torch.full((B,), k, device=dev), torch.full((B,), values, device=dev))
        logits = self.output(sel.exact)
        fb = ~sel.certified
        if fb.any():
            logits[fb] = self.dense_logits(hidden)[fb]  # the whole batch: the engine's own rounding
        vals, ids = certificate.stable_topk(logits, k)
        scored = torch.where(fb, self.vocab_size, sel.scored)
        return TopKResult(ids, vals, sel.certified, fb, scored)

    def sampler_logits(self, hidden: torch.Tensor, topk: torch.Tensor,
                       dense_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       t0: float | None = None, temperature: torch.Tensor | None = None,
                       use_switch: bool = False, exclude: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, StepStats]:
        """Logits for a sampler (:func:`.runtime.sampler_logits`).

        Parameters
        ----------
        hidden : torch.Tensor
            ``[B, d]`` hidden states, model dtype.
        topk : torch.Tensor
            ``[B]`` int64 (host): ``0`` = dense row; ``k >= 1`` = certify the top-``k`` (greedy
            and ``top_k = 1`` read only the argmax; ``k >= 2`` reads the values, which are
            then certified bit for bit). ``k > min(max_topk, V)`` is dense (``unsupported``).
        dense_fn : callable, optional
            Computes the dense logits of the whole batch (default :meth:`dense_logits`), so
            callers keep their engine's own code path; called at most once.
        t0 : float, optional
            :func:`vllm_csv.clock.now` at the start of the caller's step: ``StepStats.seconds``
            counts from there (default: now).
        temperature : torch.Tensor, optional
            ``[B]`` fp32 (host): the temperature of each *sampled* row (its logits are divided
            by it before the top-k mask and the draw), ``0`` for greedy rows (argmax).
            Default: every row greedy. A sampler that draws from top-k rows must pass it: ties
            made by the division, and exact ties at the k-th value, are kept by the sampler.
        use_switch : bool
            Ignored (accepted for callers of the old signature): the head never runs the
            off-switch; the plugin's step asks it for the whole step (issue 43).
        exclude : torch.Tensor, optional
            ``[n]`` int64 on the head's device: tokens left out of every row's certificate
            (:attr:`can_exclude`), which a model sets to ``-inf`` after the head: a certified
            row holds the top-``k`` of the others, each proven above every other token but
            those, and ``-inf`` on them.

        Returns
        -------
        (logits [B, V] model dtype, StepStats): certified rows hold the dense values on their
        top-k and ``-inf`` elsewhere; every other row holds ``dense_fn(hidden)``'s row.
        """
        return runtime.sampler_logits(self, hidden, topk, dense_fn or self.dense_logits, t0, temperature, exclude)


def arithmetic_ok(probe, dtype: torch.dtype, device_type: str = "cpu") -> bool:
    """:meth:`CertifiedHead.arithmetic_ok` of an engine ``probe``, model ``dtype`` and the head's
    ``device_type`` (the sharded head's ranks agree on ``probe``)."""
    return probe.fp32_accumulation and (dtype != torch.float32 or fp32_matmul_is_ieee(device_type))
