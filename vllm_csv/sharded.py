"""Tensor parallelism: the certified head over a vocabulary-sharded LM head.

vLLM shards the head by vocabulary (``VocabParallelEmbedding``): the vocabulary is padded
to a multiple of 64 and split evenly, rank ``r`` holds the contiguous rows
``r P ... (r + 1) P`` and the padding rows (global ids ``>= V``, zero-filled) sit at the end
of the last shards; the dense path all-gathers the ``[B, P]`` shard logits, slices off the
padding and applies soft-cap and scale on ``[B, V]``. Every rank then samples from the same
full logits, so a certified path must give *every rank the same* ``[B, V]``.

Pipeline of a step (:meth:`ShardedHead.sampler_logits`), per rank on its shard's real rows
(padding excluded), with the single-rank head's pieces (:class:`~vllm_csv.head.CertifiedHead`
over the shard):

1. screen ``y`` of the shard; per row the lower bounds ``lb_j = y_(j) - delta |y_(j)| - spread_r``
   of the ``k`` largest block maxima (``k`` distinct tokens), whether the row may be certified
   here (finite inputs, no overflow) -- **collective 1**: all-gather ``[B, k + 1]`` per rank
   (plus the off-switch's last step time). ``tau`` = the ``k``-th largest ``lb`` over all
   ranks: at least ``k`` distinct tokens have a dense value ``>= tau``.
2. candidates of the shard: ``y_i >= g^-1(tau - spread_r)`` (every other token of the shard
   has ``hi < tau``, see :func:`vllm_csv.head.selection.select_two_sided`), scored exactly
   (:meth:`CertifiedHead.score`); the shard's ``k`` best scored tokens
   ``(global id, z, lower, upper)``, the largest ``upper`` of its other scored tokens, its
   candidate count and whether it stayed within the budget -- **collective 2**: all-gather
   ``[B, 4 k + 3]`` per rank.
3. every rank decides from the same gathered numbers, with the single-rank certificate
   (:func:`vllm_csv.head.certificate.certify`): ``T`` = the ``k`` gathered tokens of largest ``z``,
   ``L`` = their smallest lower bound, ``U`` = the largest upper bound of the other gathered
   tokens, of every rank's other scored tokens and ``tau`` (every unscored token). ``L``
   beats ``U`` through the engine's arithmetic: ``T`` is the dense top-k. A row is certified
   only if every rank could certify it and the total candidate count is within the budget.
   Certified rows hold the dense values on ``T`` and ``-inf`` elsewhere; every other row
   comes from vLLM's own dense path (``dense_fn``: its all-gather), run by all ranks.

The decision is a function of the gathered tensors only, computed by the same ops on every
rank: the ranks cannot split. Each rank bounds its own shard with its own hidden state, so
the certificate also holds if the ranks' hidden states differ in the last bits.
Communication: ``O(B k tp)`` numbers in two all-gathers per step. The off-switch's ledger
is the same on every rank (:class:`SharedOffSwitch`). Screen ``ball`` runs on an index per
shard (built over the shard's real rows and fingerprinted on them), in its two-sided form
(:mod:`vllm_csv.screens.ball`). Rows certified in the sampler (temperature, top-p, min-p,
penalties, ...) go through :mod:`vllm_csv.sampling.sharded_rows` (one more all-gather a round).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from .dense_engine import DenseEngine, EngineProbe
from .errors import CSVError
from .fp import FP32_UNIT_ROUNDOFF
from .head import CertifiedHead, HeadConfig, StepStats, certificate, runtime
from .head.backend import backend_for
from .head.certified import arithmetic_ok
from .head.types import Selection
from .off_switch import OffSwitch
from .ops.select import block_cols as _block_cols, block_max as _block_max

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


class Collective(Protocol):
    """The tensor-parallel group, as the sharded head uses it."""

    rank: int
    size: int

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[size, *x.shape]``: every rank's ``x``, in rank order, the same on every rank."""


class VllmTPGroup:
    """vLLM's tensor-parallel group (``get_tp_group()``: gloo/shm on CPU, NCCL on CUDA)."""

    def __init__(self):
        from vllm.distributed import get_tp_group

        self._group = get_tp_group()
        self.rank, self.size = self._group.rank_in_group, self._group.world_size

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self._group.all_gather(x.contiguous()[None], dim=0)


