"""The small passes of the certified step on the CPU, fused (``csrc/cpu/csv_cpu.cpp``), beside
their torch references.

Why fused: the screen's GEMM streams the whole int8 head (50-150 MB) through the caches and
evicts the code of the torch ops that follow; each distinct op then runs cold (30-200 us
instead of 2-10 us), and the reference path below runs about 60 of them around each GEMM:
1-2 ms a step, as much as half the GEMM itself at V = 65536. The kernels compute the same
numbers in six calls. They are built once per machine with torch's C++ extension loader (a
C++ compiler and ninja, both already needed by vLLM-CPU's own builds; about 45 s on 2 cores, cached in
``TORCH_EXTENSIONS_DIR``). Where that fails, or with ``VLLM_CSV_CPU_KERNELS=0``, every call takes
the torch reference, and one log line says why.

Ops (registered as ``torch.ops.vllm_csv_cpu.*`` with fake implementations, so they trace):

* :func:`prepare_rows`: ``||h_b||`` rounded up and which rows may be certified;
* :func:`interval_rows`: the screen's intervals around its centres, in one pass (the sampling
  path's bounds on every token, :meth:`vllm_csv.head.CertifiedHead._intervals`);
* :func:`quantize_act7`: the FBGEMM screen's activation quantisation (its docstring's ``t_b``,
  ``p_b``, ``e_b`` and the folded scale ``c``);
* :func:`select_candidates`: the two-sided threshold search of
  :meth:`vllm_csv.head.CertifiedHead._select_two_sided`;
* :func:`score_intervals`: the float64 dot products and their fp32 interval of
  :meth:`vllm_csv.head.CertifiedHead._score` (and, without a bias, the engine's rounding);
* :func:`certify_topk`: the top-k certificate of :meth:`vllm_csv.head.CertifiedHead._certify`
  for a plain engine (no soft-cap or scale) and greedy rows;
* :func:`finish_selection`: the ``[B, V]`` output of the certified rows and each row's outcome;
* ``noise_candidates`` (:mod:`vllm_csv.ops.noise`, ``csrc/cpu/gumbel_cpu.cpp``): the sampling
  certificate's pass over the vocabulary (noise hash and level thresholds), with ``row_stats``
  and ``pack_live`` (each row's live columns);
* ``min_p_cut`` and ``top_k_cut`` (:mod:`vllm_csv.ops.masks`, ``csrc/cpu/nucleus_cpu.cpp``):
  vLLM's min-p and top-k masks on the sampling certificate's bounds, given each row's thresholds,
  ``top_p_sums``, the four masses top-p decides a token on, over its whole row, and
  ``unlisted_masses``, a row's masses off top-p's list of tokens (float64 sums in another order
  than the reference's; ``unlisted_masses`` takes SLEEF's fp32 exp from libtorch, as torch's
  own exp on AVX-512 CPUs, and runs only where it is there);
* ``row_topk`` (:mod:`vllm_csv.ops.topk`, ``csrc/cpu/topk_cpu.cpp``): each row's k largest
  values and their columns, as ``torch.topk``;
* ``flat_nonzero`` (:mod:`vllm_csv.ops.bools`, ``csrc/cpu/bools_cpu.cpp``): the flat positions of
  a bool tensor's true elements, as ``nonzero``.

Each kernel follows its reference operation by operation (fp32 where the reference is fp32,
scalars rounded to fp32 as torch rounds a Python number), so the outputs agree bit for bit,
except the float64 sums (norms, dot products), which the kernels take in index order and
torch in its own: the bounds hold for any order (see each reference), and the two may differ
in the last bit of ``hnorm``, ``e``, ``a``, ``lo``, ``hi`` (``tests/test_cpu_step.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..fp import FP32_UNIT_ROUNDOFF, round_down32, round_up32
from ..vocabulary import KERNEL_REASONS as REASONS  # noqa: F401  (finish_selection's codes, in order)
from .fbgemm import ACT_MAX, ACT_MIN, C_MAX_LOG2, C_MIN_LOG2

logger = logging.getLogger("vllm.csv_decode")

BLOCK = 256  # tokens a block: the candidate search reads y once, as block maxima
PANEL, GROUP = 32, 4  # the VNNI GEMM's weight panel: rows (two zmm tiles of int32 lanes), k a vpdpbusd lane sums
PREFETCH = 4096  # bytes ahead of the weight stream the screens' GEMMs prefetch on Intel CPUs (none
# elsewhere: csrc/cpu/int8_vnni.cpp, prefetch_ahead; measured: benchmarks/README.md, "Software prefetch")
K_MIN = -143  # rows with max|h| < 2^K_MIN are not quantised (t / 64 would not be an fp32)
S_MIN = 2.0**-126  # smallest normal fp32
ENV = "VLLM_CSV_CPU_KERNELS"  # "0": always the torch reference
BUILD_WAIT_ENV, BUILD_WAIT_S = "VLLM_CSV_CPU_BUILD_WAIT_S", 600.0  # longest wait for another process's
# build of the kernels (a build takes 1-2 minutes here); after it, the torch reference runs
BUILD_LOCK = "csv_build.lock"  # the flock that serialises builds (load_ops, _build_lock)
SOURCES = tuple(Path(__file__).resolve().parents[2] / "csrc" / "cpu" / f
                for f in ("csv_cpu.cpp", "int8_vnni.cpp", "gumbel_cpu.cpp", "int4_vnni.cpp", "nucleus_cpu.cpp",
                          "topk_cpu.cpp", "bools_cpu.cpp"))

_state: dict = {}


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
    key = "\0".join([str(SOURCES[0].parent), *(f.read_text() for f in SOURCES), *flags])
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
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
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
    elif not all(f.exists() for f in SOURCES):
        why = f"{SOURCES[0].parent} is not installed (an editable install of vllm-csv has it)"
    else:
        try:
            from torch.utils.cpp_extension import load

            name, flags = _extension()
            build_dir = _build_directory(name)
            with _build_lock(build_dir, float(os.environ.get(BUILD_WAIT_ENV, BUILD_WAIT_S))):
                load(name, [str(f) for f in SOURCES], is_python_module=False, verbose=False,
                     extra_cflags=flags, build_directory=str(build_dir))
            ops = torch.ops.vllm_csv_cpu
        except Exception as e:  # no compiler, no ninja, a build error, a build that holds the lock too long
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if ops is None:
        logger.info("CSV CPU kernels unavailable (%s); the certified step uses its torch reference", why)
    _state["ops"] = ops
    if ops is not None:
        _register_fakes()
    return ops


def kernels_available() -> bool:
    return load_ops() is not None


def uses_kernels(t: torch.Tensor) -> bool:
    """Whether the ops on ``t`` run the fused kernels (else their torch references)."""
    return t.device.type == "cpu" and load_ops() is not None


# ---- prepare_rows ---------------------------------------------------------------------------
def prepare_rows_ref(h: torch.Tensor, certifiable: bool):
    """``(hm, hnorm, ok)`` for ``h [B, d]``: ``hnorm [B]`` fp32 = ``||h_b||`` computed in float64
    and rounded up (0 where not ``ok``); ``ok [B]`` bool = the norm is finite (no NaN/inf in
    ``h_b``, no overflow), no entry is below fp32's smallest normal but zero (an engine that reads
    subnormal inputs as zero, as AVX512-BF16 and AMX dot products do, would drop it:
    :func:`vllm_csv.dense_engine.flush_slack`) and ``certifiable``; ``hm`` = ``h`` with the rows
    that are not ``ok`` zeroed, so that they add no candidates."""
    n64 = h.double().norm(dim=1)
    n32 = round_up32(n64)
    ok = torch.isfinite(n32) & ~has_subnormal(h, dim=1)
    if not certifiable:
        ok = torch.zeros_like(ok)
    return h.masked_fill(~ok[:, None], 0), n32.masked_fill(~ok, 0), ok


def has_subnormal(x: torch.Tensor, dim: int | None = None, chunk: int = 8192) -> torch.Tensor:
    """Whether ``x`` holds a non-zero value below fp32's smallest normal (along ``dim``, or at all:
    then in chunks of rows, so that a head's check makes no temporaries of its size)."""
    def sub(t):
        return (t != 0) & (t.abs() < torch.finfo(torch.float32).tiny)
    if dim is not None:
        return sub(x).any(dim)
    return torch.tensor(any(bool(sub(x[a : a + chunk]).any()) for a in range(0, max(1, x.shape[0]), chunk)))


