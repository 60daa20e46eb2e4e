"""The build of the CPU kernels (``csrc/cpu/*.cpp``): compiler flags, the build lock, loading, the
fake implementations and what the CPU offers them.

Every source registers its ops in one library, ``torch.ops.vllm_csv_cpu``, built as one
extension; each op's Python wrapper sits beside its torch reference in the module of its source
(:data:`KERNELS`). The extension is built on first use, once per machine, source version and
checkout, by torch's C++ extension loader (a C++ compiler and ninja, both already needed by
vLLM-CPU's own builds; about 45 s on 2 cores, 2-3 minutes under load, cached in
``TORCH_EXTENSIONS_DIR``), with
``-ffp-contract=off`` (the kernels round as their references round) and ``-fopenmp`` (ATen's
``parallel_for`` is header code: without it every kernel ran on one thread). Where that fails
(no compiler, a non-editable install without ``csrc/``), or with ``VLLM_CSV_CPU_KERNELS=0``,
:func:`load_ops` returns None, one log line says why, and every wrapper takes its torch
reference: the same certificate, slower. A build logs what it builds, where, and how long it
took; ``vllm-csv build-kernels`` (:func:`build_kernels`) runs it ahead of time, as ``run.sh`` and
``scripts/test.sh`` do, so that vLLM's worker finds the kernels built (no silent minutes at the
server's start).

Builds are serialised by a ``flock`` (:data:`BUILD_LOCK` in the build directory) that ends with
its holder: a process waits at most ``VLLM_CSV_CPU_BUILD_WAIT_S`` (:data:`BUILD_WAIT_S`) seconds
for another's build, then runs the reference; a ``lock`` file that torch's loader left behind
when a build was killed is removed, with a warning (``tests/test_kernel_build.py``).

What the CPU offers (AVX512-VNNI, AMX-INT8, SLEEF's vector exp) is detected by the kernels
themselves at run time, where they are compiled; :func:`cpu_supports` asks them.
``VLLM_CSV_CPU_ISA`` (:data:`ISA_ENV`: ``auto``, ``avx512`` or ``avx2``), read once when the
kernels load (``csrc/cpu/isa.h``), caps what they detect: with ``avx2`` they run their AVX2 paths,
report no AVX512-VNNI (the int8 screen takes its GEMM's AVX2 kernel, ``int8_avx2.cpp``; FBGEMM,
its fallback and the tests' comparison, is capped by ``FBGEMM_ENABLE_INSTRUCTIONS=AVX2``) and no
AMX, as on an AVX2-only CPU, so
that those paths are tested on AVX-512 machines (``tests/test_cpu_isa.py``); ``avx512`` leaves
out AMX only. :func:`isa_cap` says which cap holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .fbgemm import ACT_MAX, ACT_MIN, C_MAX_LOG2, C_MIN_LOG2

logger = logging.getLogger("vllm.csv_decode")

# ---- the constants compiled into the kernels (-D flags), one place each ----------------------
BLOCK = 256  # tokens a block: the candidate search reads y once, as block maxima (ops.select)
PANEL, GROUP = 32, 4  # the VNNI GEMM's weight panel: rows (two zmm tiles of int32 lanes), k a vpdpbusd lane sums
PREFETCH = 4096  # bytes ahead of the weight stream the screens' GEMMs prefetch on Intel CPUs (none
# elsewhere: csrc/cpu/int8_vnni.cpp, prefetch_ahead; measured: benchmarks/README.md, "Software prefetch")
K_MIN = -119  # rows with max|h| < 2^K_MIN are not quantised: t / 64 would be subnormal, which a flush-to-zero
# engine (x86 FTZ/DAZ: torch.set_flush_denormal) reads as 0, and the screen's centre with it (found by review:
# a row of max|h| ~ 1e-37 with a bias certified the bias's favourite; ops.rows.quantize_act7)

ENV = "VLLM_CSV_CPU_KERNELS"  # "0": always the torch reference
BUILD_WAIT_ENV, BUILD_WAIT_S = "VLLM_CSV_CPU_BUILD_WAIT_S", 600.0  # longest wait for another process's
# build of the kernels (a build takes 1-2 minutes here); after it, the torch reference runs
BUILD_LOCK = "csv_build.lock"  # the flock that serialises builds (load_ops, _build_lock)
ISA_ENV = "VLLM_CSV_CPU_ISA"  # auto | avx512 | avx2: the widest vector ISA the kernels may use (csrc/cpu/isa.h)
ISA_CAPS = {1: "avx2", 2: "avx512", 3: "auto"}  # the kernels' cpu_isa_cap() -> its name

KERNELS = {  # csrc/cpu/<source>: the module of its ops, each beside its torch reference (in build order)
    "csv_cpu.cpp": "vllm_csv.ops.step",  # the certified step's exact scores and certificate (and TORCH_LIBRARY)
    "select_cpu.cpp": "vllm_csv.ops.select",  # the certified step's candidate search
    "rows_cpu.cpp": "vllm_csv.ops.rows",  # the certified step's per-row passes (norms, intervals, quantisation)
    "int8_vnni.cpp": "vllm_csv.ops.int8_vnni",  # the int8 screen's GEMM (VNNI, AMX)
    "int8_avx2.cpp": "vllm_csv.ops.int8_vnni",  # the same GEMM with AVX2, where the CPU has no VNNI
    "gumbel_cpu.cpp": "vllm_csv.ops.noise",  # the draw certificate's pass over the vocabulary
    "live_cpu.cpp": "vllm_csv.ops.live",  # a sampled row's interval statistics and live columns
    "int4_vnni.cpp": "vllm_csv.ops.int4_vnni",  # the int4 screen's GEMM
    "nucleus_cpu.cpp": "vllm_csv.ops.masks",  # min-p's and top-k's cuts, top-p's sums
    "topk_cpu.cpp": "vllm_csv.ops.topk",  # each row's k largest values
    "bools_cpu.cpp": "vllm_csv.ops.bools",  # a bool mask's true positions
}
SOURCES = tuple(Path(__file__).resolve().parents[2] / "csrc" / "cpu" / f for f in KERNELS)
HEADERS = tuple(SOURCES[0].parent / f for f in ("isa.h", "fp32.h", "int8_layout.h"))  # included by sources (part of the build key)

FEATURES = {  # what the kernels may use on this CPU -> the op that answers (cpuid, and Linux's permission for AMX)
    "avx512_vnni": "int8_vnni_supported",  # AVX-512 F/BW and VNNI: the int8 GEMM
    "avx512_vnni_f16c": "int4_vnni_supported",  # the same and F16C: the int4 GEMM
    "avx2_fma": "int8_avx2_supported",  # AVX2 and FMA: the int8 GEMM's AVX2 kernel (where no VNNI)
    "avx2_fma_f16c": "int4_avx2_supported",  # the same and F16C: the int4 GEMM's AVX2 kernel
    "amx_int8": "int8_amx_supported",  # AMX-INT8 tiles, usable by this process: the int8 GEMM's batches
    "sleef_expf16": "unlisted_masses_supported",  # AVX-512 and libtorch's Sleef_expf16_u10: unlisted_masses
}

_state: dict = {}
_fakes: dict[str, Callable] = {}  # op name -> its fake implementation (register_fake), registered once loaded


def _extension():
    """``(name, flags)`` of the kernels' build for these sources, flags and checkout."""
    defs = dict(CSV_BLOCK=BLOCK, CSV_ACT_MIN=ACT_MIN, CSV_ACT_MAX=ACT_MAX, CSV_K_MIN=K_MIN,
                CSV_C_MIN_LOG2=C_MIN_LOG2, CSV_C_MAX_LOG2=C_MAX_LOG2, CSV_PANEL=PANEL, CSV_GROUP=GROUP,
                CSV_PREFETCH=PREFETCH)
    flags = ["-O3", "-ffp-contract=off", "-fopenmp", *(f"-D{k}={v}" for k, v in defs.items())]
    # One build directory per source version and checkout: two versions on one machine would
    # otherwise rebuild over each other's library, even while the other loads it, and two
    # checkouts of one version would rebuild it each time (ninja's commands hold the absolute
    # source paths).
    key = "\0".join([str(SOURCES[0].parent), *(f.read_text() for f in (*SOURCES, *HEADERS)), *flags])
    return f"vllm_csv_cpu_{hashlib.sha256(key.encode()).hexdigest()[:12]}", flags