class TorchGroup:
    """A ``torch.distributed`` process group (tests, and launchers other than vLLM)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist, self._group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(x) for _ in range(self.size)]
        self._dist.all_gather(out, x.contiguous(), group=self._group)
        return torch.stack(out)


@dataclass(frozen=True)
class Shard:
    """Rows ``start ... start + rows`` of the padded head on this rank; global ids ``>= vocab_size``
    are padding."""

    rank: int
    size: int
    start: int
    rows: int
    vocab_size: int

    @property
    def real(self) -> int:
        """Real (non-padding) rows of this shard: its first ``real`` rows."""
        return max(0, min(self.rows, self.vocab_size - self.start))

    @property
    def real_rows(self) -> slice:
        """The shard's real rows as global vocabulary ids (``start ... start + real``)."""
        return slice(self.start, self.start + self.real)

    @classmethod
    def vllm_layout(cls, vocab_size: int, rank: int, size: int, pad_to: int = VOCAB_PADDING) -> Shard:
        """vLLM's layout (``VocabParallelEmbedding._get_indices``, no added vocabulary)."""
        padded = (vocab_size + pad_to - 1) // pad_to * pad_to
        if padded % size:
            raise CSVError(f"padded vocabulary {padded} does not split over {size} ranks")
        rows = padded // size
        return cls(rank, size, rank * rows, rows, vocab_size)

    @classmethod
    def of_lm_head(cls, lm_head, vocab_size: int) -> Shard:
        """The shard of a vLLM ``ParallelLMHead``."""
        if getattr(lm_head, "num_added_embeddings", 0):
            raise CSVError("CSV-Decode with tensor parallelism does not support an added (LoRA) vocabulary")
        si = lm_head.shard_indices
        rows = si.padded_org_vocab_end_index - si.padded_org_vocab_start_index
        return cls(lm_head.tp_rank, lm_head.tp_size, si.padded_org_vocab_start_index, rows, vocab_size)


class SharedOffSwitch:
    """The off-switch (:class:`~vllm_csv.off_switch.OffSwitch`) with the same ledger on every rank.

    Its inputs are made common: a batch size's dense time is measured by all ranks together (the
    dense path is collective anyway), the slowest rank's kept; a CSV step's time enters the
    ledger at the next CSV step, from collective 1 (the slowest rank's). :meth:`allow` then reads
    only common numbers. The single-rank switch's bound holds with one more step of lag: CSV
    costs at most ``tolerance`` more head time, up to two steps, plus each kind's warm-up steps.
    Dense steps are not sampled in place (each rank's time would need one more collective on a
    dense step): the dense estimate stays the stand-alone one, and the switch makes no probes.
    """

    samples_in_place = False  # (the class docstring): the plugin keys every step by its batch size

    def __init__(self, comm: Collective, tolerance: float = 0.02, device: torch.device | str = "cpu"):
        self.comm, self.explains = comm, comm.rank == 0  # (one common ledger: rank 0 logs its trips)
        self.device = torch.device(device)  # the head's: vLLM's NCCL group gathers tensors on its GPU only
        self.switch = OffSwitch(tolerance, probe_every=0)
        self._pending: tuple[int, float, str] | None = None  # (batch, seconds, kind) of the last CSV step
        self._kind = ""

    dense_seconds = property(lambda self: self.switch.dense_seconds)  # (the common ledger's, as OffSwitch's)
    times_tripped = property(lambda self: self.switch.times_tripped)

    def explain(self, kind: str = "") -> str:  # (OffSwitch.explain of the common ledger)
        return self.switch.explain(kind)

    def allow(self, batch: int, measure_dense: Callable[[], float], kind: str = "") -> bool:
        sw, self._kind = self.switch, kind
        if batch not in sw.dense_seconds:
            # one measurement: the plugin's dense function is computed at most once a step (a
            # second call returns the step's memo in microseconds, and min() would keep that)
            t = torch.tensor([measure_dense()], dtype=torch.float32, device=self.device)  # shm all-gather: no fp64
            # (the host read: one-off per batch size)
            sw.dense_seconds[batch] = float(self.comm.all_gather(t).max())
        return sw.allow(batch, lambda: sw.dense_seconds[batch], kind)

    def pending_tensor(self) -> torch.Tensor:
        """``[1]`` float32: this rank's time of the last CSV step not yet in the ledger (``-1``:
        none; a step with rows certified in the sampler counts that work too). Rides on a
        collective of the next CSV step (the head's first, or the sampler's first)."""
        return torch.tensor([-1.0 if self._pending is None else self._pending[1]])

    def fold(self, gathered: torch.Tensor) -> None:
        """Account the pending step with the slowest rank's time (``gathered [size, 1]``, every
        rank's :meth:`pending_tensor`). Whether a step is pending is the same on every rank
        (the decisions that lead to it are)."""
        if self._pending is not None:
            self.switch.observe(self._pending[0], float(gathered[:, 0].max()), self._pending[2])
            self._pending = None

    def observe(self, batch: int, seconds: float) -> None:
        self._pending = (batch, seconds, self._kind)

    def observe_outside(self, batch: int, csv: bool, seconds: float) -> None:
        """Not kept under tensor parallelism: the ranks' times outside the head are not gathered,
        and a rank's own would split the ranks' ledgers (:mod:`vllm_csv.off_switch`, "Around the
        head")."""

    def observe_dense(self, batch: int, seconds: float, kind: str | None = None) -> None:
        """Not sampled under tensor parallelism (see the class docstring)."""

    def refusals_ahead(self, batch: int, kind: str = "") -> int:
        """:meth:`OffSwitch.refusals_ahead`: a function of the common ledger, the same on every rank."""
        return self.switch.refusals_ahead(batch, kind)

    def skip(self, batch: int, kind: str, steps: int) -> None:
        self.switch.skip(batch, kind, steps)