def prepare_rows(h: torch.Tensor, certifiable: bool):
    return torch.ops.vllm_csv_cpu.prepare_rows(h, certifiable) if uses_kernels(h) else prepare_rows_ref(h, certifiable)


# ---- abs_max_rows ---------------------------------------------------------------------------
def abs_max_rows_ref(y: torch.Tensor) -> torch.Tensor:
    """``[B]`` float32: ``max_i |y[b, i]|`` of ``y [B, V]`` float32 (NaN if the row has a NaN)."""
    ymin, ymax = torch.aminmax(y, dim=1)  # NaN and inf propagate
    return torch.maximum(ymax, ymin.neg_())


def abs_max_rows(y: torch.Tensor) -> torch.Tensor:
    """Same as :func:`abs_max_rows_ref`, one pass over each row on the CPU (``torch.aminmax`` took
    0.7 ms for 8 rows of 65536 here)."""
    return torch.ops.vllm_csv_cpu.abs_max_rows(y) if uses_kernels(y) and y.dim() == 2 else abs_max_rows_ref(y)


# ---- outlier_rows ---------------------------------------------------------------------------
def outlier_rows_ref(h: torch.Tensor, ratio: float, m: int) -> torch.Tensor:
    """``[B]`` bool: the row's largest ``|h_bj|`` exceeds ``ratio`` times the rms of the row without
    its ``m`` largest ``|h|`` (float64; rows of at most ``2 m`` channels, zero rows and rows with
    NaN/inf: False). The int8 screen's test for outlier channels
    (:func:`vllm_csv.screens.fbgemm.outlier_channels`)."""
    B, d = h.shape
    if d <= 2 * m:
        return torch.zeros(B, dtype=torch.bool)
    a = h.double().abs()
    finite = torch.isfinite(a).all(1)
    top = a.nan_to_num(0.0, 0.0, 0.0).topk(m, dim=1).values
    rest = ((a.pow(2).sum(1) - top.pow(2).sum(1)).clamp_min(0) / (d - m))
    return finite & (top[:, 0] > 0) & (top[:, 0].pow(2) > ratio * ratio * rest)


