"""Keep freed large buffers in the heap on CPU (glibc ``mallopt``).

Each decoding step allocates a few ``[B, V]`` tensors. glibc serves blocks above
``M_MMAP_THRESHOLD`` with fresh ``mmap`` pages and returns them on free, so every step
pays a page fault per 4 KiB (measured: a ``[64, 32768]`` fp32 step spends about half of
its time faulting). Raising the mmap and trim thresholds lets the heap reuse those
pages. The heap keeps at most :data:`TRIM` of free memory at its top (a few steps' buffers,
``[64, 151936]`` fp32 is 39 MB) and grows by :data:`TOP_PAD` at a time (now 256 MiB and
16 MiB, blocks below 1 GiB from the heap; measured with an earlier, larger setting, a trim
threshold of 2 GiB and 64 MiB of padding, a server under load kept about 65 MB more than plain
vLLM: 64 clients, 5 minutes, RSS +6.1% against +4.5%). The settings are the process's (glibc
has one heap policy), applied when the first CPU head is built. Set
``VLLM_CSV_MALLOC_TUNING=0`` to leave the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP, TRIM, TOP_PAD = 1 << 30, 256 << 20, 16 << 20  # bytes
_done = False


def tune_malloc() -> bool:
    """Apply the thresholds once per process; returns whether glibc accepted them."""
    global _done
    if _done or os.environ.get("VLLM_CSV_MALLOC_TUNING", "1") == "0":
        return _done
    _done = True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP) == 1
        ok &= libc.mallopt(M_TRIM_THRESHOLD, TRIM) == 1
        ok &= libc.mallopt(M_TOP_PAD, TOP_PAD) == 1
        return bool(ok)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
