"""The fused certified step's kernels on CUDA (Triton), each beside its torch reference.

The step (:class:`vllm_csv.gpu.step.FusedStep`) is five kernels, no host sync, fixed shapes:

1. :func:`quantize_rows` ``[B]`` programs: ``h`` -> int8 ``p``, scale ``t``, residual norm
   ``e >= ||h - t p||``, ``||h||`` rounded up, and which rows may be certified.
2. :func:`screen_block_max` ``[ceil(V / BV)]`` programs: the exact int8 GEMM ``<q_i, p_b>`` on
   tensor cores, its epilogue the screen's center ``y = fl(fl(fl(acc) t_b) s_i) (+ b_i)`` and
   the maximum of each block of ``SUB`` tokens. It writes ``[B, ceil(V / SUB)]`` maxima, never
   ``[B, V]``.
3. :func:`select_blocks` ``[B]`` programs: the threshold of
   :func:`vllm_csv.ops.cpu_step.select_candidates_ref` from the block maxima (``y_1``, the
   k-th largest ``y_k``, ``tau``, ``thr``) and the candidate blocks (maximum ``>= thr``),
   compacted in ascending order into a fixed ``[B, CAP]`` list; more than ``CAP`` blocks: the
   row is not ``live`` (reason ``budget``).
4. :func:`score_blocks` ``[B, CAP]`` programs: every token of a candidate block scored in
   float64 with the dense engine's interval (:func:`vllm_csv.head.bounds.score`): the
   rounded ends ``lower <= zt <= upper`` and ``z`` (the dense bits where the ends agree).
5. :func:`certify_rows` ``[B]`` programs: the top-k certificate of
   :func:`vllm_csv.ops.cpu_step.certify_topk_ref` per row against ``outside_high = tau`` and,
   for ``k = 1`` rows, the replayed tie (lowest id holding a value known bit for bit). Writes
   the top-k ids (descending, ties by the lowest id), their values and the row's outcome code
   (:data:`vllm_csv.ops.cpu_step.REASONS`).

Why blocks and not tokens past the GEMM: the k-th largest screen value, hence the threshold,
is known only once every block has been read, so the GEMM cannot pick tokens itself; a
token of a block below the threshold has ``hi < tau`` (the search's argument,
:func:`vllm_csv.head.selection.select_two_sided`), and every token of a block that
reaches it is scored exactly, so the certificate of each row holds with ``outside_high =
tau`` on its own candidate blocks (not the batch's union, as on the CPU).

Each op is a ``torch.library`` custom op (``vllm_csv_gpu::``) with a fake implementation;
``*_ref`` is the same math in torch, the tests' oracle (``tests/test_gpu_kernels.py``). The
kernels run under ``TRITON_INTERPRET=1`` on the CPU (CI) and compiled on CUDA.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from ..dense_engine import ACC_LIMIT, DenseEngine
from ..fp import round_down32, round_up32
from ..ops.cpu_step import has_subnormal, single_valued, threshold_from

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - torch wheels without Triton
    triton = tl = None

SUB = 64  # tokens a block: the screen's block maxima, the candidate lists, the scoring programs
CAP = 16  # candidate blocks a row may keep (SUB * CAP tokens scored at most); more: not live
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    """Triton is importable (the step runs compiled on CUDA, or interpreted on the CPU)."""
    return triton is not None


# ---- 1. quantize_rows -------------------------------------------------------------------------
def _slack_up(x64):
    """An fp32 upper bound of a non-negative float64 ``x`` (and of the float64 sum and sqrt it
    came from, within ``2^-40`` relative): ``fl32(x (1 + 2^-20) + 2^-148)``."""
    return x64 * (1 + 2.0**-20) + 2.0**-148


def quantize_rows_ref(h: torch.Tensor, certifiable: bool, rows_pad: int, wmax: float = 0.0, babs_max: float = 0.0):
    """``(p [rows_pad, d] int8, t [B], e [B], hnorm [B], ok [B] int8)`` for ``h [B, d]`` (flags
    are int8 0/1 throughout the step: no conversion kernels between the steps).

    ``ok``: the row is finite with no subnormal entry, the head ``certifiable``, and the dense
    accumulator cannot overflow
    (:meth:`vllm_csv.dense_engine.DenseEngine.accumulator_safe` with the head's ``wmax`` and
    ``babs_max``, the kernel repeating its expression); rows that are not ``ok`` are
    quantised as zeros (``p = 0``, ``e = hnorm = 0``) and add no candidates. ``t = fl(max|h| *
    (1/127))`` (clamped to the smallest normal), ``p = round(h / t)`` clamped to ``+-127``
    (any ``p`` is sound: ``e`` is measured on it), ``e`` and ``hnorm`` fp32 upper bounds of
    ``||h - t p||`` and ``||h||`` (float64 sums, :func:`_slack_up`). Rows past ``B`` of ``p``
    are zero (the GEMM's padding)."""
    B, d = h.shape
    h64 = h.double()
    ok = torch.isfinite(h64).all(1) & torch.isfinite(h64.norm(dim=1).float()) & certifiable
    ok &= ~has_subnormal(h, dim=1)
    ok &= DenseEngine.accumulator_safe(_slack_up(h64.norm(dim=1)).float(), wmax, babs_max)
    hf = h.float().masked_fill(~ok[:, None], 0)
    t = (hf.abs().amax(1) * (1.0 / 127)).clamp_min(torch.finfo(torch.float32).tiny)
    x = hf / t[:, None]
    p = torch.round(x).clamp_(-127, 127)
    f = hf.double() - t.double()[:, None] * p.double()
    e = _slack_up(f.norm(dim=1)).float()
    hnorm = _slack_up(hf.double().norm(dim=1)).float()
    pp = torch.zeros((rows_pad, d), dtype=torch.int8, device=h.device)
    pp[:B] = p.to(torch.int8)
    return pp, t, e, hnorm, ok.to(torch.int8)


def _raw(x: torch.Tensor) -> torch.Tensor:
    """What a kernel loads for a model-dtype tensor: bf16 as its int16 bits (widened exactly by
    :func:`_widen`), other dtypes as they are."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


if triton is not None:
    @triton.jit
    def _widen(raw, BF16: tl.constexpr):
        """A loaded model-dtype value in fp32, exactly. bf16 arrives as its bits (:func:`_raw`):
        the fp32 with those 16 high bits. (Triton's interpreter converts bf16 subnormals wrongly;
        the shift is exact compiled and interpreted.)"""
        if BF16:
            return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            return raw.to(tl.float32)

    @triton.jit
    def _rnd(x, DT: tl.constexpr):
        """The engine's rounding of fp32 ``x`` to the model dtype (to nearest, ties to even,
        overflow to inf), back in fp32. bf16 by integer ops on the bits (exact compiled and
        interpreted, subnormals included)."""
        if DT == tl.bfloat16:
            bits = x.to(tl.int32, bitcast=True)
            bits = bits + (0x7FFF + ((bits >> 16) & 1))
            return (bits & -65536).to(tl.float32, bitcast=True)
        else:
            return x.to(DT).to(tl.float32)

    @triton.jit
    def _quantize_rows_kernel(h_ptr, p_ptr, t_ptr, e_ptr, hn_ptr, ok_ptr, B, d, certifiable, wmax, babs_max,
                              acc_limit, BF16: tl.constexpr, BD: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BD)
        real = b < B  # programs past B write the zero rows of the GEMM's batch tile (loads masked off)
        dl = tl.where(real, d, 0)  # (a vector compare makes the load mask: bool, also interpreted)
        amax = tl.zeros([BD], dtype=tl.float32)
        ss = tl.zeros([BD], dtype=tl.float64)
        bad = tl.zeros([BD], dtype=tl.int32)
        for k0 in range(0, d, BD):
            m = k0 + cols < d
            x = _widen(tl.load(h_ptr + b * d + k0 + cols, mask=k0 + cols < dl, other=0), BF16)
            bad += (x != x).to(tl.int32) + (tl.abs(x) == float("inf")).to(tl.int32)
            bad += ((x != 0) & (tl.abs(x) < 1.1754943508222875e-38)).to(tl.int32)  # (cpu_step.has_subnormal)
            amax = tl.maximum(amax, tl.abs(x))
            x64 = x.to(tl.float64)
            ss += x64 * x64
        n64 = tl.sqrt(tl.sum(ss, 0))
        hn = (n64 * (1 + 2.0**-20) + 2.0**-148).to(tl.float32)
        acc = hn * wmax  # DenseEngine.accumulator_safe, operation for operation
        acc = acc + babs_max
        ok = (tl.sum(bad, 0) == 0) & (n64.to(tl.float32) < float("inf")) & (certifiable != 0) & (acc <= acc_limit)
        t = tl.maximum(tl.max(amax, 0) * (1.0 / 127), 1.1754943508222875e-38)
        t = tl.where(ok, t, 1.1754943508222875e-38)
        fs = tl.zeros([BD], dtype=tl.float64)
        for k0 in range(0, d, BD):
            m = k0 + cols < d
            x = _widen(tl.load(h_ptr + b * d + k0 + cols, mask=k0 + cols < dl, other=0), BF16)
            x = tl.where(ok, x, 0.0)
            # round half to even for |x / t| <= 127.5: adding 1.5 * 2^23 leaves the integer part
            r = tl.div_rn(x, t) + 12582912.0
            r = r - 12582912.0
            r = tl.minimum(tl.maximum(r, -127.0), 127.0)
            f = x.to(tl.float64) - t.to(tl.float64) * r.to(tl.float64)
            fs += f * f
            tl.store(p_ptr + b * d + k0 + cols, r.to(tl.int8), mask=m)
        e = (tl.sqrt(tl.sum(fs, 0)) * (1 + 2.0**-20) + 2.0**-148).to(tl.float32)
        tl.store(t_ptr + b, t, mask=real)
        tl.store(e_ptr + b, tl.where(ok, e, 0.0), mask=real)
        tl.store(hn_ptr + b, tl.where(ok, hn, 0.0), mask=real)
        tl.store(ok_ptr + b, ok.to(tl.int8), mask=real)


def quantize_rows_triton(h: torch.Tensor, certifiable: bool, rows_pad: int, wmax: float = 0.0,
                         babs_max: float = 0.0):
    B, d = h.shape
    h = h.contiguous()
    p = torch.empty((rows_pad, d), dtype=torch.int8, device=h.device)
    t, e, hn = (torch.empty(B, dtype=torch.float32, device=h.device) for _ in range(3))
    ok = torch.empty(B, dtype=torch.int8, device=h.device)
    _quantize_rows_kernel[(rows_pad,)](_raw(h), p, t, e, hn, ok, B, d, int(certifiable), wmax, babs_max, ACC_LIMIT,
                                       BF16=h.dtype == torch.bfloat16, BD=min(1024, triton.next_power_of_2(d)),
                                       **_launch())
    return p, t, e, hn, ok


# ---- 2. screen_block_max ----------------------------------------------------------------------
def screen_block_max_ref(p: torch.Tensor, q: torch.Tensor, s: torch.Tensor, t: torch.Tensor,
                         bias: torch.Tensor | None, B: int):
    """``[B, ceil(V / SUB)]`` fp32 block maxima of ``y = fl(fl(fl(acc) t_b) s_i) (+ b_i)``,
    ``acc = <q_i, p_b>`` exact in int32 (``q [V, d]`` int8 with row scales ``s [V]``, ``p``
    from :func:`quantize_rows_ref`; ``bias`` fp32 or None)."""
    V = q.shape[0]
    acc = (p[:B].double() @ q.double().T).float()  # exact: |acc| <= 127^2 d < 2^31 < 2^53
    y = acc * t[:, None] * s[None, :]
    if bias is not None:
        y = y + bias[None, :]
    pad = (-V) % SUB
    y = torch.nn.functional.pad(y, (0, pad), value=-math.inf)
    return y.view(B, -1, SUB).amax(2)


if triton is not None:
    @triton.jit
    def _screen_block_max_kernel(q_ptr, p_ptr, s_ptr, t_ptr, bias_ptr, out_ptr, B, V, d, ldq, nb,
                                 HAS_BIAS: tl.constexpr, BB: tl.constexpr, BV: tl.constexpr,
                                 BK: tl.constexpr, SUBC: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BV + tl.arange(0, BV)
        bs = tl.arange(0, BB)
        ks = tl.arange(0, BK)
        rmask = rows < V
        acc = tl.zeros([BV, BB], dtype=tl.int32)
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * ldq
        p_cols = p_ptr + bs[None, :] * d
        for k0 in range(0, d, BK):
            km = k0 + ks < d
            a = tl.load(q_rows + (k0 + ks)[None, :], mask=rmask[:, None] & km[None, :], other=0)
            b = tl.load(p_cols + (k0 + ks)[:, None], mask=km[:, None], other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        t = tl.load(t_ptr + bs, mask=bs < B, other=0.0)
        s = tl.load(s_ptr + rows, mask=rmask, other=0.0)
        y = acc.to(tl.float32) * t[None, :]
        y = y * s[:, None]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + rows, mask=rmask, other=0.0)[:, None]
        y = tl.where(rmask[:, None], y, float("-inf"))
        if BV == SUBC:
            m = tl.max(y, 0)[None, :]
        else:
            m = tl.max(tl.reshape(y, (BV // SUBC, SUBC, BB)), 1)
        blk = pid * (BV // SUBC) + tl.arange(0, BV // SUBC)
        tl.store(out_ptr + bs[None, :] * nb + blk[:, None], m,
                 mask=(bs[None, :] < B) & (blk[:, None] < nb))


def batch_tile(B: int) -> int:
    """The GEMM's batch tile (tensor cores want at least 16 columns): the rows of ``p``."""
    return max(16, triton.next_power_of_2(B)) if triton is not None else max(16, B)


