"""Step 2 of the fused step, :func:`screen_block_max` (``[ceil(V / BV)]`` programs): the exact
int8 GEMMs ``<q_i, p_b>`` and ``<q_i, p2_b>`` on tensor cores (one weight tile, both codes of the
row, :mod:`.quantize`), their epilogue every token's bounds of its dense logit (the screen's
center ``y = fl(fl(fl(acc) t_b + fl(acc2) t2_b) s_i) (+ b_i)`` widened by the token's own radius,
norm and the row's activation error, :func:`screen_block_max_ref`) and, per block of ``SUB``
tokens, the largest upper and the largest lower bound. It writes two ``[B, ceil(V / SUB)]``
arrays, never ``[B, V]``. Beside it: its torch reference :func:`screen_block_max_ref`, its tile
tuner (:data:`SCREEN_CONFIGS`, :func:`screen_config`) and its custom op
``torch.ops.vllm_csv_gpu.screen_block_max``."""

from __future__ import annotations

import logging
import math
import os

import torch

from .common import INTERPRET, LIB, SUB, _launch, _pick, tl, triton

# the evaluation margin of the bounds' own fp32 arithmetic (screen_block_max_ref's docstring)
EVAL_MARGIN = 2.0**-18


def screen_block_max_ref(p: torch.Tensor, q: torch.Tensor, s: torch.Tensor, t: torch.Tensor,
                         bias: torch.Tensor | None, B: int, hn: torch.Tensor, e: torch.Tensor,
                         rad: torch.Tensor, nrm: torch.Tensor, delta: float, cst: float):
    """``(umax, lmax)``, each ``[B, ceil(V / SUB)]`` fp32: per block of ``SUB`` tokens, the largest
    upper and the largest lower bound of a token's dense logit (``-inf`` past ``V``).

    Token ``i`` of row ``b``: ``p [2, BB, d]`` int8 and ``t [2, B]`` the row's two codes and
    scales (:func:`~.quantize.quantize_rows_ref`: ``h ~ t[0] p[0] + t[1] p[1]``), ``q [V, d]``
    int8 with row scales ``s [V]``, ``acc_j = <q_i, p[j]_b>`` exact in int32, ``bias`` fp32 or
    None. The screen's value ``y = fl(fl(fl(acc_0) t[0] + fl(acc_1) t[1]) s_i) (+ b_i)`` is
    within ``y_r -+ 7 u A`` of the real ``y_r = s_i (t[0] acc_0 + t[1] acc_1) (+ b_i)`` (seven
    roundings, ``u = 2^-24``, each at most ``u`` of a partial result no larger than ``A = s_i
    (|fl(acc_0) t[0]| + |fl(acc_1) t[1]|) + |b_i|``), and the dense accumulator within ``y_r -+
    (delta A + a + cst)`` by the head's error model (:mod:`vllm_csv.head.error_model`) token by
    token: ``a = rad_i ||h_b|| + nrm_i e_b``, ``rad [V]`` the token's total radius (weight
    quantisation and the dense GEMM's accumulation,
    :meth:`~vllm_csv.head.error_model.ErrorModel.rad_total`), ``nrm [V]`` its dequantised row's
    norm times ``1 + delta``, ``e_b`` the row's activation error, ``hn = ||h_b||`` rounded up,
    ``cst`` the head's ``tiny`` plus its largest bias slack, all fp32 values rounded up
    (:class:`~.step.FusedStep`); not with the largest radius and norm of the vocabulary for
    every token, which on learned heads left most rows too many candidates.

    The bounds' own fp32 arithmetic: ``U = fl(y + m + a + cst) + fl(S 2^-18)`` and ``L = fl(y - m
    - a - cst) - fl(S 2^-18)`` with ``m = fl(delta A)``, ``S = fl(A + m + a + cst)``, left to right.
    With ``y``'s seven roundings, ``m``'s one, ``a``'s three and the three additions, at most
    fourteen roundings of ``u`` of at most ``S (1 + 2^-20)`` each separate ``U`` from the real
    bound; ``2^-18 S`` is four times that, with the last addition's own rounding, and ``S >= cst >=
    2^-125`` makes it cover the products that underflow (``2^-149`` each). Nothing here divides or
    takes a transcendental: the kernel's operations are these, in this order, and its results
    are these bits (``enable_fp_fusion`` off)."""
    V = q.shape[0]
    acc0 = (p[0, :B].double() @ q.double().T).float()  # exact: |acc| <= 127^2 d < 2^31 < 2^53
    acc1 = (p[1, :B].double() @ q.double().T).float()
    y0 = acc0 * t[0][:, None]
    y1 = acc1 * t[1][:, None]
    y = y0 + y1
    y = y * s[None, :]
    A = y0.abs() + y1.abs()
    A = A * s[None, :]
    if bias is not None:
        y = y + bias[None, :]
        A = A + bias.abs()[None, :]
    a = rad[None, :] * hn[:, None]
    a = a + nrm[None, :] * e[:, None]
    m = A * delta
    S = A + m
    S = S + a
    S = S + cst
    M = S * EVAL_MARGIN
    U = y + m
    U = U + a
    U = U + cst
    U = U + M
    L = y - m
    L = L - a
    L = L - cst
    L = L - M
    pad = (-V) % SUB
    U = torch.nn.functional.pad(U, (0, pad), value=-math.inf)
    L = torch.nn.functional.pad(L, (0, pad), value=-math.inf)
    return U.view(B, -1, SUB).amax(2), L.view(B, -1, SUB).amax(2)


