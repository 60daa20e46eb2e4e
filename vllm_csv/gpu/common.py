"""What the fused step's kernels share: the block layout (:data:`SUB` tokens a block,
:data:`CAP` candidate blocks a row), whether Triton is here (:func:`available`), the dispatch of
each custom op between its Triton launcher and its torch reference (:func:`_use_triton`,
:func:`_pick`), the launch options (:func:`_launch`), and the model-dtype bit helpers the
kernels call (:func:`_raw` on the host; ``_widen``, ``_rnd`` and ``_slots``, ``@triton.jit``, in the kernels).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - torch wheels without Triton
    triton = tl = None

SUB = 64  # tokens a block: the screen's block maxima, the candidate lists, the scoring programs
CAP = 16  # candidate blocks a row may keep (SUB * CAP tokens scored at most); more: not live
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LIB = "vllm_csv_gpu"  # the custom ops' namespace: torch.ops.vllm_csv_gpu.<kernel>


def available() -> bool:
    """Triton is importable (the step runs compiled on CUDA, or interpreted on the CPU)."""
    return triton is not None


def batch_tile(B: int) -> int:
    """The GEMM's batch tile (tensor cores want at least 16 columns): the rows of ``p``."""
    return max(16, triton.next_power_of_2(B)) if triton is not None else max(16, B)


def slot_ids(cand: torch.Tensor, count: torch.Tensor, V: int) -> torch.Tensor:
    """``[B, CAP * SUB]`` int64 token id of each scored slot, ``-1`` where the slot is empty."""
    B = cand.shape[0]
    used = torch.arange(CAP, device=cand.device)[None] < count[:, None].clamp(max=CAP)
    ids = cand.long()[:, :, None] * SUB + torch.arange(SUB, device=cand.device)
    ids = torch.where(used[:, :, None] & (ids < V) & (cand[:, :, None] >= 0), ids, -1)
    return ids.view(B, CAP * SUB)


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
    def _slots(cand_ptr, count_ptr, b, V, SUBC: tl.constexpr, CAPC: tl.constexpr):
        """Row ``b``'s scored slots, :func:`slot_ids` in a kernel: ``(sl, ids, valid)``, the
        ``CAPC * SUBC`` slot indices, their int64 token ids and whether each holds a token (a
        used candidate block, a block id set, the token inside the vocabulary)."""
        sl = tl.arange(0, CAPC * SUBC)
        n = tl.minimum(tl.load(count_ptr + b), CAPC)
        blk = tl.load(cand_ptr + b * CAPC + sl // SUBC)
        ids = blk.to(tl.int64) * SUBC + (sl % SUBC)
        valid = (sl // SUBC < n) & (blk >= 0) & (ids < V)
        return sl, ids, valid

    try:  # the grid-dependency intrinsics (CUDA, compute capability 9+): imported here, so that a
        # Triton without them never meets the names in a kernel's source
        from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch, gdc_wait as _gdc_wait
        HAS_PDL = True
    except Exception:  # noqa: BLE001 - another backend, an older Triton: no dependent launches
        HAS_PDL = False

        @triton.jit
        def _gdc_wait():
            pass

        @triton.jit
        def _gdc_launch():
            pass

    @triton.jit
    def _pdl_wait(PDL: tl.constexpr):
        """A kernel's first statement: launched dependently (:func:`pdl`), wait until the kernel
        before it has finished and its writes are visible, then let the next one launch. Before
        the wait nothing is read or written, so the overlap hides launch latency only: no kernel
        reads a predecessor's output early, and none writes memory that a predecessor (or the
        caching allocator's reuse of it) may still read."""
        if PDL:
            _gdc_wait()
            _gdc_launch()

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
else:  # pragma: no cover - torch wheels without Triton
    HAS_PDL = False


def _tl_dtype(dtype: torch.dtype):
    """Triton's name of a model dtype."""
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def pdl() -> bool:
    """Whether the kernels launch with programmatic dependent launch (``VLLM_CSV_GPU_PDL=1``, on a
    GPU of compute capability 9 or more, compiled): each kernel's launch then overlaps the end
    of the one before it, and the kernel waits for that one (``griddepcontrol.wait``: its
    whole grid finished, its writes visible) before touching any global memory (``_pdl_wait``,
    the first statement of every kernel). Off by default until a GPU has timed it."""
    global _PDL
    if _PDL is None:
        _PDL = (HAS_PDL and not INTERPRET and os.environ.get("VLLM_CSV_GPU_PDL", "0") == "1"
                and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9)
    return _PDL


_PDL: bool | None = None


def _launch() -> dict:
    """Launch options of every kernel: no fused multiply-add, so that each kernel's arithmetic is
    its reference's operation for operation (the bounds are sound either way); the kernel's
    ``PDL`` flag and, with it, the dependent launch (:func:`pdl`)."""
    if INTERPRET:
        return {"PDL": False}
    on = pdl()
    return {"enable_fp_fusion": False, "PDL": on, **({"launch_pdl": True} if on else {})}


def _use_triton(t: torch.Tensor) -> bool:
    """Triton on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``; else the reference."""
    return triton is not None and (t.is_cuda or INTERPRET)


def _pick(triton_fn, ref_fn):
    """A custom op's body: ``triton_fn`` where :func:`_use_triton` holds for its first tensor, else
    ``ref_fn``."""
    def run(first, *args):
        return (triton_fn if _use_triton(first) else ref_fn)(first, *args)
    return run