def outlier_rows(h: torch.Tensor, ratio: float, m: int) -> torch.Tensor:
    """Same as :func:`outlier_rows_ref` (the float64 sums in index order): one pass a row on the
    CPU, where the reference's sort-free torch ops still took 180 us for eight rows of 768."""
    if uses_kernels(h) and h.dim() == 2:
        return torch.ops.vllm_csv_cpu.outlier_rows(h, ratio, m)
    return outlier_rows_ref(h, ratio, m)


# ---- interval_rows --------------------------------------------------------------------------
def interval_rows_ref(y: torch.Tensor, c: torch.Tensor, rad: torch.Tensor, hnorm: torch.Tensor,
                      bslack: torch.Tensor | None, nn: torch.Tensor | None, e: torch.Tensor | None,
                      two_sided: bool) -> torch.Tensor:
    """The screen's intervals around its centres (:meth:`vllm_csv.head.CertifiedHead._intervals`).

    Parameters
    ----------
    y : torch.Tensor
        ``[B, V]`` float32, the centres; overwritten with ``y - m`` where ``two_sided``.
    c, hnorm : torch.Tensor
        ``[B]`` float32: each row's constant part of the half-width and ``||h||``.
    rad : torch.Tensor
        ``[V]`` float32, each token's radius (per unit of ``||h||``).
    bslack, nn : torch.Tensor or None
        ``[V]`` float32: the bias slack; the activation-error coefficient (with ``e``).
    e : torch.Tensor or None
        ``[B]`` float32, the activation quantisation error (with ``nn``).
    two_sided : bool

    Returns
    -------
    ``hi = y + m`` (``[B, V]`` float32), ``m = (c + bslack) + rad hnorm + nn e`` in fp32, operation
    by operation (torch 2.13's CPU ``addcmul`` rounds each ``self + t1 t2`` once, a fused
    multiply-add: the kernel does the same, and ``tests/test_cpu_step.py`` checks the bits); ``y``
    holds ``lo = y - m`` where ``two_sided``.
    """
    m = torch.addcmul(c[:, None] + bslack[None] if bslack is not None else c[:, None], rad[None], hnorm[:, None])
    if nn is not None:
        m.addcmul_(nn[None], e[:, None])
    hi = y + m
    if two_sided:
        y.sub_(m)
    return hi


