"""The audit's hostile cases (:mod:`.audit` checks them against the dense head).

One :class:`Case` is a head (weights, bias, soft-cap, scale, dtype), a batch of hidden states
and a ``k``. :data:`FAMILIES` draws cases from a ``torch.Generator``; each family aims at one
way a certificate can go wrong:

============== ==============================================================================
family         what it attacks
============== ==============================================================================
peaked         ordinary learned-like heads (the fallback share is measured here)
near_tie       near-ties at the k-th place (rows differing by a few ulps)
ties           duplicate rows, zero rows, ``h = 0``: exact ties broken by the lowest id
overflow       dense logits at and beyond the dtype's largest finite value (ties at ``inf``)
transform      soft-cap from 1e-3 to 1e6 and scale from 1e-3 to 1e3: saturation, underflow,
               overflow inside the engine's dtype
bias_cancel    a large bias cancelling ``<w, h>``: rounding terms must bound the pre-bias product
nonfinite      NaN/inf in the head, the bias or the hidden state
norms          hidden-state norms from 1e-30 to 1e30 and outlier dimensions
accumulator    products that overflow the fp32 accumulator while the screen's values stay small
subnormal      subnormal weights and hidden states (flush-to-zero engines drop them)
outliers       outlier channels in the hidden state (the int8 screen's split)
============== ==============================================================================

Also :func:`regressions` (the holes audits found, as fixed cases), :func:`aligned_residual` (a
rival inside a token's quantisation radius, per screen) and :class:`flush_to_zero`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .heads import hidden_near_rows

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class Case:
    family: str
    weight: torch.Tensor  # [V, d] model dtype
    bias: torch.Tensor | None  # [V] model dtype
    hidden: torch.Tensor  # [B, d] model dtype
    k: int
    softcap: float | None = None
    scale: float = 1.0


# ---- families -------------------------------------------------------------------------------
def _shape(g: torch.Generator, vmax: int = 700, dmax: int = 70) -> tuple[int, int, int]:
    V = int(torch.randint(2, vmax, (1,), generator=g))
    d = int(torch.randint(1, dmax, (1,), generator=g))
    B = int(torch.randint(1, 65, (1,), generator=g))
    return V, d, B


def _pick(g: torch.Generator, options):
    return options[int(torch.randint(0, len(options), (1,), generator=g))]


def _k(g: torch.Generator, V: int) -> int:
    return min(V, _pick(g, (1, 1, 2, 3, 5, 8)))


def peaked(g, dtype) -> Case:
    V, d, B = _shape(g)
    W = torch.randn(V, d, generator=g) / max(1, d) ** 0.5
    b = torch.randn(V, generator=g) if _pick(g, (False, True)) else None
    h = hidden_near_rows(W, B, g)  # (W fp32: the same draws and values)
    return Case("peaked", W.to(dtype), None if b is None else b.to(dtype), h.to(dtype), _k(g, V))


def near_tie(g, dtype) -> Case:
    """Groups of rows equal up to a few ulps of the dtype: the k-th place is contested."""
    V, d, B = _shape(g)
    k = _k(g, V)
    W = torch.randn(V, d, generator=g)
    base = int(torch.randint(0, V, (1,), generator=g))
    n = min(V, k + 1 + int(torch.randint(0, 4, (1,), generator=g)))
    ulps = torch.finfo(dtype).eps * _pick(g, (0.5, 1.0, 2.0, 4.0))
    W[:n] = W[base] * (1 + ulps * torch.randint(-2, 3, (n, 1), generator=g))
    W = W[torch.randperm(V, generator=g)]
    h = W[torch.randint(0, V, (B,), generator=g)] * _pick(g, (1.0, 10.0, 100.0))
    h = h + 1e-3 * torch.randn(B, d, generator=g)
    return Case("near_tie", W.to(dtype), None, h.to(dtype), k)


def ties(g, dtype) -> Case:
    V, d, B = _shape(g)
    W = torch.randn(V, d, generator=g)
    src = torch.randint(0, V, (max(1, V // 4),), generator=g)
    dst = torch.randint(0, V, (max(1, V // 4),), generator=g)
    W[dst] = W[src]  # duplicate rows: exact ties
    W[torch.randint(0, V, (max(1, V // 8),), generator=g)] = 0.0
    h = W[torch.randint(0, V, (B,), generator=g)] * 4
    h[torch.rand(B, generator=g) < 0.2] = 0.0  # every logit equal (zero, or the bias)
    b = torch.randint(-2, 3, (V,), generator=g).float() if _pick(g, (False, True)) else None
    return Case("ties", W.to(dtype), None if b is None else b.to(dtype), h.to(dtype), _k(g, V))


def overflow(g, dtype) -> Case:
    """The largest dense logits land near, at and beyond the dtype's largest finite value."""
    V, d, B = _shape(g, 200, 16)
    fmax = torch.finfo(dtype).max
    W = torch.rand(V, d, generator=g) + 0.5  # positive rows: <w, h> grows with |h|
    W[: min(V, 3)] = W[0]  # ties that become ties at inf
    h = torch.rand(B, d, generator=g) + 0.5
    target = fmax * _pick(g, (0.05, 0.2, 0.3, 0.9, 1.0, 1.01, 2.0, 10.0))
    h = h * (target / (W.norm(dim=1).max() * h.norm(dim=1, keepdim=True)).clamp_min(1e-30))
    W, h = W.to(dtype), h.to(dtype)
    scale = _pick(g, (1.0, 1.0, 2.0))
    return Case("overflow", W, None, h, _k(g, V), None, scale)