# (BV, BK, num_warps, num_stages) tried for the screen on a GPU, once per (V, d, batch tile):
# the fastest that compiles is kept (:func:`screen_config`)
SCREEN_CONFIGS = ((64, 128, 4, 4), (64, 256, 4, 4), (64, 256, 4, 6), (64, 512, 4, 3),
                  (128, 128, 4, 4), (128, 256, 8, 3), (128, 128, 8, 5), (128, 256, 4, 4))
_INTERPRETED_CONFIG = (SUB, 64, 4, 1)
_tuned: dict[tuple, tuple] = {}


def screen_config(key: tuple, launch) -> tuple:
    """The screen's tile for ``key = (V, d, BB, device)``: each of :data:`SCREEN_CONFIGS` is
    launched (``launch(config)``) and timed with CUDA events, once per key, and the fastest
    kept; one that fails to compile or launch is skipped (logged). Under the interpreter: one
    fixed tile. Call it outside a graph capture (:class:`~vllm_csv.gpu.step.GraphedStep` warms
    up first)."""
    if INTERPRET:
        return _INTERPRETED_CONFIG
    if os.environ.get("VLLM_CSV_GPU_TUNE", "1") == "0":  # (tests: the first tile, no timing)
        return SCREEN_CONFIGS[0]
    if key not in _tuned:
        best, errors = None, []
        for cfg in SCREEN_CONFIGS:
            try:
                launch(cfg)
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(10):
                    launch(cfg)
                b.record()
                b.synchronize()
                ms = a.elapsed_time(b) / 10
            except Exception as e:  # noqa: BLE001 - a tile this GPU/Triton cannot build is skipped
                errors.append(f"{cfg}: {type(e).__name__}: {str(e)[:200]}")
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best is None:
            raise RuntimeError("no screen tile compiled: " + "; ".join(errors))
        if errors:
            logging.getLogger("vllm.csv_decode").info("CSV GPU screen: tiles skipped: %s", "; ".join(errors))
        _tuned[key] = best[1]
    return _tuned[key]