def _build_directory(name: str) -> Path:
    """Where torch's loader builds the extension ``name`` (``TORCH_EXTENSIONS_DIR``), created."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


@contextlib.contextmanager
def _build_lock(build_dir: Path, wait_s: float):
    """Hold an exclusive ``flock`` on ``build_dir/BUILD_LOCK`` for one build, waiting ``wait_s``
    at most (``TimeoutError`` after that).

    torch's loader guards a build with a lock *file* (``build_dir/lock``, its ``FileBaton``) that
    a process killed mid-build leaves behind; every later load then waits on it forever (a
    server that never starts). A ``flock`` ends with its holder. Every build of these sources
    in this checkout holds this one, so a ``lock`` file found while holding it is such a
    leftover: it is removed, with a warning.
    """
    fd = os.open(build_dir / BUILD_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    waiting = True
                    logger.info("CSV CPU kernels: another process is building them in %s; waiting for it "
                                "(at most %g s)", build_dir, wait_s)
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"another process held {build_dir / BUILD_LOCK} for {wait_s:g} s "
                                       f"({BUILD_WAIT_ENV} sets the wait)") from None
                time.sleep(0.1)
        baton = build_dir / "lock"
        if baton.exists():
            logger.warning("CSV CPU kernels: removing %s, left by a build that did not finish", baton)
            baton.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock


def load_ops():
    """``torch.ops.vllm_csv_cpu`` (built on first use), or None with the reason logged once."""
    if "ops" in _state:
        return _state["ops"]
    ops, why = None, None
    if os.environ.get(ENV, "1") == "0":
        why = f"{ENV}=0"
    elif not all(f.exists() for f in (*SOURCES, *HEADERS)):
        why = f"{SOURCES[0].parent} is not installed (an editable install of vllm-csv has it)"
    else:
        try:
            from torch.utils.cpp_extension import load

            name, flags = _extension()
            build_dir = _build_directory(name)
            with _build_lock(build_dir, float(os.environ.get(BUILD_WAIT_ENV, BUILD_WAIT_S))):
                built = (build_dir / f"{name}.so").exists()  # (torch's loader names the library so)
                if not built:
                    logger.info("CSV CPU kernels: building %d sources of %s into %s (first use of this "
                                "version on this machine: 1-3 minutes; later starts load the build from "
                                "there)", len(SOURCES), SOURCES[0].parent, build_dir)
                t0 = time.monotonic()
                load(name, [str(f) for f in SOURCES], is_python_module=False, verbose=False,
                     extra_cflags=flags, build_directory=str(build_dir))
                if not built:
                    logger.info("CSV CPU kernels: built in %.0f s (cached in %s)", time.monotonic() - t0, build_dir)
            ops = torch.ops.vllm_csv_cpu
        except Exception as e:  # no compiler, no ninja, a build error, a build that holds the lock too long
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if ops is None:
        logger.info("CSV CPU kernels unavailable (%s); the certified step uses its torch reference", why)
    _state["ops"] = ops
    if ops is not None:
        _log_isa_cap(ops)
        for op in list(_fakes):
            _register_fake(op)
    return ops


def _log_isa_cap(ops) -> None:
    """Say which cap :data:`ISA_ENV` put on the kernels (nothing when none), and warn of a value
    the kernels do not know (they take it as ``auto``)."""
    raw = os.environ.get(ISA_ENV)
    if raw is not None and raw.lower() not in ISA_CAPS.values():
        logger.warning("%s=%r is not one of %s: the CSV CPU kernels use what the CPU has", ISA_ENV, raw,
                       ", ".join(sorted(ISA_CAPS.values())))
    cap = ISA_CAPS.get(int(ops.cpu_isa_cap()), "auto")
    if cap == "avx2":
        fbgemm = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS")
        logger.info("CSV CPU kernels: vector ISA capped at avx2 (%s); no AVX-512, no AMX: the int8 screen takes "
                    "its AVX2 kernel (FBGEMM, where it falls back, %s)", ISA_ENV,
                    f"FBGEMM_ENABLE_INSTRUCTIONS={fbgemm}" if fbgemm else
                    "keeps its AVX-512 kernels unless FBGEMM_ENABLE_INSTRUCTIONS=AVX2")
    elif cap != "auto":
        logger.info("CSV CPU kernels: vector ISA capped at %s (%s); no AMX", cap, ISA_ENV)


def isa_cap() -> str | None:
    """The cap the kernels run under (``"auto"``, ``"avx512"``, ``"avx2"``; :data:`ISA_ENV`, read
    once when they loaded), or None where they are not built."""
    ops = load_ops()
    return None if ops is None else ISA_CAPS.get(int(ops.cpu_isa_cap()), "auto")


def no_avx512_reason(what: str) -> str:
    """Why the kernels may not use ``what`` (an AVX-512 feature) here: the CPU lacks it, or
    :data:`ISA_ENV` caps them below it."""
    cap = isa_cap()
    if cap == "avx2":
        return f"{ISA_ENV}=avx2 caps the CPU kernels below {what}"
    return f"this CPU has no {what}"


def build_kernels() -> bool:
    """Build (or find built) and load the kernels now, saying so on stderr whatever the logging
    set-up: ``vllm-csv build-kernels``, which ``run.sh`` and ``scripts/test.sh`` run after the
    install so that no server or test waits on the build unannounced. True where they loaded."""
    import sys

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[vllm-csv] %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    propagate, logger.propagate = logger.propagate, False  # (once, not once more by a root handler)
    try:
        ops = load_ops()
        if ops is not None:
            logger.info("CSV CPU kernels: ready (%s)", _build_directory(_extension()[0]))
        return ops is not None
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def kernels_available() -> bool:
    """Whether the CPU kernels are built and loaded in this process (:func:`load_ops`)."""
    return load_ops() is not None


def uses_kernels(t: torch.Tensor) -> bool:
    """Whether the ops on ``t`` run the fused kernels (else their torch references)."""
    return t.device.type == "cpu" and load_ops() is not None


def cpu_supports(feature: str) -> bool:
    """Whether the kernels may use ``feature`` (a key of :data:`FEATURES`) on this CPU, as they
    detect it at run time; False where they are not built."""
    ops = load_ops()
    return ops is not None and bool(getattr(ops, FEATURES[feature])())


# ---- fake implementations (shapes only: tracing, torch.compile) -------------------------------
def fake(op: str) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` is the fake implementation of ``torch.ops.vllm_csv_cpu.<op>`` (shapes
    only), registered with ``torch.library.register_fake`` once the kernels are loaded (at once
    if they already are; never where they are not). Each op module declares its ops' fakes beside
    them."""
    def register(fn: Callable) -> Callable:
        _fakes[op] = fn
        if _state.get("ops") is not None:
            _register_fake(op)
        return fn
    return register


def _register_fake(op: str) -> None:
    done = _state.setdefault("fakes", set())
    if op not in done:
        torch.library.register_fake("vllm_csv_cpu::" + op)(_fakes[op])
        done.add(op)
