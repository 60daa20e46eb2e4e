"""The int8 screen on x86 CPUs: an exact int8 GEMM, our kernel (:mod:`vllm_csv.ops.int8_vnni`:
AVX512-VNNI, or AVX2 where the CPU has no VNNI) where the CSV CPU kernels are built, else
FBGEMM's (:mod:`vllm_csv.ops.fbgemm`); all return the same bits, chosen once when the screen is
built (``backend``: ``"vnni"``, ``"vnni+amx"`` where the CPU has AMX-INT8, ``"avx2"``, or ``"fbgemm"``).

Weights: per-row symmetric int8, ``deq_i = s_i q_i`` (``s_i = max|w_i| / 127`` in fp32, at least
``2^-126`` so that it is a normal number; ``q_i = round(w_i / s_i)``), packed once.
``r_i = ||w_i - deq_i||`` and ``n_i = ||deq_i||`` in float64 from the exact ``deq_i``, rounded up.

Activations, per row ``b``: ``t_b = 2^k_b >= max_j |h_bj|`` (``frexp``: exact), and
``p_b = clamp(round(64 h_b / t_b), -64, 63)`` (float64: exact scaling), so ``p_b`` holds integers
in ``[-64, 63]`` and ``f_b = h_b - (t_b / 64) p_b`` is exact in float64
(``||f_b||_inf <= t_b / 64``). Rows with ``k_b < -143`` (``max|h_b| < 2^-143``) take ``p_b = 0``.

The GEMM. With ``A_bi = <p_b, q_i>`` (an integer, ``|A| <= 64 * 128 * d``), either backend
returns ``fl(fl(A_bi) c s_i)`` bit for bit (:class:`~vllm_csv.ops.fbgemm.PackedInt8Linear`,
:class:`~vllm_csv.ops.int8_vnni.VnniInt8Linear`), ``c`` a power of two:

* one shared exponent (every row of the batch has the same ``t``, always at ``B = 1``), and
  ``2^-14 <= c = t / 64 <= 2^100`` with ``c s_i`` normal for every ``i``: ``y = fl(fl(A) c s_i)``;
* otherwise ``c = 1`` and ``y = fl(fl(fl(A) s_i) t_b / 64)`` (a power-of-two scaling: exact,
  except for an absolute ``|delta| <= 2^-150`` where the result is subnormal, ``2^-126`` where a
  flush-to-zero engine flushes it). The factor ``t_b / 64`` itself is never subnormal: rows with
  ``max|h| < 2^K_MIN = 2^-119`` are not quantised (:data:`vllm_csv.ops.build.K_MIN`; found by
  review: under x86 FTZ/DAZ a subnormal factor read as 0 left the centre at the bias).

Each ``fl`` is a relative ``(1 + e)``, ``|e| <= u = 2^-24`` (``fl(A)`` is exact below ``2^24``,
i.e. ``d <= 2048``); a nonzero product is at least ``c s_i >= 2^-126`` or ``s_i``: normal, no
underflow. So, with ``x_bi = (t_b / 64) s_i A_bi = <deq_i, t_b p_b / 64>``,

    |x_bi - y_bi| <= ((1 + u)^2 - 1) / (1 - u)^2 |y_bi| + (1 + 3u) |delta|  <=  3u |y_bi| + 2^-149 [underflow possible]

and ``|delta| > 0`` needs ``s_min t_b / 64 < 2^-126`` (``|fl(fl(A) s_i)| >= s_i`` for
``A != 0``, and ``A = 0`` gives 0 exactly). For rows where that can happen, ``e_b`` gains
``2^-149 / s_min``: ``n_i >= s_i >= s_min`` whenever ``q_i != 0``, so ``n_i e_b`` covers it.
Finally

    <w_i, h_b> = <w_i - deq_i, h_b> + <deq_i, f_b> + x_bi,
    |<w_i, h_b> + b_i - y_bi - b_i| <= r_i ||h_b|| + n_i e_b + 3u |y_bi|,
    e_b = ||f_b|| (+ 2^-149 / s_min where the scaling may underflow)     (Cauchy-Schwarz twice)

which is :class:`~vllm_csv.screens.ScreenOut` ``(y + b, r, n, e, rel=3u)``; the bias is added
last, in fp32. Non-finite ``h_b`` gets ``p_b = 0`` (its bound is ``nan``/``inf``: the runtime
sends that row dense) so that it cannot change the quantisation of the other rows. A product
that overflows is ``inf``: that row goes dense too.

Outlier channels. Trained models put a few channels of ``h`` far above the rest (massive
activations): one channel at 15 times a row's rms sets ``t_b``, every other entry then falls
within a few codes of zero and ``e_b`` is about the whole ``||h_b||``, so the screen prunes
nothing (measured: ``benchmarks/README.md``, "Outlier channels and the int8 screen"). Channels
``O`` with ``|h_bj| > OUTLIER_RATIO`` times the rms of the rest of the row in some row of the batch (at most
``MAX_OUTLIERS``, the largest) are taken out: ``h' = h`` with ``O`` zeroed is quantised as
above, and their part is computed from the head's own weights in fp32,
``y_O = fl(h_O W_O^T)`` (``m = |O|`` products of exact fp32 values, any order:
``|y_O - <w_iO, h_bO>| <= gamma_m ||w_i|| ||h_bO||``), then ``y = fl(y' + y_O)``. With ``y'`` as
above (its ``3u |y'|``, and ``|y'| <= (1 + u) |y| + |y_O|``) and one more rounding,

    |<w_i, h_b> - y_bi| <= r_i ||h_b|| + n_i (e'_b + (3u + gamma_m)(1 + gamma_m) rho ||h_bO||) + 5u |y_bi|

with ``rho = max_i ||w_i|| / n_i`` (computed once; about 1), which is ``ScreenOut`` with that
``e`` and ``rel = 5u`` (:data:`REL_SPLIT`). Batches without such a channel are screened as
before, bit for bit.

Soundness rests on the GEMM computing what its ops module says; the constructor checks it on
this machine (a probe batch at the activation extremes against the float64 reference, bit for
bit) and refuses (:class:`~vllm_csv.errors.CSVError`) where anything differs or is missing,
so there is no call-time refusal.
"""