def screen_block_max_triton(p, q, s, t, bias, B: int):
    V, d = q.shape
    nb = triton.cdiv(V, SUB)
    out = torch.empty((B, nb), dtype=torch.float32, device=q.device)
    BB = p.shape[0]
    assert q.stride(1) == 1 and p.is_contiguous()

    def launch(cfg):
        bv, bk, warps, stages = cfg
        _screen_block_max_kernel[(triton.cdiv(V, bv),)](
            q, p, s, t, bias if bias is not None else s, out, B, V, d, q.stride(0), nb,
            HAS_BIAS=bias is not None, BB=BB, BV=bv, BK=bk, SUBC=SUB, num_warps=warps, num_stages=stages, **_launch())

    launch(screen_config((V, d, BB, str(q.device)), launch))
    return out


# ---- 3. select_blocks -------------------------------------------------------------------------
def select_blocks_ref(bmax, k, hnorm, e, ok, consts, cap: int):
    """``(cand [B, CAP] int32, count [B] int32, tau [B] fp32, ok [B] int8, live [B] int8)``.

    The threshold of :func:`vllm_csv.ops.cpu_step.threshold_from` from ``y_1`` (largest block
    maximum) and ``y_k`` (``k``-th largest, with multiplicity: ``k`` distinct tokens reach it);
    ``ok`` also asks every row of the batch to be ``ok`` (:func:`vllm_csv.head.bounds.prepare`);
    candidate blocks are those with maximum ``>= thr``, ascending, the first ``CAP`` kept
    (``-1`` past ``count``); ``live``: ``count <= cap``. ``consts`` =
    ``(rad_max, act_coef, tiny, bslack_max, delta, limit, babs_max)``."""
    B, nb = bmax.shape
    kmax = int(k.max()) if B else 1
    top = bmax.topk(min(kmax, nb), dim=1).values
    y1, yk = top[:, 0], top.gather(1, (k.long() - 1).clamp(max=nb - 1)[:, None])[:, 0]
    ok = ok.bool()
    ok = ok & ok.all()
    tau, thr, ok = threshold_from(y1, yk, hnorm, e, ok, *consts)
    blocks = bmax >= thr[:, None]
    count = blocks.sum(1).to(torch.int32)
    live = count <= cap
    pos = blocks.cumsum(1) - 1
    cand = torch.full((B, CAP), -1, dtype=torch.int32, device=bmax.device)
    r, c = (blocks & (pos < CAP)).nonzero(as_tuple=True)
    cand[r, pos[r, c]] = c.to(torch.int32)
    return cand, count, tau, ok.to(torch.int8), live.to(torch.int8)