class ShardedHead:
    """The certified head of one rank of a vocabulary-sharded LM head.

    Parameters
    ----------
    weight : torch.Tensor
        ``[P, d]`` this rank's shard (padding rows included; they are never read).
    bias : torch.Tensor, optional
        ``[P]`` the shard's bias.
    shard : Shard
        Where the shard sits in the global vocabulary.
    comm : Collective
        The tensor-parallel group; every rank must call :meth:`sampler_logits` in the same
        steps with the same ``topk`` plan (vLLM's ranks run the same schedule).
    config, softcap, scale
        As :class:`~vllm_csv.head.CertifiedHead`; ``budget`` is a share of the *global*
        vocabulary.
    index : CSVIndex, optional
        Screen ``ball``: the index of this shard's real rows (fingerprinted on them; see
        :func:`~vllm_csv.vllm_plugin.index_loader.load_or_build_index`). The ball is used in
        its two-sided form (:mod:`vllm_csv.screens.ball`).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, shard: Shard, comm: Collective, *,
                 config: HeadConfig | None = None, softcap: float | None = None, scale: float = 1.0,
                 index=None, engine_linear=None, failed: CSVError | None = None):
        self.config = config or HeadConfig()
        if weight.dim() != 2 or weight.shape[0] != shard.rows or comm.size != shard.size or comm.rank != shard.rank:
            raise CSVError(f"shard {shard} does not match a {tuple(weight.shape)} head on rank "
                           f"{comm.rank} of {comm.size}")
        self.shard, self.comm = shard, comm
        self.vocab_size, self.hidden_size = shard.vocab_size, weight.shape[1]
        self.dtype = weight.dtype
        self.engine = DenseEngine(self.dtype, softcap, scale)
        self.backend = backend_for(weight.device)
        self._device_type = weight.device.type  # (arithmetic_ok: the backend whose fp32 setting counts)
        n = shard.real
        local_cfg = replace(self.config, off_switch=False, budget=1.0)
        # the single-rank head over the shard's real rows: screen, bounds, exact scoring. A rank that
        # cannot build it (``failed``: the caller's error, e.g. its shard's index refused) says so in
        # the first collective, and every rank raises: the ranks never split between this head's
        # collectives and vLLM's dense path (a rebuild after new weights that one rank's index refuses)
        self.local = None
        try:
            if failed is not None:
                raise failed
            if self.config.screen == "ball" and index is None and n:
                raise CSVError(f"screen 'ball' with tensor parallelism needs the index of this rank's shard "
                               f"(rank {shard.rank} of {shard.size}, vocabulary rows {shard.real_rows.start}..."
                               f"{shard.real_rows.stop})")
            self.local = None if n == 0 else CertifiedHead(
                weight[:n], None if bias is None else bias[:n], config=local_cfg, softcap=softcap, scale=scale,
                index=index, two_sided=True, engine_linear=engine_linear, engine_rows=weight.shape[0])
            if self.local is not None and not self.local.screen.two_sided:
                raise CSVError(f"screen {self.local.screen.name!r} is not supported with tensor parallelism")
        except CSVError as e:
            failed = e
        # the engine's probe, one decision on every rank (arithmetic_ok reads it every step), with
        # whether each rank built its head
        mine = 1.0 if self.local is None else float(self.local.engine_probe.fp32_accumulation)
        g = comm.all_gather(torch.tensor([mine, 0.0 if failed else 1.0], device=weight.device)).cpu()
        if failed is not None:
            raise failed
        if bool((g[:, 1] < 0.5).any()):
            ranks = [r for r in range(g.shape[0]) if g[r, 1] < 0.5]
            raise CSVError(f"rank(s) {ranks} of {shard.size} could not build the head of their shard (their log "
                           "says why); no rank uses CSV")
        agreed = bool(g[:, 0].min() > 0)
        self.engine_probe = EngineProbe(agreed, False, False) if self.local is None else replace(
            self.local.engine_probe, fp32_accumulation=agreed)
        self.screen_name = "none" if self.local is None else self.local.screen.name
        self.screen_backend = None if self.local is None else self.local.screen_backend
        if shard.size * shard.rows > 2**24:  # global ids travel as fp32 in the collectives
            raise CSVError(f"vocabulary of {shard.size * shard.rows} rows is too large for the sharded head")
        self.off_switch = SharedOffSwitch(comm, device=weight.device) if self.config.off_switch else None
        self.last_certified: torch.Tensor | None = None  # [B] bool of the last step (host)
        self.last_top1: torch.Tensor | None = None  # [B] int64 of the last step (runtime.sampler_logits)

    @property
    def max_certified_k(self) -> int:
        """As :attr:`CertifiedHead.max_certified_k`."""
        return min(self.config.max_topk, self.vocab_size)

    def arithmetic_ok(self) -> bool:
        """As :meth:`CertifiedHead.arithmetic_ok`, on the probe every rank agreed on (and torch's
        setting, the same on every rank)."""
        return arithmetic_ok(self.engine_probe, self.dtype, self._device_type)

    def output(self, exact: torch.Tensor) -> torch.Tensor:
        """As :meth:`CertifiedHead.output`."""
        return certificate.output(self.engine, exact)

    can_exclude = False  # (no ``exclude``: a suppressing model's greedy rows go to the sampler)

    def select(self, hidden: torch.Tensor, k: torch.Tensor, need_values: torch.Tensor,
               temp: torch.Tensor | None = None, exclude: torch.Tensor | None = None) -> Selection:
        """One step's selection (:class:`~vllm_csv.head.selector.Selector`), the same on every
        rank, with the off-switch's pending step time folded in through the first collective (so
        every rank keeps the same ledger)."""
        if exclude is not None:
            raise CSVError("the sharded head cannot leave tokens out of the certificate")
        sw = self.off_switch
        sel, pend = self._select(hidden, k, need_values, None if sw is None else sw.pending_tensor(), temp)
        if sw is not None:
            sw.fold(pend.cpu())
        return sel

    def sampler_logits(self, hidden: torch.Tensor, topk: torch.Tensor, dense_fn=None, t0: float | None = None,
                       temperature: torch.Tensor | None = None, use_switch: bool = False,
                       exclude: torch.Tensor | None = None) -> tuple[torch.Tensor, StepStats]:
        """:meth:`CertifiedHead.sampler_logits` over the sharded head: the same ``[B, V]`` on every
        rank. ``dense_fn`` (required here) is the collective dense path (vLLM:
        ``LogitsProcessor.forward``, which all-gathers); every decision that leads to it is the
        same on every rank, so it is called by all ranks or by none. ``StepStats`` counts the
        global decision; ``seconds`` is this rank's. ``use_switch`` is ignored (the plugin's step
        runs the off-switch)."""
        if dense_fn is None:
            raise CSVError("the sharded head's sampler_logits needs the collective dense function")
        return runtime.sampler_logits(self, hidden, topk, dense_fn, t0, temperature, exclude)

    # ---- one step ---------------------------------------------------------------------------
    def _select(self, hidden: torch.Tensor, k: torch.Tensor, need_values: torch.Tensor,
                pending: torch.Tensor | None = None, temp: torch.Tensor | None = None
                ) -> tuple[Selection, torch.Tensor]:
        """Steps 1-3 of the module docstring. Returns the selection (global ``[B, V]``) and the
        gathered off-switch numbers ``[size, 1]`` (:meth:`SharedOffSwitch.pending_tensor`)."""
        B, V, dev = hidden.shape[0], self.vocab_size, hidden.device
        kmax = int(k.max())
        budget = self.config.budget_columns(V, kmax)
        loc = self.local
        # ---- 1. local screen and lower bounds of the k best tokens -----------------------------
        if loc is not None:
            sc = self._screen(hidden, kmax)
            hidden, hnorm, ok, y, bmax, spread, delta = (sc[n] for n in (
                "hidden", "hnorm", "ok", "y", "bmax", "spread", "delta"))
            lbs = sc["lbs"]
        else:
            ok = torch.ones(B, dtype=torch.bool, device=dev)
            lbs = torch.full((B, kmax), -math.inf, device=dev)
        pending = torch.tensor([-1.0]) if pending is None else pending
        p1 = torch.cat([lbs.reshape(-1), ok.float(), pending.to(dev)])
        g1 = self.comm.all_gather(p1)  # collective 1: [size, B k + B + 1]
        size = g1.shape[0]
        glbs = g1[:, : B * kmax].reshape(size, B, kmax).permute(1, 0, 2).reshape(B, size * kmax)
        okg = (g1[:, B * kmax : B * kmax + B] > 0.5).all(0)
        gathered_pending = g1[:, -1:]
        tau = glbs.topk(kmax, dim=1).values.gather(1, (k - 1)[:, None])[:, 0]  # same on every rank
        # ---- 2. local candidates, scored exactly; the shard's k best -------------------------
        F = 4 * kmax + 3
        p2 = torch.empty((B, F), device=dev)
        p2[:, : 4 * kmax] = -math.inf
        p2[:, kmax : 2 * kmax] = -1.0  # global ids of empty slots
        p2[:, 4 * kmax :] = torch.tensor([-math.inf, 0.0, 1.0], device=dev)  # U_rest, count, live
        scored_here = 0
        if loc is not None:
            thr = self._threshold(tau, spread, delta).masked_fill(~okg, math.nan)[:, None]
            blocks = bmax >= thr
            live = blocks.sum(1) <= budget
            cols = _block_cols((blocks[live] if B > 1 else blocks).any(0).nonzero().squeeze(1), loc.vocab_size)
            cand = y[:, cols] >= thr
            count = cand.sum(1)
            live &= count <= budget
            ids = cols[(cand[live] if B > 1 else cand).any(0)]
            scored_here = ids.numel()
            if scored_here:
                z, lower, upper = loc.score(hidden, ids, hnorm)
                m = min(kmax, scored_here)
                sel = z.float().topk(m, dim=1).indices
                p2[:, :m] = z.float().gather(1, sel)
                p2[:, kmax : kmax + m] = (ids[sel] + self.shard.start).float()  # exact below 2^24
                p2[:, 2 * kmax : 2 * kmax + m] = lower.gather(1, sel)
                p2[:, 3 * kmax : 3 * kmax + m] = upper.gather(1, sel)
                p2[:, 4 * kmax] = upper.scatter(1, sel, -math.inf).amax(1)
            p2[:, 4 * kmax + 1] = count.float()
            p2[:, 4 * kmax + 2] = live.float()
        p2 = torch.cat([p2.reshape(-1), torch.tensor([float(scored_here)], device=dev)])
        g2 = self.comm.all_gather(p2)  # collective 2: [size, B F + 1]
        scored = int(g2[:, -1].sum())  # host sync: StepStats is a host record (as the single-rank head)
        g2 = g2[:, :-1].reshape(size, B, F).permute(1, 0, 2)  # [B, size, F]
        part = lambda j: g2[:, :, j * kmax : (j + 1) * kmax].reshape(B, size * kmax)  # noqa: E731
        gz, gid, glo, gup = (part(j) for j in range(4))
        outside = self._outside(tau, g2[:, :, 4 * kmax])
        live_all = (g2[:, :, 4 * kmax + 2] > 0.5).all(1) & (g2[:, :, 4 * kmax + 1].sum(1) <= budget)
        # ---- 3. the same certificate on every rank -------------------------------------------
        cert, in_top = certificate.certify(self.engine, gz.to(self.dtype), glo, gup, k, outside, need_values, gid,
                                           temp, self.backend.certify_plain)
        certified = okg & live_all & cert
        exact = torch.full((B, V), -math.inf, dtype=self.dtype, device=dev)
        put = in_top & (gid >= 0) & certified[:, None]
        r, c = put.nonzero(as_tuple=True)
        exact[r, gid[r, c].long()] = gz[r, c].to(self.dtype)
        return Selection(exact, torch.full((B,), scored, device=dev), certified,
                         certificate.reasons(certified, okg, live_all)), gathered_pending

    def _screen(self, hidden: torch.Tensor, kmax: int) -> dict:
        """Screen of the shard's real rows: ``y [B, n]``, its block maxima, ``spread [B]`` and
        ``delta`` (every token has ``|hi_i - y_i|, |lo_i - y_i| <= delta |y_i| + spread``,
        :func:`~vllm_csv.head.selection.select_two_sided`), the rows this rank may certify (``ok``) and
        ``lbs [B, kmax]``: lower bounds of the dense values of ``kmax`` distinct tokens
        (``-inf`` past the shard's size and on rows that are not ``ok``)."""
        loc = self.local
        B = hidden.shape[0]
        errors = loc.errors
        hidden, hnorm, ok = loc.prepare(hidden)
        out = loc.screen.center_radius(hidden)
        y = out.y
        _, rad_max = errors.rad_total(out.radius)
        delta = errors.delta + out.rel
        act = (errors.max_of(out.n) * (1 + delta) * out.e) if out.n is not None else 0.0
        bmax = _block_max(y)
        src = bmax if kmax <= bmax.shape[1] else y  # k distinct tokens (the exact values if few blocks)
        top = src.topk(min(kmax, src.shape[1]), dim=1).values
        if top.shape[1] < kmax:  # a shard of fewer than k tokens
            top = torch.cat([top, top.new_full((B, kmax - top.shape[1]), -math.inf)], 1)
        y1 = top[:, 0]
        spread = errors.spread(rad_max, hnorm, act, out.rel)
        ok &= (y1 + delta * y1.abs() + spread + errors.babs_max) <= self.engine.limit  # False on NaN
        lbs = (top - delta * top.abs() - spread[:, None]).masked_fill(~ok[:, None], -math.inf)
        return dict(hidden=hidden, hnorm=hnorm, ok=ok, y=y, bmax=bmax, spread=spread, delta=delta, lbs=lbs)

    def _threshold(self, tau: torch.Tensor, spread: torch.Tensor, delta: float) -> torch.Tensor:
        """``[B]`` screen threshold of this shard: a token with ``y_i`` below it has ``hi_i < tau``.

        ``hi_i <= g(y_i) + spread`` with ``g(y) = y + delta |y|`` increasing, so
        ``y_i < g^-1(tau - spread)`` gives ``hi_i < tau`` (:func:`~vllm_csv.head.selection.select_two_sided`);
        the last line covers the rounding of this computation. ``tau`` may be any value: it
        only decides how many tokens are scored, never the soundness."""
        s = tau - spread
        thr = torch.where(s >= 0, s / (1 + delta), s / (1 - delta))
        return thr - thr.abs() * (8 * FP32_UNIT_ROUNDOFF) - self.local.errors.tiny

    @staticmethod
    def _outside(tau: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        """``[B]`` upper bound of every token outside the gathered ``k``-best lists: ``tau`` for
        the unscored ones (:meth:`_threshold`) and ``rest [B, size]``, each rank's largest upper
        bound of its other scored tokens."""
        return torch.maximum(tau, rest.amax(1))