if triton is not None:
    from .common import _pdl_wait

    @triton.jit
    def _screen_block_max_kernel(q_ptr, p_ptr, s_ptr, t_ptr, bias_ptr, hn_ptr, e_ptr, rad_ptr, nrm_ptr, umax_ptr,
                                 lmax_ptr, B, V, d, ldq, nb, delta, cst, margin, HAS_BIAS: tl.constexpr,
                                 BB: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, SUBC: tl.constexpr,
                                 BT: tl.constexpr, PDL: tl.constexpr):
        _pdl_wait(PDL)  # (common._launch: PDL launches wait for the kernel before)
        # program (weight tile vt, batch tile bt): BT of the BB rows, the batch tiles of a weight
        # tile adjacent (their re-reads of it hit L2); BT = BB: one program a weight tile
        pid = tl.program_id(0)
        vt = pid // (BB // BT)
        rows = vt * BV + tl.arange(0, BV)
        bs = (pid % (BB // BT)) * BT + tl.arange(0, BT)
        ks = tl.arange(0, BK)
        rmask = rows < V
        acc = tl.zeros([BV, BT], dtype=tl.int32)
        acc2 = tl.zeros([BV, BT], dtype=tl.int32)
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * ldq
        p_cols = p_ptr + bs[None, :] * d
        for k0 in range(0, d, BK):  # one weight tile, both codes of every row
            km = k0 + ks < d
            a = tl.load(q_rows + (k0 + ks)[None, :], mask=rmask[:, None] & km[None, :], other=0)
            b = tl.load(p_cols + (k0 + ks)[:, None], mask=km[:, None], other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            b2 = tl.load(p_cols + BB * d + (k0 + ks)[:, None], mask=km[:, None], other=0)
            acc2 = tl.dot(a, b2, acc2, out_dtype=tl.int32)
        bm = bs < B
        t = tl.load(t_ptr + bs, mask=bm, other=0.0)
        t2 = tl.load(t_ptr + B + bs, mask=bm, other=0.0)
        s = tl.load(s_ptr + rows, mask=rmask, other=0.0)
        y0 = acc.to(tl.float32) * t[None, :]
        y1 = acc2.to(tl.float32) * t2[None, :]
        y = y0 + y1
        y = y * s[:, None]
        A = tl.abs(y0) + tl.abs(y1)
        A = A * s[:, None]
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rows, mask=rmask, other=0.0)[:, None]
            y = y + bias
            A = A + tl.abs(bias)
        hn = tl.load(hn_ptr + bs, mask=bm, other=0.0)
        ee = tl.load(e_ptr + bs, mask=bm, other=0.0)
        w = tl.load(rad_ptr + rows, mask=rmask, other=0.0)[:, None] * hn[None, :]
        w = w + tl.load(nrm_ptr + rows, mask=rmask, other=0.0)[:, None] * ee[None, :]
        m = A * delta
        S = A + m
        S = S + w
        S = S + cst
        M = S * margin
        u = y + m
        u = u + w
        u = u + cst
        u = u + M
        lo = y - m
        lo = lo - w
        lo = lo - cst
        lo = lo - M
        u = tl.where(rmask[:, None], u, float("-inf"))
        lo = tl.where(rmask[:, None], lo, float("-inf"))
        if BV == SUBC:
            mu = tl.max(u, 0)[None, :]
            ml = tl.max(lo, 0)[None, :]
        else:
            mu = tl.max(tl.reshape(u, (BV // SUBC, SUBC, BT)), 1)
            ml = tl.max(tl.reshape(lo, (BV // SUBC, SUBC, BT)), 1)
        blk = vt * (BV // SUBC) + tl.arange(0, BV // SUBC)
        out = bs[None, :] * nb + blk[:, None]
        om = (bs[None, :] < B) & (blk[:, None] < nb)
        tl.store(umax_ptr + out, mu, mask=om)
        tl.store(lmax_ptr + out, ml, mask=om)


# (BV, BK, num_warps, num_stages, BT) tried for the screen on a GPU, once per (V, d, batch tile BB):
# the fastest that compiles is kept (:func:`screen_config`). BT, the batch rows a program holds
# (0: all BB): at 64 rows two int32 accumulators and the epilogue's fp32 tiles of [BV, BB] crowd
# the registers (H200, c8916a3: the screen took 78 us at B = 64 against 45 at B <= 8, the int8
# GEMM 54), so wide batch tiles are also tried split, each program re-reading its weight tile
# from L2; a split only where BT < BB (:func:`screen_configs`)
SCREEN_CONFIGS = ((64, 128, 4, 4, 0), (64, 256, 4, 4, 0), (64, 256, 4, 6, 0), (64, 512, 4, 3, 0),
                  (128, 128, 4, 4, 0), (128, 256, 8, 3, 0), (128, 128, 8, 5, 0), (128, 256, 4, 4, 0),
                  (64, 256, 4, 4, 16), (128, 128, 4, 4, 16), (64, 256, 4, 4, 32), (128, 128, 4, 4, 32),
                  (128, 256, 8, 3, 32))
_INTERPRETED_CONFIG = (SUB, 64, 4, 1, 0)


def screen_configs(BB: int) -> tuple:
    """:data:`SCREEN_CONFIGS` for a batch tile of ``BB`` rows: those holding all of them, and the
    splits into ``BT < BB`` rows a program."""
    return tuple(c for c in SCREEN_CONFIGS if c[4] == 0 or (c[4] < BB and BB % c[4] == 0))


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
        for cfg in screen_configs(key[2]):
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


def screen_block_max_triton(p, q, s, t, bias, B: int, hn, e, rad, nrm, delta: float, cst: float,
                            config: tuple | None = None):
    """The kernel's launch; ``config`` (one of :data:`SCREEN_CONFIGS`) in place of
    :func:`screen_config`'s (tests: every tile shape gives the reference's bits)."""
    V, d = q.shape
    nb = triton.cdiv(V, SUB)
    umax = torch.empty((B, nb), dtype=torch.float32, device=q.device)
    lmax = torch.empty((B, nb), dtype=torch.float32, device=q.device)
    BB = p.shape[1]  # (p: [2, BB, d], the two codes of every row of the batch tile)
    assert q.stride(1) == 1 and p.is_contiguous()

    def launch(cfg):
        bv, bk, warps, stages, bt = cfg
        bt = bt or BB
        _screen_block_max_kernel[(triton.cdiv(V, bv) * (BB // bt),)](
            q, p, s, t, bias if bias is not None else s, hn, e, rad, nrm, umax, lmax, B, V, d, q.stride(0), nb,
            delta, cst, EVAL_MARGIN, HAS_BIAS=bias is not None, BB=BB, BV=bv, BK=bk, SUBC=SUB, BT=bt,
            num_warps=warps, num_stages=stages, **_launch())

    launch(config if config is not None else screen_config((V, d, BB, str(q.device)), launch))
    return umax, lmax


_screen_block_max = _pick(screen_block_max_triton, screen_block_max_ref)


@torch.library.custom_op(f"{LIB}::screen_block_max", mutates_args=())
def screen_block_max(p: torch.Tensor, q: torch.Tensor, s: torch.Tensor, t: torch.Tensor,
                     bias: torch.Tensor | None, B: int, hn: torch.Tensor, e: torch.Tensor, rad: torch.Tensor,
                     nrm: torch.Tensor, delta: float, cst: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2 (:func:`screen_block_max_ref`)."""
    return _screen_block_max(p, q, s, t, bias, B, hn, e, rad, nrm, delta, cst)


@screen_block_max.register_fake
def _(p, q, s, t, bias, B, hn, e, rad, nrm, delta, cst):
    nb = -(-q.shape[0] // SUB)
    return p.new_empty((B, nb), dtype=torch.float32), p.new_empty((B, nb), dtype=torch.float32)