if triton is not None:
    @triton.jit
    def _select_blocks_kernel(bmax_ptr, k_ptr, hn_ptr, e_ptr, ok_ptr, cand_ptr, count_ptr, tau_ptr,
                              okout_ptr, live_ptr, B, nb, cap, rad_max, act_coef, tiny, bslack_max,
                              delta, limit, babs_max, dplus, dminus, KMAX: tl.constexpr, NB: tl.constexpr,
                              BBATCH: tl.constexpr, CAPC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, NB)
        x = tl.load(bmax_ptr + b * nb + idx, mask=idx < nb, other=float("-inf"))
        k = tl.load(k_ptr + b)
        rows = tl.arange(0, BBATCH)
        all_ok = tl.min(tl.load(ok_ptr + rows, mask=rows < B, other=1).to(tl.int32), 0)
        ok = (tl.load(ok_ptr + b).to(tl.int32) != 0) & (all_ok != 0)
        y1 = tl.max(x, 0)
        yk = y1
        if KMAX <= 8:
            work = x
            for j in tl.static_range(KMAX):  # k-th largest, with multiplicity: drop one maximum a round
                m = tl.max(work, 0)
                yk = tl.where(j == k - 1, m, yk)
                first = tl.argmax(work, 0)
                work = tl.where(idx == first, float("-inf"), work)
        else:  # one sort of the row's block maxima (descending; duplicates kept)
            srt = tl.sort(x, 0, descending=True)
            yk = tl.sum(tl.where(idx == k - 1, srt, 0.0), 0)
        hn = tl.load(hn_ptr + b)
        ee = tl.load(e_ptr + b)
        # threshold_from, operation for operation (fp32)
        spread = rad_max * hn + act_coef * ee
        spread = spread + tiny
        spread = spread + bslack_max
        top = y1 + delta * tl.abs(y1)
        top = top + spread
        top = top + babs_max
        ok = ok & (top <= limit)
        tau = yk - delta * tl.abs(yk)
        tau = tau - spread
        s = tau - spread
        thr = tl.where(s >= 0, tl.div_rn(s, dplus), tl.div_rn(s, dminus))  # 1 +- delta, as torch rounds them
        thr = thr - tl.abs(thr) * (8 * 2.0**-24)
        thr = thr - tiny
        thr = tl.where(ok, thr, float("nan"))  # rows that cannot be certified add no candidates
        blocks = (x >= thr) & (idx < nb)
        bi = tl.where(blocks, 1, 0)
        count = tl.sum(bi, 0)
        pos = tl.cumsum(bi, 0) - 1
        slots = tl.arange(0, CAPC)
        tl.store(cand_ptr + b * CAPC + slots, tl.full([CAPC], -1, tl.int32))
        tl.debug_barrier()
        tl.store(cand_ptr + b * CAPC + pos, idx.to(tl.int32), mask=blocks & (pos < CAPC))
        tl.store(count_ptr + b, count)
        tl.store(tau_ptr + b, tau)
        tl.store(okout_ptr + b, ok.to(tl.int8))
        tl.store(live_ptr + b, (count <= cap).to(tl.int8))


def select_blocks_triton(bmax, k, hnorm, e, ok, consts, cap: int, kmax: int):
    B, nb = bmax.shape
    dev = bmax.device
    cand = torch.empty((B, CAP), dtype=torch.int32, device=dev)
    count = torch.empty(B, dtype=torch.int32, device=dev)
    tau = torch.empty(B, dtype=torch.float32, device=dev)
    okout, live = (torch.empty(B, dtype=torch.int8, device=dev) for _ in range(2))
    if B:
        _select_blocks_kernel[(B,)](bmax, k, hnorm, e, ok, cand, count, tau, okout, live,
                                    B, nb, cap, *consts, 1 + consts[4], 1 - consts[4], KMAX=kmax, NB=triton.next_power_of_2(nb),
                                    BBATCH=max(64, triton.next_power_of_2(B)), CAPC=CAP, **_launch())
    return cand, count, tau, okout, live