def transform(g, dtype) -> Case:
    """Extreme soft-cap and scale: saturation and underflow into ties, overflow of ``scale z``."""
    c = _pick(g, (peaked, near_tie))(g, dtype)
    c.family = "transform"
    c.softcap = _pick(g, (None, 1e-3, 0.5, 30.0, 1e6))
    c.scale = _pick(g, (1.0, 1e-3, 0.7, 2.0, 1e3))
    if _pick(g, (False, True)):
        c.hidden = (c.hidden.float() * _pick(g, (1e-3, 100.0, 1e4))).to(dtype)
    return c


def bias_cancel(g, dtype) -> Case:
    """A bias of up to 1e4 that cancels ``<w_i, h>``. Small-integer weights and dyadic hidden
    states make every copy (int8, fp16) exact, so only the rounding terms stand between a
    certificate and a wrong token: they must bound the pre-bias product, not the logit."""
    V, d, B = _shape(g, 300, 8)
    W = torch.randint(-3, 4, (V, d), generator=g).float()
    h = torch.randint(-8, 9, (B, d), generator=g).float() * _pick(g, (2.0**-4, 1.0, 2.0**7))
    mag = _pick(g, (10.0, 1e3, 1e4))
    lead = (W @ h[0]).to(dtype).float()  # row 0: the bias cancels the (rounded) product
    b = -lead + torch.randint(-2, 3, (V,), generator=g).float() * _pick(g, (2.0**-6, 0.01, 1.0))
    b = torch.where(torch.rand(V, generator=g) < 0.7, b, mag * torch.randn(V, generator=g))
    return Case("bias_cancel", W.to(dtype), b.to(dtype), h.to(dtype), _k(g, V))


def nonfinite(g, dtype) -> Case:
    c = peaked(g, dtype)
    c.family = "nonfinite"
    bad = _pick(g, (math.nan, math.inf, -math.inf))
    where = _pick(g, ("weight", "bias", "hidden", "hidden"))
    if where == "weight":
        c.weight = c.weight.clone()
        c.weight.view(-1)[int(torch.randint(0, c.weight.numel(), (1,), generator=g))] = bad
    elif where == "bias":
        b = torch.zeros(c.weight.shape[0], dtype=dtype) if c.bias is None else c.bias.clone()
        b[int(torch.randint(0, b.numel(), (1,), generator=g))] = bad
        c.bias = b
    else:
        c.hidden = c.hidden.clone()
        c.hidden.view(-1)[int(torch.randint(0, c.hidden.numel(), (1,), generator=g))] = bad
    return c


def norms(g, dtype) -> Case:
    c = peaked(g, dtype)
    c.family = "norms"
    h = c.hidden.float()
    h = h * torch.tensor(_pick(g, ((1e-30,), (1e-8,), (1e8,), (1e30,), (1e-8, 1.0, 1e8))))[
        torch.randint(0, 1, (h.shape[0],), generator=g)][:, None]
    if _pick(g, (False, True)):
        h[:, int(torch.randint(0, h.shape[1], (1,), generator=g))] *= 1e4  # outlier dimension
    c.hidden = h.to(dtype)
    return c