def interval_rows(y: torch.Tensor, c: torch.Tensor, rad: torch.Tensor, hnorm: torch.Tensor,
                  bslack: torch.Tensor | None, nn: torch.Tensor | None, e: torch.Tensor | None,
                  two_sided: bool) -> torch.Tensor:
    """Same as :func:`interval_rows_ref` (the same bits), one pass over ``y`` on the CPU where
    the kernel is built and every vector has its length (the reference makes five, through a
    ``[B, V]`` half-width: 0.37 against 0.10 ms for 8 rows of 65536 and 3.2 against 0.8 ms for 32,
    two threads, :mod:`~vllm_csv.cpu_malloc` tuned, measured 2026-11-26)."""
    B, V = y.shape
    f32 = [(t, n) for t, n in ((c, B), (rad, V), (hnorm, B), (bslack, V), (nn, V), (e, B)) if t is not None]
    if uses_kernels(y) and y.is_contiguous() and y.dtype == torch.float32 and \
            all(t.dtype == torch.float32 and t.shape == (n,) for t, n in f32):
        return torch.ops.vllm_csv_cpu.interval_rows(y, c, rad, hnorm, bslack, nn, e, two_sided)
    return interval_rows_ref(y, c, rad, hnorm, bslack, nn, e, two_sided)


# ---- quantize_act7 -------------------------------------------------------------------------
def fold_scale(k: int, s_min: float, s_max: float) -> float | None:
    """``c = 2^(k - 6)`` if FBGEMM can apply it exactly (:mod:`vllm_csv.screens.fbgemm`), else None."""
    j = k - 6
    if not C_MIN_LOG2 <= j <= C_MAX_LOG2:
        return None
    c = 2.0**j
    if s_min * c < S_MIN or s_max * c >= 2.0**127:
        return None
    return c


def quantize_act7_ref(h: torch.Tensor, s_min: float, s_max: float):
    """The FBGEMM screen's activations (:mod:`vllm_csv.screens.fbgemm`, whose docstring has the
    proof): ``(x [B, d + 2] fp32, row_scale [B] fp32, e [B] fp32, c)``.

    Per row ``t_b = 2^k_b >= max|h_b|`` and ``p_b = clamp(round(h_b / (t_b / 64)), -64, 63)``
    (rows that are zero, non-finite or below ``2^K_MIN``: ``k_b = 0``, ``p_b = 0``);
    ``e_b = ||h_b - (t_b / 64) p_b||`` in float64, rounded up, times ``1 + 4u`` (plus
    ``2^-149 / s_min`` where the per-row scaling may underflow). ``c`` is the folded scale
    ``t / 64`` when every row shares ``k`` and FBGEMM applies it exactly, else ``0.0``; then
    ``x = [c p_b, -64 c, 63 c]``, else ``x = [p_b, -64, 63]`` and the center is scaled per row by
    ``row_scale = t_b / 64``."""
    hd = h.double()
    ks = []
    for a in hd.abs().amax(1).tolist():
        m, k = math.frexp(a) if math.isfinite(a) and a > 0 else (0.0, None)
        ks.append(None if k is None or k - (m == 0.5) < K_MIN else k - (m == 0.5))
    live = [k is not None for k in ks]
    kk = [0 if k is None else k for k in ks]
    scale_l = [math.ldexp(1.0, k - 6) for k in kk]  # t_b / 64, exact
    scale = torch.tensor(scale_l, dtype=torch.float64)
    p = torch.round(hd / scale[:, None]).clamp_(ACT_MIN, ACT_MAX)
    if not all(live):
        p[torch.tensor(live).logical_not_()] = 0
    f = (hd - p * scale[:, None]).norm(dim=1)  # exact residual, norm in float64
    c = fold_scale(kk[0], s_min, s_max) if kk and min(kk) == max(kk) else None
    if c is None and any(s_min * x < S_MIN for x in scale_l):
        f = f + torch.tensor([2.0**-149 / s_min if s_min * x < S_MIN else 0.0 for x in scale_l],
                             dtype=torch.float64)
    e = round_up32(f) * (1 + 4 * FP32_UNIT_ROUNDOFF)
    B, d = p.shape
    cc = 1.0 if c is None else c
    x = torch.empty((B, d + 2), dtype=torch.float32)
    torch.mul(p.float(), cc, out=x[:, :d])  # exact: 7-bit integers times a power of two
    x[:, d] = ACT_MIN * cc
    x[:, d + 1] = ACT_MAX * cc
    return x, scale.float(), e, 0.0 if c is None else c


