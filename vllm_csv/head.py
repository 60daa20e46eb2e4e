"""The certified LM head: exact logits on a certified sub-vocabulary, dense otherwise.

Notation (SPEC.md): head ``W [V, d]``, bias ``b``, hidden ``h``; the dense engine
computes ``zt_i = fl(<w_i, h> + b_i)`` (fp32 accumulation, output rounded to the
model dtype) and then the monotone map ``f(z) = scale * softcap * tanh(z / softcap)``.

Dense-value interval. A screen gives ``lo_i <= <w_i,h> + b_i <= hi_i`` (real
arithmetic). The dense GEMM adds at most ``e_i = gamma_d ||w_i|| ||h||`` and two
roundings (bias add, output), so ``zt_i`` lies in
``[lo_i - e_i - 2 ulp, hi_i + e_i + 2 ulp]``. A token of the scored set ``S`` is scored in
fp32 and pushed through the engine's rounding (:meth:`CertifiedHead._score`), which bounds
``zt_j`` from both sides, usually to a single bf16/fp16 value.

Top-k certificate. With ``T`` the ``k`` tokens of ``S`` with the largest scored values,
``L`` the smallest dense lower bound in ``T``, ``U`` the largest dense upper bound in
``S \\ T`` and ``M = max_{i not in S} hi_i``: ``L > max(U, M)`` proves that ``T`` is the
dense top-k, whatever order the dense GEMM accumulates in; ``f`` is monotone, and the
separation is also checked after it (it can create ties). ``S`` grows until the
certificate holds or the budget is spent; then the row takes the dense path.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .cpu_malloc import tune_malloc
from .errors import CSVError
from .fp import FP32_UNIT_ROUNDOFF, gamma, significand_bits, ulp
from .off_switch import OffSwitch
from .screens import DEFAULT_SCREEN, SCREENS, hidden_norm_upper, make_screen

FALLBACK_REASONS = ("uncertified", "budget", "unsupported", "nonfinite", "off_switch")


@dataclass
class HeadConfig:
    screen: str = DEFAULT_SCREEN
    budget: float = 0.05  # max share of the vocabulary scored exactly per row before the dense path
    epsilon: float | None = None  # epsilon-softmax mode (opt-in); None = exact only
    max_topk: int = 64
    unit_roundoff: float = FP32_UNIT_ROUNDOFF  # accumulation precision assumed of the dense GEMM
    off_switch: bool = True

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
    ids: torch.Tensor  # [B, k] int64, descending by value
    values: torch.Tensor  # [B, k] transformed logits (model dtype)
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
    """Result of certification for a batch: exact values on the scored columns."""

    exact: torch.Tensor  # [B, V] model dtype, pre-transform, -inf where not scored
    scored: torch.Tensor  # [B] int64
    certified: torch.Tensor  # [B] bool
    reason: list[str | None]  # per row: None if certified, else a fallback reason


class CertifiedHead:
    """Batched certified top-k over ``W [V, d]`` (rows beyond ``vocab_size`` are padding)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 vocab_size: int | None = None, config: HeadConfig | None = None, index=None,
                 softcap: float | None = None, scale: float = 1.0):
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
        g = gamma(self.hidden_size + 2, self.config.unit_roundoff)
        self.acc_err = (g * self.weight.double().norm(dim=1)).float() * (1 + 4 * FP32_UNIT_ROUNDOFF)
        self.screen = make_screen(self.config.screen, self.weight, self.bias, index)
        self._delta = 2.0 ** (2 - significand_bits(self.dtype)) + 8 * FP32_UNIT_ROUNDOFF
        self._tiny = 2 * torch.finfo(self.dtype).tiny
        self._tiny32 = 2 * torch.finfo(torch.float32).tiny
        self._gamma = g
        self._rad_cache = None
        self._wmax = float(self.weight.float().norm(dim=1).max()) if V else 0.0
        self._rad_total(self.screen.radius)
        self.off_switch = OffSwitch() if self.config.off_switch else None

    # ---- the dense engine's computation, on all or some rows -----------------------------
    def transform(self, z: torch.Tensor) -> torch.Tensor:
        """``f(z)`` exactly as vLLM's LogitsProcessor applies it; ``-inf`` stays ``-inf``."""
        out = z
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        if self.scale != 1.0:
            out = out * self.scale
        return out.masked_fill(z == -math.inf, -math.inf) if self.softcap is not None else out

    def dense_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.transform(F.linear(hidden, self.weight, self.bias))

    # ---- certification ----------------------------------------------------------------
    def _intervals(self, hidden: torch.Tensor):
        """``lo, hi [B, V]`` around the dense engine's pre-transform logit (``lo`` is None for
        one-sided screens), ``||h||`` rounded up, and which rows are finite (certifiable).

        Half-width ``m = rad_total ||h|| + delta max|y| + tiny`` with
        ``rad_total = (r + e/||h||)(1 + delta)`` covers the screen radius, the dense GEMM's
        accumulation error and two output-dtype ulps of ``|lo|, |hi| <= max|y| + rad ||h||``
        (``delta = 2^(2-p) + 8u``). A row is finite when ``h``, ``||h||``, ``y`` and the
        largest ``|y| + m`` are: then every bound of the row is finite."""
        hnorm = hidden_norm_upper(hidden)
        out = self.screen.center_radius(hidden)
        y, rad = out.y, self._rad_total(out.radius)
        delta = self._delta + out.rel
        ymax = torch.linalg.vector_norm(y, ord=math.inf, dim=1)  # NaN/inf propagate
        c = ymax * delta + self._tiny
        finite = torch.isfinite(hidden).all(1) & torch.isfinite(ymax + c + self._rad_max * hnorm)
        m = torch.addcmul(c[:, None], rad[None], hnorm[:, None])
        if out.n is not None:
            m.addcmul_(out.n[None] * (1 + delta), out.e[:, None])
        hi = y + m
        lo = y.sub_(m) if out.two_sided else None
        return lo, hi, hnorm, finite

    def _rad_total(self, r: torch.Tensor) -> torch.Tensor:
        if self._rad_cache is None or self._rad_cache[0] is not r:
            total = (r + self.acc_err) * (1 + self._delta)
            self._rad_cache = (r, total)
            self._rad_max = float(total.max())
        return self._rad_cache[1]

    def _score(self, hidden: torch.Tensor, ids: torch.Tensor, hnorm: torch.Tensor):
        """Score columns ``ids``: ``(z, lower, upper)``, ``z`` in the model dtype (what the
        sampler gets) and ``lower <= zt <= upper`` for the dense engine's value ``zt``.

        ``a = fl32(<w_j, h>)`` is within ``e_j`` of the real product in any fp32 accumulation
        order, so the dense accumulator lies in ``[a - 2e, a + 2e]`` (with the bias inside
        the accumulation: ``[a + b - R, a + b + R]``, ``R`` adding ``gamma |b|`` and this very
        rounding). The engine rounds that to the model dtype, adding the bias before or after
        the rounding; each way is monotone in the accumulator, so ``zt`` lies between the two
        ways applied to the two ends. In bf16/fp16 both ends nearly always round to the same
        value: ``zt`` is then known exactly, and ``z`` is that value."""
        a = F.linear(hidden.float(), self.weight[ids].float())
        r = 2 * self.acc_err[ids][None] * hnorm[:, None]
        r = r + a.abs() * (2 * FP32_UNIT_ROUNDOFF) + self._tiny32
        if self.bias is None:
            c = a
            lower, upper = self._round(a - r), self._round(a + r)
        else:
            b = self.bias[ids]
            c = a + b.float()
            R = r + self._gamma * b.float().abs()[None] + c.abs() * (2 * FP32_UNIT_ROUNDOFF)
            lower = torch.minimum(self._round(c - R), self._round(self._round(a - r, float_out=False) + b))
            upper = torch.maximum(self._round(c + R), self._round(self._round(a + r, float_out=False) + b))
        z = torch.where(lower == upper, lower, c).to(self.dtype)
        return z, lower, upper

    def _round(self, x: torch.Tensor, float_out: bool = True) -> torch.Tensor:
        """Round to the model dtype (to nearest: monotone); back to fp32 unless ``float_out=False``."""
        y = x.to(self.dtype)
        return y.float() if float_out else y

    def _topk_split(self, z: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor, k: torch.Tensor):
        """Per row, with ``T`` the ``k`` columns of largest computed value ``z``: the smallest
        dense lower bound in ``T`` and the largest dense upper bound in ``S \\ T``. When the first
        is above the second (and above every bound outside ``S``), ``T`` is the dense top-k
        whatever order the dense GEMM accumulates in: no near-tie inside ``S`` can flip it."""
        kmax = int(k.max())
        top = z.float().topk(kmax, dim=1).indices
        in_top = torch.zeros(z.shape, dtype=torch.bool, device=z.device).scatter_(
            1, top, torch.arange(kmax, device=z.device)[None] < k[:, None])
        return lower.masked_fill(~in_top, math.inf).amin(1), upper.masked_fill(in_top, -math.inf).amax(1)

    def _select(self, hidden: torch.Tensor, k: torch.Tensor) -> _Selection:
        """Certify each row; rows with NaN/inf hidden states (or bounds that overflow fp32)
        are left uncertified with reason ``nonfinite`` and take the dense path."""
        ok = torch.isfinite(hidden).all(1) & torch.isfinite(hidden_norm_upper(hidden))
        if self.screen.two_sided and bool(ok.any()):
            # ||h|| rad_max + |y| must stay finite: y <= ||deq|| ||h||, so bound with rad and wmax
            ok &= (hidden_norm_upper(hidden) * (self._wmax + self._rad_max)) < 1e37
        if bool(ok.all()):
            return (self._select_two_sided if self.screen.two_sided else self._select_one_sided)(hidden, k)
        B, V = hidden.shape[0], self.vocab_size
        sel = _Selection(torch.full((B, V), -math.inf, dtype=self.dtype, device=hidden.device),
                         torch.zeros(B, dtype=torch.long, device=hidden.device),
                         torch.zeros(B, dtype=torch.bool, device=hidden.device), ["nonfinite"] * B)
        if bool(ok.any()):
            sub = self._select(hidden[ok], k[ok])
            sel.exact[ok], sel.scored[ok], sel.certified[ok] = sub.exact, sub.scored, sub.certified
            for i, r in zip(ok.nonzero().squeeze(1).tolist(), sub.reason):
                sel.reason[i] = r
        return sel

    def _select_two_sided(self, hidden: torch.Tensor, k: torch.Tensor) -> _Selection:
        """Certify with a threshold on the screen values: three cheap passes over ``[B, V]``.

        Token ``j`` has half-width ``m_j = rad_j ||h|| + delta |y_j| + tiny`` (see
        :meth:`_intervals`; ``delta`` includes the screen's relative error ``rel``). With
        ``y_(k)`` a row's k-th largest screen value and
        ``g(y) = y + delta |y|`` (increasing), the k tokens with the largest ``y`` have
        ``lo >= tau := y_(k) - delta |y_(k)| - rad_max ||h|| - tiny``, a lower bound on the
        k-th largest dense logit. A token with ``g(y_i) < s := tau - rad_max ||h|| - tiny`` has
        ``hi_i < tau``; so ``S`` = the union over rows of ``{i : y_i >= thr = g^-1(s)}`` contains
        every row's dense top-k, every token outside ``S`` has ``hi < tau``, and the row is
        certified when its top-k in ``S`` is separated from ``tau`` and from the rest of ``S``
        (:meth:`_topk_split`)."""
        B, V = hidden.shape[0], self.vocab_size
        dev = hidden.device
        hnorm = hidden_norm_upper(hidden)
        out = self.screen.center_radius(hidden)
        y, rad = out.y, self._rad_total(out.radius)
        delta = self._delta + out.rel
        act = (out.n.max() * (1 + delta) * out.e) if out.n is not None else 0.0
        kmax = int(k.max())
        rows = torch.arange(B, device=dev)
        yk = y.amax(1) if kmax == 1 else y.topk(kmax, dim=1).values[rows, k - 1]
        spread = self._rad_max * hnorm + act + self._tiny
        tau = yk - delta * yk.abs() - spread
        s = tau - spread
        thr = torch.where(s >= 0, s / (1 + delta), s / (1 - delta))
        thr = thr - thr.abs() * (8 * FP32_UNIT_ROUNDOFF) - self._tiny  # rounding of this very line
        budget = max(kmax, math.ceil(self.config.budget * V))
        live = torch.ones(B, dtype=torch.bool, device=dev)
        y = y.sub_(thr[:, None])  # y - thr >= 0 marks a candidate
        ids = (y.amax(0) >= 0).nonzero().squeeze(1)
        if ids.numel() > budget:  # some rows have too many candidates: they go dense
            live = (y >= 0).sum(1) <= budget
            ids = (y[live].amax(0) >= 0).nonzero().squeeze(1) if bool(live.any()) else ids[:0]
        exact = torch.full((B, V), -math.inf, dtype=self.dtype, device=dev)
        certified = torch.zeros(B, dtype=torch.bool, device=dev)
        if ids.numel() >= kmax:
            z, lower, upper = self._score(hidden, ids, hnorm)
            exact[:, ids] = z
            low, high = self._topk_split(z, lower, upper, k)
            certified = live & self._separated(low, torch.maximum(high, tau))
        reason = [None if c else ("budget" if not lv else "uncertified")
                  for c, lv in zip(certified.tolist(), live.tolist())]
        return _Selection(exact, torch.full((B,), ids.numel(), device=dev), certified, reason)

    def _select_one_sided(self, hidden: torch.Tensor, k: torch.Tensor) -> _Selection:
        """Grow ``S`` per row until the top-k certificate holds or ``budget`` is reached.

        First ``S`` of a row: every token with ``hi >= tau``, ``tau`` the k-th largest ``lo``
        (this already certifies: outside ``hi < tau <=`` k-th lower bound in ``S``). Screens
        without a lower bound, and rows whose first ``S`` exceeds the budget, take the
        ``m`` highest ``hi`` instead, ``m`` doubling each round. All rows of a batch share
        the scored columns (the union), so each round is one GEMM over new rows of ``W``."""
        B, V = hidden.shape[0], self.vocab_size
        dev = hidden.device
        lo, hi, hnorm, finite = self._intervals(hidden)
        kmax = int(k.max())
        budget = max(kmax, math.ceil(self.config.budget * V))
        m = torch.zeros(B, dtype=torch.long, device=dev)
        if lo is not None:
            tau = (lo.amax(1, keepdim=True) if kmax == 1
                   else lo.topk(kmax, dim=1).values.gather(1, (k - 1)[:, None]))
            mask = hi >= tau
            m = mask.sum(1)
        by_mask = finite & (m > 0) & (m <= budget)
        m = torch.where(by_mask, m, torch.clamp(k * 8, max=budget))
        exact = torch.full((B, V), -math.inf, dtype=self.dtype, device=dev)
        done = torch.zeros(V, dtype=torch.bool, device=dev)
        zs, lower, upper = (torch.empty((B, 0), device=dev) for _ in range(3))  # on the scored columns
        certified = torch.zeros(B, dtype=torch.bool, device=dev)
        active = finite.clone()
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
                exact[:, new] = z
                zs, lower, upper = (torch.cat([a, b], 1) for a, b in ((zs, z.float()), (lower, lo_new), (upper, up_new)))
                done[new] = True
                hi.index_fill_(1, new, -math.inf)
            low, high = self._topk_split(zs, lower, upper, k)
            certified |= active & self._separated(low, torch.maximum(high, hi.amax(1)))
            active &= ~certified & (m < budget) & ~done.all()
            m = torch.where(active, torch.clamp(m * 2, max=budget), m)
            first = False
        reason = [None if c else ("nonfinite" if not f else "budget") for c, f in
                  zip(certified.tolist(), finite.tolist())]
        scored = torch.full((B,), int(done.sum()), device=dev)
        return _Selection(exact, scored, certified, reason)

    def _separated(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """``low > high`` before *and* after ``f`` (soft-cap saturates: distinct logits can
        map to the same value, a tie the dense argmax breaks by index), with two output
        ulps each side for the engine's own rounding of ``f``."""
        ok = low > high
        if self.softcap is not None or self.scale != 1.0:
            fl, fh = self.transform(low), self.transform(high)
            ok &= fl - 2 * ulp(fl, self.dtype) > fh + 2 * ulp(fh, self.dtype)
        return ok

    # ---- public API ---------------------------------------------------------------------
    def topk(self, hidden: torch.Tensor, k: int) -> TopKResult:
        """Certified top-``k`` ids and values per row; uncertified rows are computed densely."""
        B = hidden.shape[0]
        if not 1 <= k <= self.vocab_size:
            raise CSVError(f"k must be in [1, {self.vocab_size}], got {k}")
        sel = self._select(hidden, torch.full((B,), k, device=hidden.device))
        logits = self.transform(sel.exact)
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
        fhi = self.transform(hi).float() / temperature
        order = fhi.topk(max(1, math.ceil(self.config.budget * V)), dim=1).indices
        # first guess: tokens within log(eps / V) of the best lower bound
        if lo is None:
            m = torch.full((B,), min(8, order.shape[1]), device=hidden.device)
        else:
            flo_max = (self.transform(lo.amax(1, keepdim=True)).float() / temperature)
            m = (fhi >= flo_max + math.log(eps / V)).sum(1).clamp(1, order.shape[1])
        logits = torch.full((B, V), -math.inf, dtype=self.dtype, device=hidden.device)
        tv = torch.ones(B, device=hidden.device)
        cert = torch.zeros(B, dtype=torch.bool, device=hidden.device)
        while True:
            mm = int(m.max())
            mask = torch.zeros((B, V), dtype=torch.bool, device=hidden.device)
            mask.scatter_(1, order[:, :mm], torch.arange(mm, device=hidden.device)[None] < m[:, None])
            ids = mask.any(0).nonzero().squeeze(1)
            z, zl, _ = self._score(hidden, ids, hnorm)
            if lo is not None:
                zl = torch.maximum(zl, lo[:, ids])
            logits[:, ids] = z
            done = torch.zeros(V, dtype=torch.bool, device=hidden.device)
            done[ids] = True
            log_zs = torch.logsumexp(self.transform(zl) / temperature, 1)
            log_u = torch.logsumexp(fhi.masked_fill(done[None], -math.inf), 1)
            tv = torch.sigmoid(log_u - log_zs)  # U / (Z_S + U)
            cert = finite & (tv <= eps)
            grow = finite & ~cert & (m < order.shape[1])
            if not bool(grow.any()):
                break
            m = torch.where(grow, torch.clamp(m * 2, max=order.shape[1]), m)
        out = self.transform(logits)
        if (~cert).any():
            out[~cert] = self.dense_logits(hidden)[~cert]
            tv = torch.where(cert, tv, torch.zeros_like(tv))
        probs = torch.softmax(out.float() / temperature, dim=1)
        return EpsResult(probs, cert, tv)

    def sampler_logits(self, hidden: torch.Tensor, topk: torch.Tensor,
                       dense_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, StepStats]:
        """Logits for a sampler: rows with ``topk[b] = 0`` are dense; rows with ``k > 0`` hold
        exact values on a scored set that contains the certified top-k and ``-inf`` elsewhere,
        or dense values if they could not be certified (dense values are those of the dense
        head on the whole batch). ``dense_fn`` computes dense rows
        (default :meth:`dense_logits`), so callers can keep their engine's own code path."""
        t0 = time.perf_counter()
        dense_fn = dense_fn or self.dense_logits
        B, dev = hidden.shape[0], hidden.device
        topk = topk.cpu().long()  # per-row plans are decided on the host: no device sync
        stats = StepStats(rows=B, screen=self.screen.name)
        want = topk > 0
        stats.csv_rows = int(want.sum())
        unsupported = topk > self.config.max_topk
        want &= ~unsupported
        stats.fallbacks["unsupported"] = int(unsupported.sum())
        sw = self.off_switch
        tried = bool(want.any())
        if tried and sw is not None and not sw.allow(B, lambda: _time(lambda: dense_fn(hidden), hidden)):
            stats.fallbacks["off_switch"] = int(want.sum())
            want[:], tried = False, False
        dense_rows = ~want
        if tried:
            rows = want.nonzero().squeeze(1)
            sel = self._select(hidden[rows.to(dev)], topk[rows].to(dev))
            certified = sel.certified.cpu()
            if bool(want.all()):
                out = self.transform(sel.exact)
            else:
                out = torch.empty((B, self.vocab_size), dtype=self.dtype, device=dev)
                out[rows.to(dev)] = self.transform(sel.exact)
            stats.certified = int(certified.sum())
            for r in sel.reason:
                if r is not None:
                    stats.fallbacks[r] += 1
            stats.scored = sel.scored[sel.certified].tolist()
            dense_rows[rows[~certified]] = True
        else:
            out = torch.empty((B, self.vocab_size), dtype=self.dtype, device=dev)
        if bool(dense_rows.any()):
            idx = dense_rows.nonzero().squeeze(1).to(dev)
            # Dense rows come from the dense head run on the *whole* batch: bit for bit what the
            # engine computes without CSV (GEMM rounding depends on the batch shape), and no
            # dearer than on a few rows, since reading W dominates a skinny GEMM.
            out[idx] = dense_fn(hidden)[idx].to(self.dtype)
        if hidden.is_cuda:
            torch.cuda.synchronize(dev)
        stats.seconds = time.perf_counter() - t0
        if tried and sw is not None:
            sw.observe(B, stats.seconds)
        return out, stats


def _stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, ties broken by the lowest index (as ``argmax``)."""
    vals, ids = torch.sort(x, dim=1, descending=True, stable=True)
    return vals[:, :k], ids[:, :k]


def _time(fn, like: torch.Tensor) -> float:
    if like.is_cuda:
        torch.cuda.synchronize(like.device)
    t0 = time.perf_counter()
    fn()
    if like.is_cuda:
        torch.cuda.synchronize(like.device)
    return time.perf_counter() - t0
