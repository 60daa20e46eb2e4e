"""Step 2 of the fused step, :func:`screen_block_max` (``[ceil(V / BV)]`` programs): the exact
int8 GEMM ``<q_i, p_b>`` on tensor cores, its epilogue the screen's center ``y = fl(fl(fl(acc)
t_b) s_i) (+ b_i)`` and the maximum of each block of ``SUB`` tokens. It writes ``[B, ceil(V /
SUB)]`` maxima, never ``[B, V]``. Beside it: its torch reference :func:`screen_block_max_ref`,
its tile tuner (:data:`SCREEN_CONFIGS`, :func:`screen_config`) and its custom op
``torch.ops.vllm_csv_gpu.screen_block_max``."""

from __future__ import annotations

import logging
import math
import os

import torch

from .common import INTERPRET, LIB, SUB, _launch, _pick, tl, triton


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


_screen_block_max = _pick(screen_block_max_triton, screen_block_max_ref)


@torch.library.custom_op(f"{LIB}::screen_block_max", mutates_args=())
def screen_block_max(p: torch.Tensor, q: torch.Tensor, s: torch.Tensor, t: torch.Tensor,
                     bias: torch.Tensor | None, B: int) -> torch.Tensor:
    """Step 2 (:func:`screen_block_max_ref`)."""
    return _screen_block_max(p, q, s, t, bias, B)


@screen_block_max.register_fake
def _(p, q, s, t, bias, B):
    return p.new_empty((B, -(-q.shape[0] // SUB)), dtype=torch.float32)