# ---- 4. score_blocks --------------------------------------------------------------------------
def score_blocks_ref(h, w, bias, cand, count, coef: float, gam: float, tiny32: float):
    """``(z, lower, upper)``, each ``[B, CAP * SUB]`` fp32: for slot ``c < min(count, CAP)`` and
    token ``j = cand[b, c] * SUB + i < V`` the interval of
    :func:`vllm_csv.head.bounds.score` (``coef = gamma_(d+2) + 4 gamma64_d``, ``gam =
    gamma_(d+2)`` for the bias, ``w`` and ``bias`` in the model dtype); tokens past ``V`` of a
    used slot ``-inf``. Slots past the count: ``-inf`` here, left unwritten by the kernel (never
    read: :func:`certify_rows_ref` masks them)."""
    V = w.shape[0]
    ids = slot_ids(cand, count, V)
    valid = ids >= 0
    hd, wd = h.double(), w.double()
    wj = wd[ids.clamp_min(0).long()]  # [B, S, d]
    a = torch.einsum("bsd,bd->bs", wj, hd)
    E = torch.einsum("bsd,bd->bs", wj.abs(), hd.abs()) * coef + tiny32
    E = E + a.abs() * 2.0**-52
    lo32, hi32 = round_down32(a - E), round_up32(a + E)
    rnd = lambda x: x.to(w.dtype).float()  # noqa: E731
    if bias is None:
        c = a
        lower, upper = rnd(lo32), rnd(hi32)
    else:
        bj = bias[ids.clamp_min(0).long()]
        c = a + bj.double()
        R = E + gam * bj.double().abs()
        R = R + c.abs() * 2.0**-52
        lower = torch.minimum(rnd(round_down32(c - R)), rnd(lo32.to(w.dtype) + bj))
        upper = torch.maximum(rnd(round_up32(c + R)), rnd(hi32.to(w.dtype) + bj))
    z = torch.where(single_valued(lower, upper), lower, rnd(c.float()))
    neg = torch.tensor(-math.inf, device=h.device)
    return (torch.where(valid, z, neg), torch.where(valid, lower, neg), torch.where(valid, upper, neg))


def slot_ids(cand: torch.Tensor, count: torch.Tensor, V: int) -> torch.Tensor:
    """``[B, CAP * SUB]`` int64 token id of each scored slot, ``-1`` where the slot is empty."""
    B = cand.shape[0]
    used = torch.arange(CAP, device=cand.device)[None] < count[:, None].clamp(max=CAP)
    ids = cand.long()[:, :, None] * SUB + torch.arange(SUB, device=cand.device)
    ids = torch.where(used[:, :, None] & (ids < V) & (cand[:, :, None] >= 0), ids, -1)
    return ids.view(B, CAP * SUB)


if triton is not None:
    @triton.jit
    def _down32(x64):
        """fp32 lower bound of float64 ``x``: round to nearest, then a step down if above."""
        x = x64.to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        down = tl.where(x > 0, bits - 1, tl.where(x < 0, bits + 1, -2147483647))
        return tl.where(x.to(tl.float64) > x64, down.to(tl.float32, bitcast=True), x)

    @triton.jit
    def _up32(x64):
        """fp32 upper bound of float64 ``x``."""
        x = x64.to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        up = tl.where(x > 0, bits + 1, tl.where(x < 0, bits - 1, 1))
        return tl.where(x.to(tl.float64) < x64, up.to(tl.float32, bitcast=True), x)

    @triton.jit
    def _score_blocks_kernel(h_ptr, w_ptr, bias_ptr, cand_ptr, count_ptr, z_ptr, lo_ptr, up_ptr, V, d,
                             coef, gam, tiny32, HAS_BIAS: tl.constexpr, DT: tl.constexpr, BF16: tl.constexpr,
                             CAPC: tl.constexpr, SUBC: tl.constexpr, TOK: tl.constexpr, BK: tl.constexpr):
        # program (b, c, part): tokens part * TOK ... of the row's c-th candidate block. Many small
        # programs, each with a wide tile in flight: a candidate block is 64 rows of W, and one
        # program streaming them alone waits on memory latency (measured: ~36 us of fixed cost).
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        part = tl.program_id(2)
        n = tl.minimum(tl.load(count_ptr + b), CAPC)
        if c < n:  # slots past the row's count are never read (certify_rows masks them)
            i = part * TOK + tl.arange(0, TOK)
            out = b * (CAPC * SUBC) + c * SUBC + i
            blk = tl.load(cand_ptr + b * CAPC + c)
            ids = blk.to(tl.int64) * SUBC + i
            valid = (ids >= 0) & (ids < tl.where(blk >= 0, V, 0))  # (vector compares: bool masks)
            ks = tl.arange(0, BK)
            a = tl.zeros([TOK], dtype=tl.float64)
            A = tl.zeros([TOK], dtype=tl.float64)
            for k0 in range(0, d, BK):
                km = k0 + ks < d
                w = _widen(tl.load(w_ptr + ids[:, None] * d + (k0 + ks)[None, :],
                                   mask=valid[:, None] & km[None, :], other=0), BF16).to(tl.float64)
                x = _widen(tl.load(h_ptr + b * d + k0 + ks, mask=km, other=0), BF16).to(tl.float64)
                prod = w * x[None, :]  # exact: products of model-dtype numbers
                a += tl.sum(prod, 1)
                A += tl.sum(tl.abs(prod), 1)
            E = A * coef + tiny32
            E = E + tl.abs(a) * 2.0**-52
            lo32 = _down32(a - E)
            hi32 = _up32(a + E)
            if HAS_BIAS:
                bj = _widen(tl.load(bias_ptr + ids, mask=valid, other=0), BF16)
                cc = a + bj.to(tl.float64)
                R = E + gam * tl.abs(bj.to(tl.float64))
                R = R + tl.abs(cc) * 2.0**-52
                lower = tl.minimum(_rnd(_down32(cc - R), DT), _rnd(_rnd(lo32, DT) + bj, DT))
                upper = tl.maximum(_rnd(_up32(cc + R), DT), _rnd(_rnd(hi32, DT) + bj, DT))
            else:
                cc = a
                lower = _rnd(lo32, DT)
                upper = _rnd(hi32, DT)
            lb = lower.to(tl.int32, bitcast=True)
            ub = upper.to(tl.int32, bitcast=True)
            known = (lower == upper) & ((lb < 0) == (ub < 0))
            z = tl.where(known, lower, _rnd(cc.to(tl.float32), DT))
            tl.store(z_ptr + out, tl.where(valid, z, float("-inf")))
            tl.store(lo_ptr + out, tl.where(valid, lower, float("-inf")))
            tl.store(up_ptr + out, tl.where(valid, upper, float("-inf")))