from __future__ import annotations


import torch

from ..errors import CSVError
from ..fp import FP32_UNIT_ROUNDOFF, gamma, matmul32, round_up32
from ..ops import int8_vnni, rows
from ..ops.build import BLOCK, uses_kernels
from ..ops.rows import S_MIN, fold_scale
from ..ops.fbgemm import ACT_MAX, ACT_MIN, C_MAX_LOG2, C_MIN_LOG2, PackedInt8Linear, packed_int8_linear_ref
from .copy_error import copy_error_norms, row_norms
from .quantized import quantize

REL = 3 * FP32_UNIT_ROUNDOFF
REL_SPLIT = 5 * FP32_UNIT_ROUNDOFF  # with outlier channels split off (module docstring)
OUTLIER_RATIO = 10.0  # |h_bj| above this many times the rest of its row's rms: an outlier channel
MAX_OUTLIERS = 8  # channels split off at most (the largest)
COLUMN_CACHE = 64  # channels whose fp32 weight columns are kept (a model's outlier channels recur)
PROBE_ROWS = 192


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [V, d]`` int8 and ``s [V]`` fp32 of the screen: :func:`quantize` (8 bits), with
    scales below ``2^-126`` raised to ``2^-126`` (normal numbers; ``|w| / s <= 127`` still)."""
    q, s = quantize(weight, 8)
    s = s[:, 0]
    tiny = s < S_MIN
    if bool(tiny.any()):
        s = torch.where(tiny, torch.full_like(s, S_MIN), s)
        q[tiny] = torch.round(weight[tiny].float() / S_MIN).clamp_(-127, 127).to(torch.int8)
    return q, s


def self_test_probe(V: int, d: int, largest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The start-up self-test's inputs for a quantised screen's exact GEMM: ``p [5, d]`` activation
    codes (every code -64, every code 63, alternating, and random ones) and ``rows`` (ascending
    ids): the first 64 rows, random ones, and ``largest`` (the row with the largest weights)."""
    g = torch.Generator().manual_seed(0)
    p = torch.randint(ACT_MIN, ACT_MAX + 1, (5, d), generator=g).float()
    p[0], p[1] = ACT_MIN, ACT_MAX
    p[2, ::2], p[2, 1::2] = ACT_MIN, ACT_MAX
    rows = torch.cat([torch.arange(min(V, 64)), torch.randint(0, V, (PROBE_ROWS - 64,), generator=g),
                      torch.tensor([largest])]).unique()
    return p, rows


