"""csrc kernels: they compile here (nvcc), and match their torch reference on a GPU."""

import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from vllm_csv.ops import has_cuda_kernels, int8_gemm, int8_screen, int8_screen_ref, pad_for_int_gemm
from vllm_csv.screens.quantized import quantize

CSRC = Path(__file__).parents[1] / "csrc"


def test_reference_matches_float64():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(257, 99, generator=g)
    h = torch.randn(5, 99, generator=g) * 10
    q, s = quantize(W, 8)
    y = int8_screen_ref(h, q, s)
    exact = h.double() @ (q.double() * s.double()).T
    assert torch.allclose(y.double(), exact, rtol=0, atol=1e-3)


def test_int8_gemm_is_exact_for_every_inner_dimension():
    """The screen's certificate assumes the integer GEMM is exact (torch's CPU ``_int_mm`` is
    not for ``d = 1``; :func:`pad_for_int_gemm` pads it away)."""
    g = torch.Generator().manual_seed(1)
    for d in range(1, 70):
        for B in (1, 3, 17):
            p = torch.randint(-127, 128, (B, d), dtype=torch.int8, generator=g)
            q = torch.randint(-127, 128, (61, d), dtype=torch.int8, generator=g)
            acc = int8_gemm(p, pad_for_int_gemm(q), 61)
            assert torch.equal(acc.long(), p.long() @ q.long().T), (d, B)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_sources_compile(tmp_path):
    r = subprocess.run(["nvcc", "-c", "-O3", "-arch=sm_90", str(CSRC / "int8_screen.cu"), "-o",
                        str(tmp_path / "k.o")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.skipif(not has_cuda_kernels(), reason="vllm_csv._C not built (pip install --no-build-isolation -e .)")
@pytest.mark.parametrize("B,V,d", [(1, 32768, 1024), (7, 1001, 99), (64, 4096, 4096), (65, 333, 16)])
def test_cuda_kernel_matches_reference(B, V, d):
    g = torch.Generator().manual_seed(B + V + d)
    W = torch.randn(V, d, generator=g)
    q, s = quantize(W, 8)
    h = torch.randn(B, d, generator=g)
    bias = torch.randn(V, generator=g)
    y = int8_screen(h.cuda(), q.cuda(), s.cuda(), bias.cuda()).cpu()
    ref = int8_screen_ref(h, q, s, bias)
    bound = 2 * (d + 2) * 2.0**-24 * ((q.float().abs() * s) @ h.abs().T).T + 1e-6
    assert ((y - ref).abs() <= bound).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])])
@pytest.mark.parametrize("B,V,d", [(1, 1001, 99), (17, 4096, 256), (64, 333, 4096), (5, 32768, 1024)])
def test_int8_gemm_is_exact(device, B, V, d):
    """The int32 product equals the exact integer product at the extremes (+-127 everywhere)."""
    g = torch.Generator().manual_seed(B * V + d)
    q = torch.randint(-127, 128, (V, d), generator=g, dtype=torch.int8)
    p = torch.randint(-127, 128, (B, d), generator=g, dtype=torch.int8)
    q[0], p[0] = 127, 127  # the largest possible sum: 127^2 d
    q[1], p[-1] = -127, -127
    acc = int8_gemm(p.to(device), pad_for_int_gemm(q.to(device)), V).cpu()
    assert acc.dtype == torch.int32 and acc.shape == (B, V)
    assert torch.equal(acc.long(), p.long() @ q.long().T)