def quantize_act7(h: torch.Tensor, s_min: float, s_max: float):
    if uses_kernels(h):
        return torch.ops.vllm_csv_cpu.quantize_act7(h, s_min, s_max)
    return quantize_act7_ref(h, s_min, s_max)


# ---- select_candidates ----------------------------------------------------------------------
def block_max(y: torch.Tensor) -> torch.Tensor:
    """``[B, ceil(V / BLOCK)]`` maxima of consecutive blocks of ``y [B, V]`` (NaN propagates)."""
    B, V = y.shape
    full = V // BLOCK * BLOCK
    parts = [y[:, :full].reshape(B, -1, BLOCK).amax(2)] if full else []
    if full < V:
        parts.append(y[:, full:].amax(1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def block_cols(blocks: torch.Tensor, V: int) -> torch.Tensor:
    """The token ids of ``blocks`` (ascending)."""
    cols = (blocks[:, None] * BLOCK + torch.arange(BLOCK, device=blocks.device)[None]).reshape(-1)
    return cols[cols < V]


def threshold_from(y1, yk, hnorm, e, ok, rad_max: float, act_coef: float, tiny: float, bslack_max: float,
                   delta: float, limit: float, babs_max: float):
    """``(tau, thr, ok)``, each ``[B]``, from a row's largest screen value ``y1`` and a lower bound
    ``yk`` of its k-th largest (the search of :func:`select_candidates_ref`, whose arguments these
    are): ``tau`` a lower bound of the row's k-th largest dense logit, ``thr`` the screen value
    below which a token's dense upper bound is below ``tau`` (NaN on rows that cannot be
    certified, which then add no candidates), ``ok`` with the overflow check added. fp32, in
    this order of operations (the GPU step's select kernel repeats them one for one)."""
    act = act_coef * e if e is not None else 0.0
    spread = rad_max * hnorm + act + tiny + bslack_max
    ok = ok & ((y1 + delta * y1.abs() + spread + babs_max) <= limit)  # False on NaN
    tau = yk - delta * yk.abs() - spread
    s = tau - spread
    thr = torch.where(s >= 0, s / (1 + delta), s / (1 - delta))
    thr = thr - thr.abs() * (8 * FP32_UNIT_ROUNDOFF) - tiny  # rounding of this very line
    return tau, thr.masked_fill(~ok, math.nan), ok


def select_candidates_ref(y, row_scale, k, hnorm, e, ok, rad_max: float, act_coef: float, tiny: float,
                          bslack_max: float, delta: float, limit: float, babs_max: float, budget: int,
                          bmax: torch.Tensor | None = None):
    """The threshold search of :meth:`vllm_csv.head.CertifiedHead._select_two_sided` (its
    docstring has the argument): ``(ids [S] int64 ascending, tau [B] fp32, ok [B], live [B])``.

    Parameters
    ----------
    y : torch.Tensor
        ``[B, V]`` fp32 screen values; the center is ``fl(y * row_scale[:, None])`` if
        ``row_scale [B]`` is given, else ``y``.
    k : torch.Tensor
        ``[B]`` int64, ``k >= 1``.
    hnorm, e : torch.Tensor
        ``[B]`` fp32: ``||h_b||`` rounded up; the screen's activation term (or None).
    ok : torch.Tensor
        ``[B]`` bool: rows that may be certified (returned with the overflow check added).
    rad_max, act_coef, tiny, bslack_max, delta, limit, babs_max : float
        ``spread_b = rad_max ||h_b|| + act_coef e_b + tiny + bslack_max``, the relative
        term ``delta`` and the engine's ``limit`` (:meth:`_select_two_sided`).
    budget : int
        Most candidates a row may have (more: not ``live``).
    bmax : torch.Tensor, optional
        ``[B, ceil(V / BLOCK)]`` fp32, :func:`block_max` of ``y`` when the screen's GEMM already
        took it (:meth:`vllm_csv.ops.int8_vnni.VnniInt8Linear.linear_block_max`); else computed here.

    Every token outside ``ids`` has a dense upper bound ``< tau_b`` on every row that is
    ``ok & live``; rows that are not ``ok`` add no candidates."""
    B, V = y.shape
    rs = row_scale
    kmax = int(k.max())
    bmax = block_max(y) if bmax is None else bmax  # [B, nb]: the one full read of y
    if rs is not None:
        bmax = bmax * rs[:, None]  # = the block maxima of fl(y * rs): exact and monotone
    if kmax == 1:
        y1 = yk = bmax.amax(1)
    elif kmax <= bmax.shape[1]:
        top = bmax.topk(kmax, dim=1).values
        y1, yk = top[:, 0], top.gather(1, (k - 1)[:, None])[:, 0]
    else:  # fewer blocks than k (a small vocabulary): the exact k-th value
        top = y.topk(kmax, dim=1).values
        if rs is not None:
            top = top * rs[:, None]
        y1, yk = top[:, 0], top.gather(1, (k - 1)[:, None])[:, 0]
    tau, thr, ok = threshold_from(y1, yk, hnorm, e, ok, rad_max, act_coef, tiny, bslack_max, delta, limit,
                                  babs_max)
    thr = thr[:, None]
    blocks = bmax >= thr  # [B, nb]: blocks that hold a candidate
    live = blocks.sum(1) <= budget  # each such block holds at least one candidate
    cols = block_cols((blocks[live] if B > 1 else blocks).any(0).nonzero().squeeze(1), V)
    cand = (y[:, cols] if rs is None else y[:, cols] * rs[:, None]) >= thr
    live &= cand.sum(1) <= budget
    ids = cols[(cand[live] if B > 1 else cand).any(0)]
    return ids, tau, ok, live


def select_candidates(y, row_scale, k, hnorm, e, ok, rad_max, act_coef, tiny, bslack_max, delta, limit,
                      babs_max, budget, bmax=None):
    if uses_kernels(y):
        return torch.ops.vllm_csv_cpu.select_candidates(y, row_scale, bmax, k, hnorm, e, ok, rad_max, act_coef, tiny,
                                                        bslack_max, delta, limit, babs_max, budget)
    return select_candidates_ref(y, row_scale, k, hnorm, e, ok, rad_max, act_coef, tiny, bslack_max, delta, limit,
                                 babs_max, budget, bmax)


# ---- score_intervals ------------------------------------------------------------------------
def score_intervals_ref(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, coef: float, tiny32: float):
    """``(a, E, lo, hi, lower, upper, z)`` for the rows ``w[ids]`` of the head, each ``[B, S]``.

    ``a = <w_j, h_b>`` in float64 (products of model-dtype numbers are exact; the sum is within
    ``gamma64_d A`` of the real one, ``A = sum_i |w_ji h_bi|``, in any order), and with
    ``E = coef A + tiny32 + 2^-52 |a|`` (float64; ``coef`` = the fp32 accumulation's
    ``gamma_(d+2)`` plus ``4 gamma64_d``: :meth:`vllm_csv.head.CertifiedHead._score`),
    ``[lo, hi]`` (fp32) = ``[a - E, a + E]`` rounded outwards holds every fp32 accumulator of
    the product. Without a bias the engine rounds the accumulator to the model dtype
    (``w.dtype``), monotone: ``lower, upper`` (fp32) = the rounded ends, and ``z`` (model dtype) =
    that value where the two agree bit for bit, else ``a`` rounded to fp32 and then to the dtype."""
    a, E, lo, hi = score_bounds_ref(h, w, ids, coef, tiny32)
    lower, upper = lo.to(w.dtype).float(), hi.to(w.dtype).float()
    z = torch.where(single_valued(lower, upper), lower, a.float()).to(w.dtype)
    return a, E, lo, hi, lower, upper, z


def score_bounds_ref(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, coef: float, tiny32: float):
    """The first four outputs of :func:`score_intervals_ref`: ``(a, E, lo, hi)``."""
    hd, wd = h.double(), w[ids].double()
    a = F.linear(hd, wd)
    E = F.linear(hd.abs(), wd.abs()).mul_(coef).add_(tiny32)
    E.add_(a.abs(), alpha=2.0**-52)  # the roundings of a - E and a + E in float64
    return a, E, round_down32(a - E), round_up32(a + E)


def score_intervals(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, coef: float, tiny32: float):
    if uses_kernels(h) and h.dtype == w.dtype:
        return torch.ops.vllm_csv_cpu.score_intervals(h, w, ids, coef, tiny32)
    return score_intervals_ref(h, w, ids, coef, tiny32)


def single_valued(lower: torch.Tensor, upper: torch.Tensor) -> torch.Tensor:
    """Where the dense value is known bit for bit: ``lower`` and ``upper`` are the same value
    *and* the same sign of zero (a GEMM that cancels to ``+0.0`` and one that underflows from
    below to ``-0.0`` compare equal, but are not the same bits)."""
    return (lower == upper) & (torch.signbit(lower) == torch.signbit(upper))


# ---- certify_topk --------------------------------------------------------------------------
def certify_topk_ref(z, lower, upper, k, outside_high, need_values):
    """The top-k certificate of :meth:`vllm_csv.head.CertifiedHead._certify` for an engine
    without soft-cap or scale and greedy rows (no temperature): ``(ok [B], in_top [B, S])``.

    ``T`` = the ``k_b`` columns of largest ``z`` (``[B, S]``, model dtype); ``ok`` when the
    smallest ``lower`` in ``T`` beats strictly the engine's rounding (to ``z.dtype``) of the
    largest ``upper`` outside ``T`` and of ``outside_high`` (an upper bound of every unscored
    token), is finite, and, where ``need_values``, every value in ``T`` is known bit for bit."""
    kmax = int(k.max())
    top = z.float().topk(kmax, dim=1).indices
    in_top = torch.zeros(z.shape, dtype=torch.bool, device=z.device).scatter_(
        1, top, torch.arange(kmax, device=z.device)[None] < k[:, None])
    low = lower.masked_fill(~in_top, math.inf).amin(1)
    high = upper.masked_fill(in_top, -math.inf).amax(1)
    ok = (low > torch.maximum(high, outside_high).to(z.dtype).float()) & torch.isfinite(low)
    ok &= (single_valued(lower, upper) | ~in_top).all(1) | ~need_values
    return ok, in_top


def certify_topk(z, lower, upper, k, outside_high, need_values):
    fn = torch.ops.vllm_csv_cpu.certify_topk if uses_kernels(z) else certify_topk_ref
    return fn(z, lower, upper, k, outside_high, need_values)


# ---- finish_selection ----------------------------------------------------------------------


def finish_selection_ref(V: int, ids, z, in_top, ok, live, cert):
    """``(exact [B, V] z.dtype, code [B] int64)``: ``exact`` holds ``z`` on the columns ``ids``
    where ``in_top``, ``-inf`` elsewhere; ``code`` indexes :data:`REASONS`: 0 certified
    (``ok & live & cert``), else 1 not ``ok`` (inputs or bounds unusable), 2 not ``live`` (too
    many candidates), 3 not certified."""
    B = ok.shape[0]
    exact = torch.full((B, V), -math.inf, dtype=z.dtype, device=z.device)
    exact[:, ids] = z.masked_fill(~in_top, -math.inf)
    return exact, outcome_codes(ok & live & cert, ok, live)


def outcome_codes(certified, ok, live) -> torch.Tensor:
    """``[B]`` int64, indexes of :data:`REASONS`: 0 ``certified``, else 1 not ``ok``, 2 not
    ``live``, 3 not certified."""
    return torch.where(certified, 0, torch.where(~ok, 1, torch.where(~live, 2, 3)))


def finish_selection(V: int, ids, z, in_top, ok, live, cert):
    fn = torch.ops.vllm_csv_cpu.finish_selection if uses_kernels(z) else finish_selection_ref
    return fn(V, ids, z, in_top, ok, live, cert)


# ---- fake implementations (shapes only: tracing, torch.compile) -------------------------------
def _register_fakes() -> None:
    if _state.get("fakes"):
        return
    lib = "vllm_csv_cpu::"

    @torch.library.register_fake(lib + "prepare_rows")
    def _(h, certifiable):
        B = h.shape[0]
        return torch.empty_like(h), h.new_empty(B, dtype=torch.float32), h.new_empty(B, dtype=torch.bool)

    @torch.library.register_fake(lib + "interval_rows")
    def _(y, c, rad, hnorm, bslack, nn, e, two_sided):
        return torch.empty_like(y)

    @torch.library.register_fake(lib + "outlier_rows")
    def _(h, ratio, m):
        return h.new_empty(h.shape[0], dtype=torch.bool)

    @torch.library.register_fake(lib + "abs_max_rows")
    def _(y):
        return y.new_empty(y.shape[0])

    @torch.library.register_fake(lib + "quantize_act7")
    def _(h, s_min, s_max):
        B, d = h.shape
        f32 = torch.float32
        return h.new_empty(B, d + 2, dtype=f32), h.new_empty(B, dtype=f32), h.new_empty(B, dtype=f32), 1.0

    @torch.library.register_fake(lib + "select_candidates")
    def _(y, row_scale, bmax, k, hnorm, e, ok, *scalars):
        B = y.shape[0]
        S = torch.library.get_ctx().new_dynamic_size()
        return (y.new_empty(S, dtype=torch.long), y.new_empty(B), y.new_empty(B, dtype=torch.bool),
                y.new_empty(B, dtype=torch.bool))

    @torch.library.register_fake(lib + "score_intervals")
    def _(h, w, ids, coef, tiny32):
        B, S = h.shape[0], ids.shape[0]
        f64, f32 = torch.float64, torch.float32
        return (h.new_empty(B, S, dtype=f64), h.new_empty(B, S, dtype=f64), h.new_empty(B, S, dtype=f32),
                h.new_empty(B, S, dtype=f32), h.new_empty(B, S, dtype=f32), h.new_empty(B, S, dtype=f32),
                h.new_empty(B, S))

    @torch.library.register_fake(lib + "finish_selection")
    def _(V, ids, z, in_top, ok, live, cert):
        return z.new_empty(ok.shape[0], V), ids.new_empty(ok.shape[0])

    @torch.library.register_fake(lib + "certify_topk")
    def _(z, lower, upper, k, outside_high, need_values):
        return z.new_empty(z.shape[0], dtype=torch.bool), z.new_empty(z.shape, dtype=torch.bool)

    @torch.library.register_fake(lib + "pack_int8_vnni")
    def _(q):
        V, d = q.shape
        return q.new_empty(-(-V // PANEL), -(-d // GROUP), 2, PANEL // 2, GROUP)

    def int8_linear(x, packed, zsum, s, V, d, block):
        return s.new_empty(x.shape[0], V), s.new_empty(x.shape[0], -(-V // block) if block else 0)

    for name in ("int8_vnni_linear", "int8_amx_linear"):  # (one op on two instruction sets)
        torch.library.register_fake(lib + name)(int8_linear)

    @torch.library.register_fake(lib + "noise_candidates")
    def _(hi, seeds, hmax, table, force, ids, inv_level):
        m = torch.library.get_ctx().new_dynamic_size()
        return (hi.new_empty(m, dtype=torch.long), hi.new_empty(m, dtype=torch.long),
                hi.new_empty(m, dtype=torch.long))

    @torch.library.register_fake(lib + "noise_bits")
    def _(seeds, ids):
        return seeds.new_empty(seeds.shape[0], ids.shape[-1], dtype=torch.long)

    @torch.library.register_fake(lib + "row_stats")
    def _(lo, hi, k):
        R = lo.shape[0]
        return (lo.new_empty(R), lo.new_empty(R), lo.new_empty(R), lo.new_empty(R, dtype=torch.long),
                lo.new_empty(R, k), lo.new_empty(R, k, dtype=torch.long))

    @torch.library.register_fake(lib + "pack_live")
    def _(lo, hi, n):
        return lo.new_empty(lo.shape[0], n, dtype=torch.long)

    @torch.library.register_fake(lib + "min_p_cut")
    def _(lo, hi, keep_at, drop_at):
        return torch.empty_like(lo), torch.empty_like(hi)

    @torch.library.register_fake(lib + "top_k_cut")
    def _(lo, hi, hk, hk1, lk):
        return torch.empty_like(lo), torch.empty_like(hi)

    @torch.library.register_fake(lib + "top_p_sums")
    def _(lo, hi, el, eh, qrow, qcol):
        return lo.new_empty(qrow.shape[0], 4, dtype=torch.float64)

    @torch.library.register_fake(lib + "unlisted_masses")
    def _(lo, hi, c, ih):
        return lo.new_empty(lo.shape[0], 2, dtype=torch.float64)

    @torch.library.register_fake(lib + "row_topk")
    def _(x, k):
        return x.new_empty(x.shape[0], k), x.new_empty(x.shape[0], k, dtype=torch.long)

    @torch.library.register_fake(lib + "flat_nonzero")
    def _(x):
        return x.new_empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.long)

    _state["fakes"] = True