def accumulator(g, dtype) -> Case:
    """Finite rows whose products and partial sums reach fp32's range inside the dense GEMM
    (products of opposite signs round to ``-inf`` and ``inf``: NaN logits, which the dense argmax
    takes), half of them in cancelling pairs whose sums would be small (issue 42). In fp16 no
    product can get there: the family is then an ordinary one."""
    V, d, B = _shape(g, 200, 16)
    W = torch.randn(V, d, generator=g)
    h = torch.randn(B, d, generator=g)
    if _pick(g, (False, True)) and d >= 2:  # pairs: w_2j = -w_2j+1 (1 + small), h_2j = h_2j+1
        n = d // 2
        W[:, 1:2 * n:2] = -W[:, 0:2 * n:2] * (1 + 1e-3 * torch.rand(V, n, generator=g))
        h[:, 1:2 * n:2] = h[:, 0:2 * n:2]
    W[0] = 0.0  # a token whose logit is its bias alone
    target = torch.finfo(torch.float32).max * _pick(g, (0.01, 0.3, 1.0, 3.0, 100.0))
    h = h * (target / (W.abs().max() * h.abs().amax(1, keepdim=True)).clamp_min(1e-30))
    b = torch.rand(V, generator=g) * 1e-30
    return Case("accumulator", W.to(dtype), b.to(dtype), h.to(dtype), _k(g, V))


def outliers(g, dtype) -> Case:
    """Peaked rows with a few channels far above the rest (massive activations, as trained models
    grow them): the int8 screen splits them off (issue 45); sometimes more of them than it splits,
    some cancelling each other."""
    c = peaked(g, dtype)
    c.family = "outliers"
    h = c.hidden.float()
    d = h.shape[1]
    n = min(d, int(_pick(g, (1, 2, 3, 8, 12))))
    chans = torch.randperm(d, generator=g)[:n]
    factor = _pick(g, (5.0, 12.0, 40.0, 300.0, 1e4))
    h[:, chans] *= factor
    if n >= 2 and _pick(g, (False, True)):
        h[:, chans[1]] = -h[:, chans[0]]  # two that cancel
    c.hidden = h.to(dtype)
    return c


def subnormal(g, dtype) -> Case:
    """Heads and hidden states whose products and partial sums sit around fp32's smallest normal
    (``2^-126``): an engine that flushes subnormals to zero (AVX512-BF16 and AMX dot products,
    ``torch.set_flush_denormal(True)``) computes other logits than gradual underflow. Row 0 sums
    many tiny products, row 1 holds one larger product (issue 42). Run it under both
    (:func:`flush_to_zero`)."""
    V, d, B = _shape(g, 300, 64)
    ew = _pick(g, (-48, -56, -60, -64, -66, -70, -75))
    eh = _pick(g, (-48, -55, -60, -64, -66))
    W = torch.randn(V, d, generator=g) * 2.0**ew
    h = torch.randn(B, d, generator=g) * 2.0**eh
    W[0] = 2.0 ** (ew - 3)
    if V > 2:
        W[1] = 0.0
        W[1, 0] = 2.0 ** (ew + 3)
    return Case("subnormal", W.to(dtype), None, h.to(dtype), _k(g, V))


class flush_to_zero:
    """``with flush_to_zero(on):`` x86 flush-to-zero and denormals-are-zero modes
    (``torch.set_flush_denormal``), restored to IEEE after. The mode is a thread's (MXCSR), and
    torch's worker threads keep the mode they started with, so torch runs on this thread alone
    meanwhile (one intra-op thread). ``supported`` is False where the CPU cannot set them."""

    def __init__(self, on: bool = True):
        self.on = on
        self.supported = True

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self.supported = torch.set_flush_denormal(self.on) or not self.on
        return self

    def __exit__(self, *exc):
        torch.set_flush_denormal(False)
        torch.set_num_threads(self.threads)


def regressions() -> list[Case]:
    """The holes an adversarial audit found (issue 12), as fixed cases: each was certified
    with a token the dense head does not pick."""
    t = torch.tensor
    h16 = torch.float16
    return [
        # fp16 logits above 65504 tie at inf; the dense argmax gives the tie to id 0
        Case("fp16_overflow", t([[2.0], [3.0]], dtype=h16), None, t([[40000.0]], dtype=h16), 1),
        # scale 2 overflows in the model dtype although the raw logits do not
        Case("scale_overflow", t([[1.0], [1.25]], dtype=h16), None, t([[40000.0]], dtype=h16), 1,
             None, 2.0),
        # a bias that cancels <w, h>: the screen's output rounding is relative to <w, h>
        *[Case("bias_cancel_fixed", t([[0.0, 0.0], [1.0, 1.0]], dtype=dt), t([0.01, -1000.0], dtype=dt),
               t([[1000.0, 0.0625]], dtype=dt), 1) for dt in DTYPES],
        # NaN in the bias ranks first in the dense sort but is never a candidate
        Case("nan_bias", t([[1.0], [2.0], [3.0], [0.5]]), t([0.0, math.nan, 0.0, 0.0]), t([[1.0], [2.0]]), 2),
        # soft-cap 1e4 in fp16: z / softcap underflows into subnormals, logits 13 ulps apart tie
        Case("softcap_underflow", t([[0.01], [0.0101], [0.005]], dtype=h16), None, t([[1.0]], dtype=h16), 1, 1e4),
        # an inf in row 8's hidden state: the bf16 dense GEMM (torch 2.13 on an Intel Xeon with
        # AMX) wrote NaN over finite row 7, whose argmax was certified (CertifiedHead._prepare)
        _renamed(nonfinite(torch.Generator().manual_seed(4988550), torch.bfloat16), "nonfinite_batch"),
        # issue 42: finite fp32 inputs whose products overflow the accumulator to -inf and inf (the
        # dense logit of id 1 is NaN, its argmax), while the largest screen value stays tiny:
        # sampler_logits certified id 0 (CertifiedHead._accumulator_safe)
        Case("accumulator_overflow",
             t([[0.0, 0.0], [5624.15576171875, -5883.8056640625], [1444.3165283203125, -2056.38037109375]]),
             t([3.9839369646649254e-32, 1.1827089709103463e-30, 2.2532302656109826e-30]),
             t([[-3.2703789038413656e+35, -7.84651111293293e+34]]), 1),
    ]