@pytest.mark.parametrize("shape", [(32, 65536), (1, 7), (5, 0), (0, 3), (3, 1), (7,)])
def test_bool_reductions_equal_torch(shape):
    """ops.bools' any_ / all_ equal torch's any / all on every dim: random, all-False, all-True,
    one True, strided (a transposed view, an expanded row), empty."""
    from vllm_csv.ops.bools import all_, any_

    g = torch.Generator().manual_seed(0)
    r = torch.rand(shape, generator=g)
    cases = [r < 0.001, r < 0.5, torch.zeros(shape, dtype=torch.bool), torch.ones(shape, dtype=torch.bool)]
    if r.numel():
        one = torch.zeros(shape, dtype=torch.bool)
        one.view(-1)[r.numel() // 2] = True
        cases.append(one)
    if len(shape) == 2:
        cases += [c.t() for c in cases] + ([(r[:1] < 0.5).expand(4, -1)] if shape[0] else [])
    for x in cases:
        for dim in [None] + list(range(x.dim())):
            for fast, ref in ((any_, torch.Tensor.any), (all_, torch.Tensor.all)):
                want = ref(x) if dim is None else ref(x, dim)
                got = fast(x, dim)
                assert got.dtype == torch.bool and torch.equal(got, want), (fast.__name__, x.shape, dim)


def test_any_columns_is_any_over_the_rows_and_span():
    """ops.bools.any_columns (the certificate loops' contended columns) equals torch's any over
    the chosen rows, restricted to the span where one is given: every row, some, none, all
    chosen by mask; no span, a span, an empty one; empty and wide masks."""
    from vllm_csv.ops.bools import any_columns

    g = torch.Generator().manual_seed(4)
    for R, V in ((6, 65536), (1, 9), (4, 0), (0, 5)):
        x = torch.rand(R, V, generator=g) < 0.001 if V > 100 else torch.rand(R, V, generator=g) < 0.3
        for rows in (None, torch.ones(R, dtype=torch.bool), torch.arange(R) % 2 == 0, torch.zeros(R, dtype=torch.bool)):
            for span in (None, torch.randperm(V, generator=g)[: V // 3].sort().values, torch.zeros(0, dtype=torch.long)):
                sel = x if rows is None else x[rows]
                want = sel.any(0)
                if span is not None:
                    keep = torch.zeros(V, dtype=torch.bool)
                    keep[span] = True
                    want = want & keep
                got = any_columns(x, rows, span)
                assert got.dtype == torch.bool and got.shape == (V,) and torch.equal(got, want), (R, V, span is None)


@pytest.mark.parametrize("shape", [(32, 65536), (3, 70001), (1, 7), (5, 0), (0, 3), (13,), (2, 3, 65537)])
def test_flat_nonzero_equals_torch(shape):
    """ops.bools.flat_nonzero (csrc/cpu/bools_cpu.cpp where built) equals torch's nonzero of the
    flattened mask: sparse, half, none, all, one true element, the last element, strided views,
    chunk-straddling sizes, and bytes other than 0 and 1 viewed as bool (true, as torch reads them)."""
    from vllm_csv.ops.bools import flat_nonzero, flat_nonzero_ref
    from vllm_csv.ops.build import kernels_available

    g = torch.Generator().manual_seed(1)
    r = torch.rand(shape, generator=g)
    cases = [r < 0.001, r < 0.5, torch.zeros(shape, dtype=torch.bool), torch.ones(shape, dtype=torch.bool)]
    if r.numel():
        for at in (r.numel() // 2, r.numel() - 1, 0):
            one = torch.zeros(shape, dtype=torch.bool)
            one.view(-1)[at] = True
            cases.append(one)
        odd = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        odd[r < 0.7] = 0
        cases.append(odd.view(torch.bool))
    if len(shape) == 2:
        cases += [c.t() for c in cases] + ([(r[:1] < 0.5).expand(4, -1)] if shape[0] else [])
    for x in cases:
        want = x.reshape(-1).nonzero().squeeze(1)
        for fn in (flat_nonzero, flat_nonzero_ref):
            got = fn(x)
            assert got.dtype == torch.long and torch.equal(got, want), (fn.__name__, x.shape)
    if kernels_available() and r.numel():
        with pytest.raises(RuntimeError, match="bool"):
            torch.ops.vllm_csv_cpu.flat_nonzero(r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(8, 65536), (3, 70001), (1, 7), (5, 0), (0, 3)])
def test_neg_inf_rows_equals_torch(shape, dtype):
    """ops.bools.neg_inf_rows (csrc/cpu/bools_cpu.cpp where built) equals (x == -inf).sum(1):
    -inf among +inf, NaN (both signs, other payloads), -0.0, the most negative finite value and
    subnormals (none of them -inf), rows with none, some and only -inf, strided views."""
    from vllm_csv.ops.bools import neg_inf_rows, neg_inf_rows_ref

    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g).to(dtype)
    if x.numel():
        r = torch.rand(shape, generator=g)
        fi = torch.finfo(dtype)
        for lo, hi, v in ((0.0, 0.01, -math.inf), (0.01, 0.02, math.inf), (0.02, 0.03, math.nan),
                          (0.03, 0.04, -0.0), (0.04, 0.05, fi.min), (0.05, 0.06, -fi.smallest_normal / 4)):
            x[(r >= lo) & (r < hi)] = v
        bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
        nan = x.view(bits)  # a NaN with the sign bit and another payload: not -inf
        nan[(r >= 0.06) & (r < 0.07)] = -1
        x[0] = -math.inf
        if shape[0] > 1:
            x[1] = 0.0
    cases = [x] + ([x.t().contiguous().t(), x[:, ::2]] if x.numel() else [])
    for c in cases:
        want = (c == -math.inf).sum(1)
        for fn in (neg_inf_rows, neg_inf_rows_ref):
            got = fn(c)
            assert got.dtype == torch.long and torch.equal(got, want), (fn.__name__, c.shape, c.stride())


def test_mask_ops_bound_once_are_the_per_call_ops(monkeypatch):
    """The masks' passes bound once for a device (ops.masks.mask_ops, what a HeadAdapter holds)
    give the per-call ops' outputs bit for bit, and, bound to the kernels, never ask the build
    again (issue 43: backends bound once)."""
    from vllm_csv.ops import bools, build, masks, noise, topk

    g = torch.Generator().manual_seed(5)
    lo = torch.randn(3, 300, generator=g)
    hi = lo + torch.rand(3, 300, generator=g)
    hi[1, :7] = lo[1, :7] = -float("inf")
    at = torch.randn(3, generator=g)
    c = hi.amax(1, keepdim=True)
    el, eh = torch.exp(lo.double() - c.double()), torch.exp(hi.double() - c.double())
    qrow, qcol = torch.tensor([0, 1, 2, 2]), torch.tensor([0, 9, 5, 299])
    ih = torch.tensor([[0, 1], [2, 3], [4, 5]])
    calls = {
        "min_p_cut": (lo, hi, at, at - 1), "top_k_cut": (lo, hi, at, at - 1, at - 2),
        "top_p_sums": (lo, hi, el, eh, qrow, qcol), "unlisted_masses": (lo, hi, c, ih),
        "row_topk": (hi, 5), "flat_nonzero": (hi > 0.5,), "row_stats": (lo, hi, 3),
    }
    want = {name: getattr(masks.PER_CALL, name)(*args) for name, args in calls.items()}
    bound = masks.mask_ops(lo)
    assert (bound.row_topk is masks.row_topk_cpu) == build.kernels_available()
    if build.kernels_available():  # (bound: the build is not asked again)
        for module in (build, masks, topk, bools, noise):
            for name in ("load_ops", "uses_kernels", "cpu_supports"):
                if hasattr(module, name):
                    monkeypatch.setattr(module, name, lambda *a: pytest.fail("the build was asked"))
    for name, args in calls.items():
        got = getattr(bound, name)(*args)
        for x, y in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want[name])):
            assert x.dtype == y.dtype and torch.equal(x, y), name