def apply_row_scale(y: torch.Tensor, scale: torch.Tensor, c: float, defer: bool,
                    bias: torch.Tensor | None) -> torch.Tensor | None:
    """After a GEMM on :func:`~vllm_csv.ops.rows.quantize_act7`'s activations: the per-row
    scale ``[B]`` the caller still has to apply (``defer`` asked, no bias, and the exponents did
    not fold into ``c``), else None, ``y`` then being the center (scaled here in place where they
    did not fold: a power of two, exact unless subnormal)."""
    if c:
        return None
    if defer and bias is None:
        return scale
    y.mul_(scale[:, None])  # exact unless subnormal
    return None


def int8_linear(q: torch.Tensor, s: torch.Tensor):
    """The fastest exact int8 GEMM here for ``q [V, d]``, ``s [V]``: our kernel (AVX512-VNNI, else
    AVX2: faster than FBGEMM's AVX2 GEMM and its block-max pass at 1-4 rows, on par at 8-16), else
    FBGEMM (:class:`~vllm_csv.errors.CSVError` where neither runs)."""
    why = int8_vnni.unavailable_reason(*q.shape[::-1])
    if why is None:
        return int8_vnni.VnniInt8Linear(q, s)
    return PackedInt8Linear(q, s)


class FbgemmInt8Screen:
    """Per-row int8 copy of the head, scored by an exact int8 GEMM on x86 CPUs (our AVX512-VNNI or
    AVX2 kernel, or FBGEMM: :func:`int8_linear`).

    Parameters
    ----------
    weight : torch.Tensor
        ``[V, d]`` LM head, any float dtype, on the CPU.
    bias : torch.Tensor, optional
        ``[V]``.
    """

    name = "int8"
    two_sided = True
    defers_row_scale = True  # center_radius(h, defer_row_scale=True) is understood

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int = 8192):
        if weight.device.type != "cpu":
            raise CSVError("FBGEMM runs on the CPU only")
        V, d = weight.shape
        q, s = quantize_rows(weight)
        if not bool(torch.isfinite(s).all()) or float(s.max()) * 2.0**C_MAX_LOG2 >= 2.0**127:
            # s = max|w_i| / 127: the bound is max|w| < 127 * 2^(127 - C_MAX_LOG2), the number said
            wmax = 127 * 2.0 ** (127 - C_MAX_LOG2)
            raise CSVError(f"LM head has non-finite or huge weights (max |w| must be below {wmax:.3g})")
        self.gemm = int8_linear(q, s)
        self.backend = self.gemm.backend
        self.s = s
        r, n = copy_error_norms(weight, lambda a, b: q[a:b].double() * s[a:b, None].double(), chunk)
        slack = 1 + 4 * FP32_UNIT_ROUNDOFF
        self.radius = round_up32(r) * slack
        self.n = round_up32(n) * slack
        # outlier channels (module docstring): the head's own weights, and rho = max ||w_i|| / n_i
        self.weight = weight
        self._col_cache: dict[int, torch.Tensor] = {}  # (_columns)
        wn = row_norms(weight, chunk)
        ratio = torch.where(self.n > 0, wn / self.n.double(), torch.zeros_like(wn))
        self.rho = float(ratio.max()) * (1 + 2.0**-40) if V else 0.0
        self.s_min, self.s_max = float(s.min()), float(s.max())
        self.bias = None if bias is None else bias.float()
        # the activations' passes bound once: the CPU kernels where built, else their references
        kernels = uses_kernels(weight)
        self._quantize_act7 = rows.quantize_act7_cpu if kernels else rows.quantize_act7_ref
        self._outlier_rows = rows.outlier_rows_cpu if kernels else rows.outlier_rows_ref
        # The VNNI GEMM hands back y's block maxima (ScreenOut.block_max) where y is its output
        # as is (no bias added after it).
        self._fused_block_max = bias is None and isinstance(self.gemm, int8_vnni.VnniInt8Linear)
        self.extra_bytes = V * (d + 2) + V * 4 * 5  # packed int8; col offsets / row sums, scales, zero points, r, n
        self._self_test(q, s)

    def _self_test(self, q: torch.Tensor, s: torch.Tensor) -> None:
        """Probe rows at the extremes of the activation range (every code 0, every code 127,
        alternating) and random ones, at two scales, against the float64 reference on a sample
        of rows of ``W`` (with its largest ``|q|``): bit for bit, or the screen refuses."""
        p, rows = self_test_probe(*q.shape, int(q.abs().amax(1).argmax()))
        for c in (1.0, self._fold_scale(C_MIN_LOG2 + 6) or 1.0):
            for probe in (p, p[:1]):  # (a backend may pick its kernel by batch: int8_vnni.AMX_FROM)
                got = self.gemm(probe, c)[:, rows]
                want = packed_int8_linear_ref(probe, q[rows], s[rows], c)
                if not torch.equal(got, want):
                    raise CSVError(f"the {self.backend} int8 GEMM is not exact on this machine (self-test)")

    def _fold_scale(self, k: int) -> float | None:
        """``c = 2^(k - 6)`` if FBGEMM can apply it exactly (see the module docstring), else None."""
        return fold_scale(k, self.s_min, self.s_max)

    def center_radius(self, h: torch.Tensor, defer_row_scale: bool = False):
        """Screen values for ``h [B, d]``: ``ScreenOut(y [B, V] fp32, r [V], n [V], e [B], rel)``.

        With ``defer_row_scale`` (and no bias), rows quantised with different exponents are
        returned unscaled, ``y_raw = fl(fl(A) s_i)``, with ``row_scale [B] = t_b / 64``: the
        center is ``fl(y_raw * row_scale)``, the very product this method would otherwise take
        over all of ``[B, V]``; a caller that needs only a few columns (or block maxima: the
        product is monotone) saves that pass. With the VNNI backend and no bias, ``block_max``
        holds :func:`~vllm_csv.ops.select.block_max` of the returned ``y``, taken in the GEMM."""
        from . import ScreenOut

        B = h.shape[0]
        if B == 0:
            y = torch.empty((0, self.s.shape[0])) if self.bias is None else self.bias.expand(0, -1).clone()
            return ScreenOut(y, self.radius, True, self.n, torch.empty(0), REL)
        outliers = outlier_channels(h, self._outlier_rows)
        if outliers is not None:
            return self._center_radius_split(h, outliers)
        # The activations: t_b, p_b and e_b of the module docstring, and the folded scale c
        # (0.0: rows scaled one by one). One fused kernel on the CPU (vllm_csv.ops.rows).
        x, scale, e, c = self._quantize_act7(h, self.s_min, self.s_max)
        bmax = None
        if self._fused_block_max:
            y, bmax = self.gemm.linear_block_max(x, BLOCK)  # the search's block maxima, same pass
        else:
            y = self.gemm.linear(x)
        row_scale = apply_row_scale(y, scale, c, defer_row_scale, self.bias)
        if not c and row_scale is None:
            bmax = None  # y scaled after the GEMM took its block maxima
        out = ScreenOut(y, self.radius, True, self.n, e, REL, row_scale, bmax)
        if self.bias is not None:
            out.y += self.bias
        return out

    def _columns(self, cols: torch.Tensor) -> torch.Tensor:
        """``[m, V]`` fp32: the head's weight columns ``cols`` (exact), each gathered once and kept
        (a strided gather reads a cache line of every row of ``W``; a model's outlier channels are
        the same few from token to token). At most :data:`COLUMN_CACHE` are kept."""
        cache = self._col_cache
        out = []
        for j in cols.tolist():
            col = cache.get(j)
            if col is None:
                if len(cache) >= COLUMN_CACHE:
                    cache.pop(next(iter(cache)))  # the oldest
                col = cache[j] = self.weight[:, j].float().contiguous()
            out.append(col)
        return torch.stack(out)

    def _center_radius_split(self, h: torch.Tensor, cols: torch.Tensor):
        """:meth:`center_radius` with the channels ``cols`` split off (module docstring, "Outlier
        channels"): ``y = fl(y' + fl(h_O W_O^T))``, ``e = e' + (3u + gamma_m)(1 + gamma_m) rho ||h_O||``."""
        from . import ScreenOut

        hq = h.index_fill(1, cols, 0)
        x, scale, e, c = self._quantize_act7(hq, self.s_min, self.s_max)
        y = self.gemm.linear(x)
        apply_row_scale(y, scale, c, False, None)  # (scaled in place: y_O is added to the center)
        hO = h.index_select(1, cols).float()  # exact
        y += matmul32(hO, self._columns(cols))  # m products a token, fp32 (IEEE: fp.matmul32)
        m = cols.numel()
        coef = (3 * FP32_UNIT_ROUNDOFF + gamma(m)) * (1 + gamma(m)) * self.rho
        nO = torch.linalg.vector_norm(hO.double(), dim=1)
        e = round_up32(e.double() + coef * nO) * (1 + 4 * FP32_UNIT_ROUNDOFF)
        out = ScreenOut(y, self.radius, True, self.n, e, REL_SPLIT)
        if self.bias is not None:
            out.y += self.bias
        return out