def _renamed(case: Case, family: str) -> Case:
    case.family = family
    return case


FAMILIES: dict[str, Callable[[torch.Generator, torch.dtype], Case]] = {
    f.__name__: f for f in (peaked, near_tie, ties, overflow, transform, bias_cancel, nonfinite, norms,
                            accumulator, subnormal, outliers)}


def copy_residual(row: torch.Tensor, screen: str) -> torch.Tensor:
    """``w - deq(w)`` in float64 for one head row ``row [d]`` (model dtype): what the ``int8``
    (per-row int8) or ``int4`` (per-group int4, fp16 scales) screen's copy leaves out of it."""
    if screen == "int8":
        from ..screens.fbgemm import quantize_rows

        q, s = quantize_rows(row[None])
        deq = q.double() * s.double()[:, None]
    elif screen == "int4":
        from ..ops.int4_vnni import dequantized, quantize_int4

        deq = dequantized(*quantize_int4(row[None]))
    else:
        raise ValueError(f"no copy residual for screen {screen!r}")
    return row.double() - deq[0]


def aligned_residual(g: torch.Generator, dtype: torch.dtype, screen: str) -> Case:
    """The hidden state along the residual ``w_C - deq_C`` of one token's copy in ``screen``'s
    quantisation (``int8`` or ``int4``), on the activations' 7-bit grid two times in three (no
    activation residual): the screen's Cauchy-Schwarz term ``r_C ||h||`` is then nearly reached,
    which random hidden states never come near. A second token ``A`` (a multiple of ``h``: its
    copy is close to exact) is set just above or below ``C``'s dense logit, within that residual
    term, the other tokens small: where the radius is too small, ``C`` falls below the screen's
    threshold and ``A`` is certified in its place. Not in :data:`FAMILIES` (each case is made for
    one screen): ``tests/test_audit_aligned.py``. With the int8 screen's radius shrunk ten times,
    800 cases of the families above found no wrong row; these find it shrunk to 0.3."""
    V = _pick(g, (2, 3, 5, 40, 300))
    d = _pick(g, (8, 31, 64, 100, 257))
    W = (torch.randn(V, d, generator=g) / d**0.5).to(dtype)
    C = int(torch.randint(0, V, (1,), generator=g))
    res = copy_residual(W[C], screen)
    u = res / res.norm().clamp_min(1e-300)
    R = _pick(g, (1.0, 10.0, 1000.0))
    if _pick(g, (False, True, True)) and bool(res.any()):  # on the 7-bit grid: h = (t / 64) p exactly
        p = torch.round(63 * u / u.abs().max())
        h = (p * 2.0 ** round(math.log2(R / float(p.norm())))).to(dtype)
    else:
        h = (R * u).to(dtype)
    hd = h.double()
    zc = float(W[C].double() @ hd)
    part = abs(float(res @ hd))  # the part of z_C the copy misses
    eps = float(torch.empty(1).uniform_(-0.3, 1.1, generator=g))
    A = (C + 1) % V
    dot = float(u @ hd)
    if V > 1 and dot != 0.0:
        W[A] = (u * ((zc - eps * part) / dot)).to(dtype)
    rest = [i for i in range(V) if i not in (A, C)]
    if rest:
        W[rest] = (W[rest].float() * _pick(g, (0.0, 1e-3, 0.05))).to(dtype)
    B = _pick(g, (1, 2, 4))
    return Case("aligned_residual", W, None, h[None].repeat(B, 1), min(V, _pick(g, (1, 1, 2))))


# families built around rows the certificate must refuse (most of their rows): left out where a
# test asks that the certificate is not simply off
MOSTLY_REFUSED = ("accumulator", "subnormal")
