"""The fused certified step on CUDA: one object per head, its constants bound once.

Pipeline of :meth:`FusedStep.run` (five kernels, one module each in :mod:`vllm_csv.gpu`; fixed
shapes, no host sync, so a batch size's step is captured once in a CUDA graph and replayed)::

    quantize_rows     h [B, d]            -> p int8 [2, BB, d], t [2, B], e, ||h||, ok [B]
    screen_block_max  p, q int8 [V, d]    -> block upper, lower bounds              [B, V / SUB]
    select_blocks     block bounds, k     -> candidate blocks [B, CAP], outside, ok, live
    score_blocks      h, W, candidates    -> z, lower, upper                        [B, CAP * SUB]
    certify_rows      scores, outside, k  -> top-k ids, values [B, kmax], code      [B]

The math is :func:`vllm_csv.head.selection.select_two_sided` with each row's own
candidate blocks and each token's own error terms (:mod:`vllm_csv.gpu`'s docstring,
:func:`~vllm_csv.gpu.screen.screen_block_max_ref`), on heads whose engine is plain
(no soft-cap, ``scale = 1``) and rows read greedily or by top-k without temperature: the
other rows take the head's reference path (:meth:`FusedStep.supports`).

What the step hands back is on the device: the ids (and values) of every row, certified or
not, and each row's code (:data:`vllm_csv.ops.step.REASONS`). :meth:`FusedStep.topk`
finishes a step for a caller that needs every row: the rows whose code is not 0 take the
dense head's values of the whole batch, after one host read of "did any row fail" (see there).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import CSVError
from ..fp import round_down32, round_up32
from ..head.certificate import is_plain
from .certify import certify_rows
from .common import CAP, SUB, available, batch_tile
from .draw_bounds import block_bounds, block_upper, draw_select
from .gumbel_draw import gumbel_draw
from .processed import processed_block_hi, processed_candidates
from .quantize import quantize_rows
from .score import score_blocks
from .screen import screen_block_max
from .select import select_blocks


def _fp32(x: float, rounding) -> float:
    """The fp32 value of ``x`` by ``rounding`` (:func:`~vllm_csv.fp.round_up32` or ``round_down32``)."""
    return float(rounding(torch.tensor(x, dtype=torch.float64)))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class FusedStep:
    """The fused step of ``head`` (a :class:`~vllm_csv.head.CertifiedHead` whose screen is the
    exact int8 GEMM copy, :class:`~vllm_csv.screens.quantized.QuantizedScreen`).

    Parameters
    ----------
    head : CertifiedHead
        Its weight, bias, screen and error terms are read once, here. A head whose screen is
        another (a CPU head's FBGEMM copy) gets an int8 copy of its own.
    """

    def __init__(self, head):
        from ..screens.quantized import QuantizedScreen

        if not available():
            raise CSVError("the fused GPU step needs Triton")
        screen = getattr(head.screen, "tight", head.screen)
        if not (isinstance(screen, QuantizedScreen) and screen.int_gemm):
            # (on CUDA the int8 screen is this one already; a CPU head, as under Triton's
            # interpreter in the tests, has the FBGEMM or VNNI layout: a copy of its own here)
            screen = QuantizedScreen(head.weight, head.bias, bits=8)
            if not screen.int_gemm:
                raise CSVError(f"the fused GPU step needs an exact int8 GEMM copy (d = {head.hidden_size})")
        self.screen = screen
        self.head = head
        self.V, self.d = head.vocab_size, head.hidden_size
        self.dtype = head.dtype
        self.weight = head.weight if head.weight.is_contiguous() else head.weight.contiguous()
        self.bias = head.bias
        self.q = screen.q  # [V, d] view of the padded GEMM copy (row stride d8)
        self.s = screen.s.reshape(-1).float().contiguous()
        self.sbias = screen.bias  # fp32: the screen's centre adds it
        self.certifiable = head.certifiable
        errors = head.errors  # the head's error model (vllm_csv.head.error_model)
        delta = errors.delta  # the exact int8 GEMM adds no relative term of its own (rel = 0)
        # each token's total radius and dequantised norm (times 1 + delta), fp32 rounded up: the
        # screen's epilogue widens each token's center by its own terms (screen_block_max_ref)
        self.rad = round_up32(errors.rad_total(screen.r_exact)[0].double() * (1 + 2.0**-22)).contiguous()
        self.nrm = round_up32(screen.n.reshape(-1).double() * (1 + delta)).contiguous()
        # (kernels take Python floats as fp32: every constant is an fp32 value, rounded the safe way)
        self.consts = dict(delta=_fp32(delta, round_up32),
                           cst=_fp32(errors.tiny + errors.bias_slack(0.0)[1], round_up32),
                           limit=_fp32(head.engine.limit, round_down32),
                           babs_max=_fp32(errors.babs_max, round_up32))
        self.coef = errors.score_coef
        self.gam = errors.gamma
        self.tiny32 = errors.tiny32
        self.guard_scale, self.babs_max = errors.guard_scale, errors.babs_max
        self.nb = -(-self.V // SUB)

    # ---- what it certifies ---------------------------------------------------------------
    def supports(self, kmax: int, temperature: torch.Tensor | None = None) -> bool:
        """Rows asking for ``k <= kmax`` on this head: the engine is plain, ``kmax`` at most
        :data:`~vllm_csv.gpu.common.CAP` blocks' worth and the number of blocks, and no row is
        sampled with a temperature (their kept-set certificate is the reference path's)."""
        return (is_plain(self.head.engine) and 1 <= kmax <= min(64, self.nb)
                and (temperature is None or not bool((temperature > 0).any())))

    def cap_for(self, kmax: int) -> int:
        """Candidate blocks a row may keep: :data:`~vllm_csv.gpu.common.CAP`, and no more than
        the head's budget (``budget V`` tokens) allows."""
        budget = self.head.config.budget_columns(self.V, kmax)
        return max(1, min(CAP, budget // SUB))

    # ---- the step ------------------------------------------------------------------------
    def run(self, hidden: torch.Tensor, k: torch.Tensor, need: torch.Tensor, kmax: int):
        """One certified step, all on the device.

        Parameters
        ----------
        hidden : torch.Tensor
            ``[B, d]`` model dtype.
        k : torch.Tensor
            ``[B]`` int32, ``1 <= k <= kmax``.
        need : torch.Tensor
            ``[B]`` int8 0/1: the row reads the values of its top-k (certified bit for bit).
        kmax : int
            A host bound of ``k`` (one compiled kernel per power of two).

        Returns
        -------
        ids : torch.Tensor
            ``[B, kb]`` int64 (``kb = kmax`` rounded up to a power of two), descending by the scored
            value, ties by the lowest id; past a row's ``k`` its first id again. A certified row
            with ``need`` holds the dense head's top-k in its order; without, only the *set* is
            certified (and for ``k = 1`` the argmax), the order within it following the scores,
            which two tokens a rounding apart may share (as :meth:`CertifiedHead.topk
            <vllm_csv.head.CertifiedHead.topk>` with ``values=False``).
        values : torch.Tensor
            ``[B, kb]`` fp32 holding model-dtype values.
        code : torch.Tensor
            ``[B]`` int32: 0 certified, else the fallback reason's index in
            :data:`vllm_csv.ops.step.REASONS`.
        count : torch.Tensor
            ``[B]`` int32: the row's candidate blocks (:meth:`scored` turns it into tokens).

        Five kernels and nothing else (no casts, no fills): what a captured graph replays.
        """
        B = hidden.shape[0]
        kb = _pow2(kmax)
        p, t, e, hnorm, ok = quantize_rows(hidden, self.certifiable and self.head.arithmetic_ok(), batch_tile(B),
                                           self.guard_scale, self.babs_max)
        umax, lmax = self.screen_bounds(p, t, e, hnorm, B)
        c = self.consts
        cand, count, outside, ok, live = select_blocks(umax, lmax, k, ok, c["limit"], c["babs_max"],
                                                       self.cap_for(kmax), kb)
        z, lower, upper = score_blocks(hidden, self.weight, self.bias, cand, count, self.coef, self.gam,
                                       self.tiny32)
        ids, vals, code = certify_rows(z, lower, upper, cand, count, k, need, outside, ok, live, self.V, kb,
                                       self.dtype)
        return ids, vals, code, count

    def screen_bounds(self, p, t, e, hnorm, B: int):
        """Step 2 on this head: ``(umax, lmax)`` ``[B, nb]``, every block's largest upper and lower
        bound of a token's dense logit (:func:`~vllm_csv.gpu.screen.screen_block_max`)."""
        return screen_block_max(p, self.q, self.s, t, self.sbias, B, hnorm, e, self.rad, self.nrm,
                                self.consts["delta"], self.consts["cst"])

    def supports_draw(self) -> bool:
        """V2 temperature rows (with min-p, a grammar's mask, vLLM's processors, any or none:
        :func:`draw_v2`'s caller checks) may be drawn on the device: the engine is plain (no
        soft-cap, ``scale = 1``: the scored values are what V2's sampler reads)."""
        return is_plain(self.head.engine) and self.nb >= 1

    def screen_rows(self, hidden: torch.Tensor):
        """Steps 1-2 of the step on ``hidden`` (``[B, d]``): ``(umax, lmax, ok)``, every block's
        largest upper and lower bound of a token's dense logit (``[B, nb]`` fp32) and the
        quantization's per-row ``ok`` (``[B]`` int8), what :meth:`draw_v2` starts from."""
        B = hidden.shape[0]
        p, t, e, hnorm, ok = quantize_rows(hidden, self.certifiable and self.head.arithmetic_ok(), batch_tile(B),
                                           self.guard_scale, self.babs_max)
        return (*self.screen_bounds(p, t, e, hnorm, B), ok)

    def draw_v2(self, hidden: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor, temp: torch.Tensor,
                cap: int | None = None, min_p: torch.Tensor | None = None, masked: torch.Tensor | None = None,
                process=None, screened: tuple | None = None, removed: torch.Tensor | None = None,
                top: torch.Tensor | None = None):
        """vLLM V2's Gumbel draw of each row of ``hidden``, certified on the device (no host sync).

        Six kernels (:mod:`vllm_csv.gpu.gumbel_draw` has the argument): the step's quantize and
        screen; every block's noisy bound from its screen maximum, temperature and largest
        noise (:func:`~vllm_csv.gpu.draw_bounds.block_bounds`); the ``cap`` blocks of largest
        bound as candidates (:func:`~vllm_csv.gpu.draw_bounds.draw_select`); the step's exact
        scoring of them; the draw's certificate
        (:func:`~vllm_csv.gpu.gumbel_draw.gumbel_draw`). With ``process``, vLLM's processors run
        on the blocks' bounds before the second kernel and on the candidates' intervals before
        the last (:mod:`vllm_csv.gpu.processed`: torch passes over ``[B, V]``, no host sync).

        Parameters
        ----------
        hidden : torch.Tensor
            ``[B, d]`` model dtype.
        seeds, pos : torch.Tensor
            ``[B]`` int64: the request's seed (V2's ``SamplingStates.seeds``), the position sampled.
        temp : torch.Tensor
            ``[B]`` fp32 temperature (0: greedy, V2's argmax).
        cap : int, optional
            Candidate blocks a row scores (default :meth:`cap_for` of one token: the list's
            :data:`~vllm_csv.gpu.common.CAP` within the head's budget).
        min_p : torch.Tensor, optional
            ``[B]`` fp32, each row's min-p (V2's ``_min_p_kernel`` after the temperature; 0: none).
        masked : torch.Tensor, optional
            ``[B, V]`` bool, the tokens a grammar's bitmask forbids (``-inf`` before the sampler).
        process : callable, optional
            vLLM's V2 logits processors on ``[B, V]`` bounds (``process(lo, hi) -> (lo', hi')``,
            :func:`vllm_csv.vllm_plugin.v2.sampler._processors`), applied to the blocks' bounds and
            the candidates' intervals (:mod:`vllm_csv.gpu.processed`).
        removed : torch.Tensor, optional
            ``[B]`` int64, a token each row draws without after min-p took its threshold with it
            (``-1``: none; V2's verification after a rejection, :mod:`vllm_csv.gpu.gumbel_draw`).
        top : torch.Tensor, optional
            ``[B]`` bool, rows V2 masks with a top-k or a top-p: certified only where the winner is
            also the row's certain maximum (:mod:`vllm_csv.gpu.gumbel_draw`).
        screened : tuple, optional
            :meth:`screen_rows` of these rows, computed already (V2's verification screens its
            rows once, :mod:`vllm_csv.sampling.verify_v2_fused`): its ``ok`` must hold the whole
            screened batch's (a row's ``ok`` and'ed with every row's). None: screened here.

        Returns
        -------
        token : torch.Tensor
            ``[B]`` int64, V2's draw where certified.
        code : torch.Tensor
            ``[B]`` int32, 0 certified (:mod:`vllm_csv.gpu.gumbel_draw`'s codes).
        count : torch.Tensor
            ``[B]`` int32 candidate blocks (:meth:`scored`).
        """
        cap = self.cap_for(1) if cap is None else max(1, min(cap, CAP))
        umax, lmax, ok = self.screen_rows(hidden) if screened is None else screened
        c = self.consts
        if process is None:
            bound, qhi = block_bounds(umax, seeds, pos, temp, self.V, True, self.dtype)
        else:  # the blocks' bounds through vLLM's processors, then the same noisy bounds
            bh = processed_block_hi(process, block_upper(umax, self.dtype), self.V)
            bound, qhi = block_bounds(bh, seeds, pos, temp, self.V)
        # (the early min-p drop bounds the row's maximum by its largest screen value's token, which a
        # grammar may forbid or a processor lower: not with either; a removed token is still in the
        # row when min-p takes its threshold, so it may be that token)
        early = min_p if masked is None and process is None else None
        cand, count, out_hi, out_abs, out_q, ok = draw_select(bound, qhi, umax, lmax, ok, c["limit"], c["babs_max"],
                                                              cap, temp, early, self.dtype)
        z, lower, upper = score_blocks(hidden, self.weight, self.bias, cand, count, self.coef, self.gam,
                                       self.tiny32)
        if process is not None:
            lower, upper = processed_candidates(process, cand, count, lower, upper, self.V)
        if min_p is None:
            min_p = torch.zeros_like(temp, dtype=torch.float32)
        token, code = gumbel_draw(cand, count, lower, upper, out_hi, out_abs, out_q, seeds, pos, temp, min_p, ok,
                                  self.V, masked, removed, top)
        return token, code, count

    @staticmethod
    def scored(count: torch.Tensor) -> torch.Tensor:
        """Tokens scored exactly per row, from :meth:`run`'s ``count``."""
        return count.clamp(max=CAP) * SUB

    def logits(self, ids: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` model dtype: the certified values on ``ids``, ``-inf`` elsewhere (what a
        sampler that reads a row of logits gets; repeated ids write the same value)."""
        out = torch.full((ids.shape[0], self.V), -math.inf, dtype=self.dtype, device=ids.device)
        return out.scatter_(1, ids, vals.to(self.dtype))

    def topk(self, hidden: torch.Tensor, k: int, values: bool = False):
        """``(ids [B, k], values [B, k], certified [B])`` of every row: certified rows from the
        step, the others from the dense head (``F.linear`` on the whole batch, so its rows are
        the engine's own bits), ties by the lowest id. With ``values`` a certified row's ids (in
        order) and values are the dense head's; without, its *set* of ids (:meth:`run`).

        The one host sync: whether any row failed, read once after the step. The dense rescue
        has to be the engine's cuBLAS GEMM over the whole batch (another GEMM, or the batch's
        failing rows alone, may round differently), and launching it on every step would cost
        the dense head; so the host decides. In a captured graph the same read follows the
        replay."""
        B = hidden.shape[0]
        if not 1 <= k <= self.V:
            raise CSVError(f"k must be in [1, {self.V}], got {k}")
        kk = torch.full((B,), k, dtype=torch.int32, device=hidden.device)
        need = torch.full((B,), int(values), dtype=torch.int8, device=hidden.device)
        ids, vals, code, _ = self.run(hidden, kk, need, k)
        ids, vals = ids[:, :k], vals[:, :k]
        if bool(code.cpu().any()):  # the host sync (one copy of [B] int32): see the docstring
            dense = F.linear(hidden, self.head.weight, self.head.bias).float()
            dv, di = torch.sort(dense, dim=1, descending=True, stable=True)
            cert = code == 0
            ids = torch.where(cert[:, None], ids, di[:, :k])
            vals = torch.where(cert[:, None], vals, dv[:, :k])
        return ids, vals, code == 0


class GraphedStep:
    """:meth:`FusedStep.run` captured in a CUDA graph per (batch size, ``kmax`` bucket) and
    replayed: a batch of ``B`` rows takes the smallest captured size ``>= B``, its extra rows
    zero (finite: they certify nothing and hold no other row back).

    Parameters
    ----------
    step : FusedStep
    sizes : list of int
        The batch sizes captured (vLLM's ``cudagraph_capture_sizes``); a batch above the largest
        runs the step eagerly.
    """

    def __init__(self, step: FusedStep, sizes: list[int]):
        self.step = step
        self.sizes = sorted(set(int(s) for s in sizes))
        self._graphs: dict[tuple[int, int], tuple] = {}
        self.pool = None

    def _capture(self, size: int, kb: int, dev):
        st = self.step
        h = torch.zeros((size, st.d), dtype=st.dtype, device=dev)
        k = torch.ones(size, dtype=torch.int32, device=dev)
        need = torch.zeros(size, dtype=torch.int8, device=dev)
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):  # compiles and autotunes outside the capture
            for _ in range(2):
                st.run(h, k, need, kb)
        torch.cuda.current_stream(dev).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = st.run(h, k, need, kb)
        self.pool = g.pool()
        return g, h, k, need, out

    def run(self, hidden: torch.Tensor, k: torch.Tensor, need: torch.Tensor, kmax: int):
        """:meth:`FusedStep.run`'s outputs for ``hidden [B, d]`` (views of the graph's buffers,
        valid until the next replay of the same size)."""
        B = hidden.shape[0]
        size = next((s for s in self.sizes if s >= B), None)
        if size is None or not hidden.is_cuda:
            return self.step.run(hidden, k, need, kmax)
        kb = _pow2(kmax)
        key = (size, kb, self.step.head.arithmetic_ok())  # (a graph bakes the engine's arithmetic in)
        if key not in self._graphs:
            self._graphs[key] = self._capture(size, kb, hidden.device)
        g, h, kk, nn, out = self._graphs[key]
        h[:B].copy_(hidden)
        kk[:B].copy_(k)
        nn[:B].copy_(need)
        if size > B:  # rows of an earlier, larger batch: zero (finite, k = 1, no values)
            h[B:].zero_()
            kk[B:].fill_(1)
            nn[B:].zero_()
        g.replay()
        return tuple(o[:B] for o in out)