def outlier_channels(h: torch.Tensor, outlier_rows=rows.outlier_rows) -> torch.Tensor | None:
    """The channels of ``h [B, d]`` above :data:`OUTLIER_RATIO` times the rms of the rest of their
    row in some row (ascending; the :data:`MAX_OUTLIERS` largest), or None (the common case: one
    host read; also rows of at most ``2 MAX_OUTLIERS`` channels). Rows with NaN/inf contribute
    none (they go dense); a zero row none. ``outlier_rows``: :func:`vllm_csv.ops.rows.outlier_rows`,
    or the implementation a screen bound when it was built."""
    rows = outlier_rows(h, OUTLIER_RATIO, MAX_OUTLIERS)  # one pass on the CPU
    if not bool(rows.any()):
        return None
    # the rms of the rest of each such row, its MAX_OUTLIERS largest left out (a few equal
    # outliers would otherwise raise the rms they are measured against); float64: a tiny row's
    # squares do not underflow
    a = h[rows].double().abs().nan_to_num(0.0, 0.0, 0.0)
    rest = a.sort(dim=1, descending=True).values[:, MAX_OUTLIERS:]
    rms = rest.pow(2).mean(1, keepdim=True).sqrt()
    big = a > OUTLIER_RATIO * rms
    if not bool(big.any()):
        return None
    cols = big.any(0).nonzero().squeeze(1)
    if cols.numel() > MAX_OUTLIERS:
        cols = cols[a.amax(0)[cols].topk(MAX_OUTLIERS).indices].sort().values
    return cols