# tokens a scoring program: SUB / 8 programs a candidate block on a GPU (H100: the step's fixed cost
# 36 -> 16 us at one row, 151936 x 1024, benchmarks/README.md); the interpreter, whose cost is per
# program, takes a block a program (the same code with a wider tile)
SCORE_TOKENS = SUB if INTERPRET else 8
def _tl_dtype(dtype: torch.dtype):
    """Triton's name of a model dtype."""
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def score_blocks_triton(h, w, bias, cand, count, coef: float, gam: float, tiny32: float):
    B, d = h.shape
    V = w.shape[0]
    z, lo, up = (torch.empty((B, CAP * SUB), dtype=torch.float32, device=h.device) for _ in range(3))
    if B:
        _score_blocks_kernel[(B, CAP, SUB // SCORE_TOKENS)](_raw(h.contiguous()), _raw(w), _raw(bias if bias is not None else w), cand,
                                       count, z, lo, up, V, d, coef, gam, tiny32, HAS_BIAS=bias is not None,
                                       DT=_tl_dtype(w.dtype), BF16=w.dtype == torch.bfloat16, CAPC=CAP, SUBC=SUB,
                                       TOK=SCORE_TOKENS, BK=min(512, triton.next_power_of_2(d)), **_launch())
    return z, lo, up


# ---- 5. certify_rows --------------------------------------------------------------------------
def certify_rows_ref(z, lower, upper, cand, count, k, need, tau, ok, live, V: int, kmax: int, dtype: torch.dtype):
    """``(ids [B, kmax] int64, vals [B, kmax] fp32, code [B] int32)``.

    ``T`` = the ``k`` scored slots of largest ``z`` (ties: the lowest id first). Certified (code
    0) when ``ok``, ``live``, and the smallest ``lower`` in ``T`` beats strictly
    ``fl_dtype(max(U, tau))`` (``U`` the largest ``upper`` of the other scored tokens) and is
    finite, and where ``need`` (``[B]`` bool: the row's values are read) every value in ``T`` is
    known bit for bit; a ``k = 1`` row that
    fails is certified on a replayed tie (:func:`vllm_csv.head.certificate.certify`). Codes
    1/2/3: not ``ok`` / not ``live`` / not certified. ``ids`` past ``k`` repeat the first id (a
    scatter then writes the same value twice)."""
    B, S = z.shape
    need, ok, live = need.bool(), ok.bool(), live.bool()
    ids = slot_ids(cand, count, V)
    zz = torch.where(ids >= 0, z, -math.inf)
    # stable order: z descending, then id ascending (slots are in ascending id order)
    order = torch.sort(zz, dim=1, descending=True, stable=True).indices[:, :kmax]
    j = torch.arange(kmax, device=z.device)[None]
    in_k = j < k[:, None]
    in_top = torch.zeros((B, S), dtype=torch.bool, device=z.device)
    in_top.scatter_(1, order, in_k)
    L = lower.masked_fill(~in_top, math.inf).amin(1)
    U = upper.masked_fill(in_top | (ids < 0), -math.inf).amax(1)
    high = torch.maximum(U, tau).to(dtype).float()
    known = single_valued(lower, upper) & (ids >= 0)
    cert = (L > high) & torch.isfinite(L)
    cert &= (known | ~in_top).all(1) | ~need
    top_ids = ids.gather(1, order)
    top_vals = zz.gather(1, order)
    # a k = 1 row: the replayed tie
    v = zz.masked_fill(~known, -math.inf).amax(1)
    tie = known & (zz == v[:, None])
    rest = upper.masked_fill(tie | (ids < 0), -math.inf).amax(1)
    by_tie = (k == 1) & ~cert & (v > torch.maximum(rest, tau).to(dtype).float()) & torch.isfinite(v)
    first = torch.where(tie, ids, torch.iinfo(torch.int64).max).amin(1)
    top_ids[:, 0] = torch.where(by_tie, first, top_ids[:, 0])
    top_vals[:, 0] = torch.where(by_tie, v, top_vals[:, 0])
    cert = (cert | by_tie) & ok & live
    top_ids = torch.where(in_k, top_ids, top_ids[:, :1]).clamp_min(0)
    top_vals = torch.where(in_k, top_vals, top_vals[:, :1])
    code = torch.where(cert, 0, torch.where(~ok, 1, torch.where(~live, 2, 3))).to(torch.int32)
    return top_ids, top_vals, code


if triton is not None:
    @triton.jit
    def _certify_rows_kernel(z_ptr, lo_ptr, up_ptr, cand_ptr, count_ptr, k_ptr, need_ptr, tau_ptr, ok_ptr, live_ptr,
                             ids_ptr, vals_ptr, code_ptr, V, DT: tl.constexpr, KMAX: tl.constexpr,
                             CAPC: tl.constexpr, SUBC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        S: tl.constexpr = CAPC * SUBC
        sl = tl.arange(0, S)
        n = tl.minimum(tl.load(count_ptr + b), CAPC)
        blk = tl.load(cand_ptr + b * CAPC + sl // SUBC)
        ids = blk.to(tl.int64) * SUBC + (sl % SUBC)
        valid = (sl // SUBC < n) & (blk >= 0) & (ids < V)
        z = tl.where(valid, tl.load(z_ptr + b * S + sl), float("-inf"))
        lower = tl.where(valid, tl.load(lo_ptr + b * S + sl), float("-inf"))  # (slots past the count
        upper = tl.where(valid, tl.load(up_ptr + b * S + sl), float("-inf"))  # were never written)
        k = tl.load(k_ptr + b)
        tau = tl.load(tau_ptr + b)
        big = 9223372036854775807
        kk = tl.arange(0, KMAX)
        if KMAX <= 8:
            in_top = tl.zeros([S], dtype=tl.int1)
            work = z
            out_ids = tl.zeros([KMAX], dtype=tl.int64)
            out_vals = tl.zeros([KMAX], dtype=tl.float32)
            kv = tl.zeros([S], dtype=tl.int32) + k
            for j in tl.static_range(KMAX):
                m = tl.max(work, 0)
                # the lowest id holding the maximum (slots ascend with ids; -inf slots only when
                # fewer than k tokens were scored, and such a row is not certified)
                at = tl.min(tl.where(work == m, sl, S), 0)
                at = tl.where(at < S, at, 0)
                pick = sl == at
                in_top = in_top | (pick & (kv > j))
                work = tl.where(pick, float("-inf"), work)
                idj = tl.sum(tl.where(pick, ids, 0), 0)
                out_ids = tl.where(kk == j, idj, out_ids)
                out_vals = tl.where(kk == j, m, out_vals)
        else:  # one sort: keys ordered by z, then by the lower slot (= lower id), all distinct
            zb = z.to(tl.int32, bitcast=True)
            zo = zb ^ ((zb >> 31) & 0x7FFFFFFF)  # int order = float order (-inf lowest; no NaN here)
            key = (zo.to(tl.int64) << 32) | (S - 1 - sl).to(tl.int64)
            srt = tl.sort(key, 0, descending=True)
            kth = tl.sum(tl.where(sl == k - 1, srt, 0), 0)
            in_top = key >= kth
            # the first KMAX sorted keys' slots, through the output row (scratch), then their ids
            # and values loaded back (no per-position reductions)
            slot_of = S - 1 - (srt & 0xFFFFFFFF)
            tl.store(ids_ptr + b * KMAX + sl, slot_of, mask=sl < KMAX)
            tl.debug_barrier()
            sj = tl.load(ids_ptr + b * KMAX + kk).to(tl.int32)
            out_ids = tl.load(cand_ptr + b * CAPC + sj // SUBC).to(tl.int64) * SUBC + (sj % SUBC)
            out_vals = tl.load(z_ptr + b * S + sj)
            tl.debug_barrier()
        L = tl.min(tl.where(in_top, lower, float("inf")), 0)
        U = tl.max(tl.where(in_top, float("-inf"), upper), 0)
        high = _rnd(tl.maximum(U, tau), DT)
        lb = lower.to(tl.int32, bitcast=True)
        ub = upper.to(tl.int32, bitcast=True)
        known = (lower == upper) & ((lb < 0) == (ub < 0)) & valid
        cert = (L > high) & (L < float("inf")) & (L > float("-inf"))
        unknown_in_top = tl.sum((in_top & ~known).to(tl.int32), 0)
        cert = cert & ((unknown_in_top == 0) | (tl.load(need_ptr + b) == 0))
        # (scalar conditions below go through tl.where: the interpreter makes int of bool & bool)
        # replayed tie (k = 1)
        v = tl.max(tl.where(known, z, float("-inf")), 0)
        tie = known & (z == v)
        rest = tl.max(tl.where(tie, float("-inf"), upper), 0)
        by_tie = (k == 1) & (cert == 0) & (v > _rnd(tl.maximum(rest, tau), DT)) & (v < float("inf")) \
            & (v > float("-inf"))
        first = tl.min(tl.where(tie, ids, big), 0)
        out_ids = tl.where(kk == 0, tl.where(by_tie, first, out_ids), out_ids)
        out_vals = tl.where(kk == 0, tl.where(by_tie, v, out_vals), out_vals)
        ok = tl.load(ok_ptr + b) != 0
        live = tl.load(live_ptr + b) != 0
        cert = (cert | by_tie) & ok & live
        id0 = tl.sum(tl.where(kk == 0, out_ids, 0), 0)
        v0 = tl.sum(tl.where(kk == 0, out_vals, 0.0), 0)
        out_ids = tl.maximum(tl.where(kk < k, out_ids, id0), 0)  # (an empty slot's id on a failed row: 0)
        out_vals = tl.where(kk < k, out_vals, v0)
        tl.store(ids_ptr + b * KMAX + kk, out_ids)
        tl.store(vals_ptr + b * KMAX + kk, out_vals)
        code = tl.where(cert, 0, tl.where(ok == 0, 1, tl.where(live == 0, 2, 3)))
        tl.store(code_ptr + b, code.to(tl.int32))


def certify_rows_triton(z, lower, upper, cand, count, k, need, tau, ok, live, V: int, kmax: int, dtype: torch.dtype):
    B = z.shape[0]
    dev = z.device
    ids = torch.empty((B, kmax), dtype=torch.int64, device=dev)
    vals = torch.empty((B, kmax), dtype=torch.float32, device=dev)
    code = torch.empty(B, dtype=torch.int32, device=dev)
    if B:
        _certify_rows_kernel[(B,)](z, lower, upper, cand, count, k, need, tau, ok, live,
                                   ids, vals, code, V, DT=_tl_dtype(dtype), KMAX=kmax, CAPC=CAP, SUBC=SUB,
                                   **_launch())
    return ids, vals, code


def _launch() -> dict:
    """Launch options of every kernel: no fused multiply-add, so that each kernel's arithmetic is
    its reference's operation for operation (the bounds are sound either way)."""
    return {} if INTERPRET else {"enable_fp_fusion": False}


# ---- custom ops ------------------------------------------------------------------------------
def _use_triton(t: torch.Tensor) -> bool:
    """Triton on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``; else the reference."""
    return triton is not None and (t.is_cuda or INTERPRET)


def _pick(triton_fn, ref_fn):
    def run(first, *args):
        return (triton_fn if _use_triton(first) else ref_fn)(first, *args)
    return run


LIB = "vllm_csv_gpu"
_quantize_rows = _pick(quantize_rows_triton, quantize_rows_ref)
_screen_block_max = _pick(screen_block_max_triton, screen_block_max_ref)
_score_blocks = _pick(score_blocks_triton, score_blocks_ref)
_certify_rows = _pick(certify_rows_triton, certify_rows_ref)


@torch.library.custom_op(f"{LIB}::quantize_rows", mutates_args=())
def quantize_rows(h: torch.Tensor, certifiable: bool, rows_pad: int, wmax: float, babs_max: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1 (:func:`quantize_rows_ref`)."""
    return _quantize_rows(h, certifiable, rows_pad, wmax, babs_max)


@quantize_rows.register_fake
def _(h, certifiable, rows_pad, wmax, babs_max):
    B, d = h.shape
    f = [h.new_empty(B, dtype=torch.float32) for _ in range(3)]
    return (h.new_empty((rows_pad, d), dtype=torch.int8), *f, h.new_empty(B, dtype=torch.int8))


@torch.library.custom_op(f"{LIB}::screen_block_max", mutates_args=())
def screen_block_max(p: torch.Tensor, q: torch.Tensor, s: torch.Tensor, t: torch.Tensor,
                     bias: torch.Tensor | None, B: int) -> torch.Tensor:
    """Step 2 (:func:`screen_block_max_ref`)."""
    return _screen_block_max(p, q, s, t, bias, B)


@screen_block_max.register_fake
def _(p, q, s, t, bias, B):
    return p.new_empty((B, -(-q.shape[0] // SUB)), dtype=torch.float32)


@torch.library.custom_op(f"{LIB}::select_blocks", mutates_args=())
def select_blocks(bmax: torch.Tensor, k: torch.Tensor, hnorm: torch.Tensor, e: torch.Tensor, ok: torch.Tensor,
                  rad_max: float, act_coef: float, tiny: float, bslack_max: float, delta: float, limit: float,
                  babs_max: float, cap: int, kmax: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 3 (:func:`select_blocks_ref`); ``kmax >= max(k)`` (a power of two: one compiled
    kernel per bucket)."""
    consts = (rad_max, act_coef, tiny, bslack_max, delta, limit, babs_max)
    if _use_triton(bmax):
        return select_blocks_triton(bmax, k, hnorm, e, ok, consts, cap, kmax)
    return select_blocks_ref(bmax, k, hnorm, e, ok, consts, cap)


@select_blocks.register_fake
def _(bmax, k, hnorm, e, ok, *args):
    B = bmax.shape[0]
    return (bmax.new_empty((B, CAP), dtype=torch.int32), bmax.new_empty(B, dtype=torch.int32),
            bmax.new_empty(B), bmax.new_empty(B, dtype=torch.int8), bmax.new_empty(B, dtype=torch.int8))


@torch.library.custom_op(f"{LIB}::score_blocks", mutates_args=())
def score_blocks(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cand: torch.Tensor,
                 count: torch.Tensor, coef: float, gam: float, tiny32: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 4 (:func:`score_blocks_ref`)."""
    return _score_blocks(h, w, bias, cand, count, coef, gam, tiny32)


@score_blocks.register_fake
def _(h, w, bias, cand, count, coef, gam, tiny32):
    return tuple(h.new_empty((h.shape[0], CAP * SUB), dtype=torch.float32) for _ in range(3))


@torch.library.custom_op(f"{LIB}::certify_rows", mutates_args=())
def certify_rows(z: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor, cand: torch.Tensor,
                 count: torch.Tensor, k: torch.Tensor, need: torch.Tensor, tau: torch.Tensor, ok: torch.Tensor,
                 live: torch.Tensor, V: int, kmax: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 5 (:func:`certify_rows_ref`)."""
    return _certify_rows(z, lower, upper, cand, count, k, need, tau, ok, live, V, kmax, dtype)


@certify_rows.register_fake
def _(z, lower, upper, cand, count, k, need, tau, ok, live, V, kmax, dtype):
    B = z.shape[0]
    return (z.new_empty((B, kmax), dtype=torch.int64), z.new_empty((B, kmax)), z.new_empty(B, dtype=torch.int32))
