"""The fused GPU step (:mod:`vllm_csv.gpu`): each Triton kernel against its torch reference over
dtypes x shapes (odd V and d, padded vocabulary, bias), and the whole step against the dense
head on adversarial batches (ties, huge and tiny norms, subnormals, NaN/inf rows, flat rows).

On CUDA the kernels run compiled; elsewhere under Triton's interpreter, small shapes, in a
process started with ``TRITON_INTERPRET=1`` (``tests/test_gpu_kernels_interpreted.py`` starts it:
where Triton was imported before the variable was set, as vLLM does in the suite's process, its
own library functions such as ``tl.sum`` are compiled-mode objects the interpreter cannot call).
The graph-capture test needs CUDA (marked ``gpu``).
"""

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from vllm_csv import CertifiedHead, HeadConfig  # noqa: E402
from vllm_csv.dense_engine import ACC_LIMIT  # noqa: E402
from vllm_csv.gpu.certify import certify_rows_ref, certify_rows_triton  # noqa: E402
from vllm_csv.gpu.common import CAP, INTERPRET, SUB, batch_tile, slot_ids  # noqa: E402
from vllm_csv.gpu.quantize import quantize_rows_ref, quantize_rows_triton  # noqa: E402
from vllm_csv.gpu.score import score_blocks_ref, score_blocks_triton  # noqa: E402
from vllm_csv.gpu.screen import SCREEN_CONFIGS, screen_block_max_ref, screen_block_max_triton, screen_configs  # noqa: E402
from vllm_csv.gpu.select import select_blocks_ref, select_blocks_triton  # noqa: E402
from vllm_csv.gpu.step import FusedStep, GraphedStep  # noqa: E402
from vllm_csv.testing.exact import same_bits  # noqa: E402
from vllm_csv.testing.heads import hidden_near_rows, peaked_head  # noqa: E402
from vllm_csv.head import selection  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(1000, 96), (777, 129), (4099, 64)]  # odd V, odd d, a last block of 3 tokens


def _interpreted() -> bool:
    """Triton runs interpreted in this process, its own library included."""
    from triton.runtime.interpreter import InterpretedFunction

    return INTERPRET and isinstance(triton.language.standard.zeros, InterpretedFunction)


pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or _interpreted()),
                                reason="on a CPU: run by test_gpu_kernels_interpreted.py, under the interpreter")


def _head(V, d, dtype, bias=False, seed=0, pad=0):
    W, g = peaked_head(V + pad, d, seed=seed, dtype=dtype)
    b = (torch.randn(V + pad, generator=g) * 0.5).to(dtype) if bias else None
    head = CertifiedHead(W.to(DEV), None if b is None else b.to(DEV), vocab_size=V,
                         config=HeadConfig(budget=1.0, off_switch=False))
    return head, g


def _batch(W, B, g, dtype):
    """Peaked rows, a flat row, a tiny-norm and a subnormal row, a zero row."""
    h = hidden_near_rows(W.float().cpu(), B, g).float()
    if B > 1:
        h[1] = torch.randn(W.shape[1], generator=g) * 0.05  # flat: many near-ties
    if B > 3:
        h[2] *= 2.0**-60  # tiny norm (normal in every dtype but fp16, where it flushes to 0)
        h[3] = 0.0
    return h.to(dtype).to(DEV)


def _engine_dense(head, h):
    """The dense engine as the certificate models it: fp32 accumulation, one rounding to the
    model dtype (cuBLAS on a GPU; on the CPU computed in fp32 here, since a CPU bf16 GEMM may
    flush subnormals, a separate question of the dense engine's arithmetic)."""
    b = None if head.bias is None else head.bias.float()
    return torch.nn.functional.linear(h.float(), head.weight.float(), b).to(head.dtype).float()


# ---- kernels against references -----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [1024, 64])
def test_quantize_rows(dtype, tile, monkeypatch):
    """Kernel = reference bit for bit, both ways a program reads its row: one tile held in
    registers (d <= QUANTIZE_TILE), or passes over tiles (a tile of 64: three passes here)."""
    monkeypatch.setattr("vllm_csv.gpu.quantize.QUANTIZE_TILE", tile)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(9, 129, generator=g) * 3
    h[1, 5] = math.nan
    h[2, 0] = math.inf
    h[3] = 0.0
    h[4] *= 2.0**-130 if dtype != torch.float16 else 2.0**-20  # subnormal (fp16: small)
    h[5] = 1e38 if dtype != torch.float16 else 6e4  # finite; fp32/bf16: the norm overflows fp32
    h = h.to(dtype).to(DEV)
    p, t, e, hn, ok = quantize_rows_triton(h, True, 16)
    pr, tr, er, hnr, okr = quantize_rows_ref(h, True, 16)
    assert ok.dtype == torch.int8 and torch.equal(ok, okr) and torch.equal(p, pr) and torch.equal(t, tr)
    ok = ok.bool()
    assert not ok[1] and not ok[2] and ok[3]
    assert bool(ok[4]) == (dtype == torch.float16)  # subnormal entries (bf16, fp32): a DAZ engine drops them
    assert bool(ok[5]) == (dtype == torch.float16)
    # sound, and within 2^-18 of the float64 norms (the references' own slack is 2^-20); the
    # residual measured exactly (float128 is not at hand: a float64 sum of exact terms, in order)
    hh = h.double().masked_fill(~ok[:, None], 0)
    f = (hh - t[0].double()[:, None] * p[0, :9].double()) - t[1].double()[:, None] * p[1, :9].double()
    for got, want in ((e, f.norm(dim=1)), (hn, hh.norm(dim=1))):
        assert (got.double() >= want).all() and (got.double() <= want * (1 + 2.0**-18) + 2.0**-140).all()
    # the second code shrinks the residual (about 127 times on these rows)
    f1 = hh - t[0].double()[:, None] * p[0, :9].double()
    assert (e.double()[ok] * 30 <= f1.norm(dim=1)[ok] + 1e-30).all() or not ok.any()
    assert (p[:, 9:] == 0).all() and p.shape == (2, 16, 129) and t.shape == (2, 9)
    _, _, _, _, none = quantize_rows_triton(h, False, 16)
    assert not none.any()
    # the accumulator guard (DenseEngine.accumulator_safe): rows whose ||h|| max||w|| may overflow fp32
    wmax = 1e36
    okg = quantize_rows_triton(h, True, 16, wmax, 0.0)[4]
    assert torch.equal(okg, quantize_rows_ref(h, True, 16, wmax, 0.0)[4])
    assert torch.equal(okg.bool(), ok & (hn * wmax <= ACC_LIMIT))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V,d", SHAPES)
def test_screen_block_max(V, d, dtype):
    """Kernel = reference bit for bit, and the bounds hold every token's dense value: rounded to
    the model dtype, each block's upper bound is at least its tokens' dense logits and its lower
    bound at most their largest (ok rows)."""
    head, g = _head(V, d, dtype, bias=(V % 2 == 1))
    st = FusedStep(head)
    c = st.consts
    for B in (1, 5, 17) + ((33,) if V == 777 else ()):  # (33: a batch tile of 64, split in two and four)
        h = _batch(head.weight, B, g, dtype)
        p, t, e, hn, ok = quantize_rows_triton(h, True, batch_tile(B), st.guard_scale, st.babs_max)
        args = (p, st.q, st.s, t, st.sbias, B, hn, e, st.rad, st.nrm, c["delta"], c["cst"])
        got, want = screen_block_max_triton(*args), screen_block_max_ref(*args)
        for a, b in zip(got, want):
            assert a.shape == (B, -(-V // SUB)) and same_bits(a, b)
        for bt in screen_splits(batch_tile(B)):  # the batch tile split over programs: the same bits
            split = screen_block_max_triton(*args, config=(SUB, 64, 4, 1, bt) if INTERPRET else
                                            next(c for c in SCREEN_CONFIGS if c[4] == bt))
            assert all(same_bits(a, b) for a, b in zip(split, want)), bt
        dense = torch.nn.functional.pad(_engine_dense(head, h), (0, (-V) % SUB), value=-math.inf)
        dmax = dense.view(B, -1, SUB).amax(2)
        rows = ok.bool()
        assert (got[0].to(dtype).float() >= dmax)[rows].all()
        assert (got[1].to(dtype).float() <= dmax)[rows].all()


def screen_splits(BB: int) -> list[int]:
    """The batch-tile splits :func:`~vllm_csv.gpu.screen.screen_configs` tries for ``BB`` rows."""
    return sorted({c[4] for c in screen_configs(BB) if c[4]})


def test_screen_configs_split_only_wider_tiles():
    assert screen_splits(16) == [] and screen_splits(32) == [16] and screen_splits(64) == [16, 32]
    assert all(len(c) == 5 for c in SCREEN_CONFIGS)


def _case(V, d, dtype, B, bias, seed):
    """A head, its fused step and a batch of ``B`` rows (:func:`_batch`)."""
    head, g = _head(V, d, dtype, bias=bias, seed=seed)
    return head, FusedStep(head), _batch(head.weight, B, g, dtype)


def _selected(head, st, h, k):
    """``(umax, lmax, ok, (limit, babs_max))`` of ``h`` on the step's head (references)."""
    p, t, e, hn, ok = quantize_rows_ref(h, True, batch_tile(h.shape[0]), st.guard_scale, st.babs_max)
    c = st.consts
    umax, lmax = screen_block_max_ref(p, st.q, st.s, t, st.sbias, h.shape[0], hn, e, st.rad, st.nrm, c["delta"],
                                      c["cst"])
    return umax, lmax, ok, (c["limit"], c["babs_max"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V,d", SHAPES)
def test_select_blocks(V, d, dtype):
    head, st, h = _case(V, d, dtype, 6, bias=(d % 2 == 1), seed=2)
    k = torch.tensor([1, 2, 1, 3, 8, 5], dtype=torch.int32, device=DEV)
    umax, lmax, ok, consts = _selected(head, st, h, k)
    for cap in (CAP, 2):
        got = select_blocks_triton(umax, lmax, k, ok, *consts, cap, 8)
        want = select_blocks_ref(umax, lmax, k, ok, *consts, cap)
        for a, b in zip(got, want):
            assert same_bits(a, b) if a.is_floating_point() else torch.equal(a, b)
    # every block left out is below the k-th largest dense logit: its upper bound is, and outside
    # is the largest of them
    cand, count, outside, okb, live = want
    dense = _engine_dense(head, h)
    kth = dense.topk(8, dim=1).values.gather(1, (k.long() - 1)[:, None])[:, 0]
    rows = okb.bool() & live.bool()
    assert (outside.to(dtype).float() <= kth)[rows].all()
    ok[4] = 0  # one row that may not be certified: none of the batch is
    _, count, _, okb, _ = select_blocks_triton(umax, lmax, k, ok, *consts, CAP, 8)
    assert not okb.any() and (count == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V,d", SHAPES)
def test_score_blocks(V, d, dtype):
    B = 5
    head, st, h = _case(V, d, dtype, B, bias=(V % 2 == 0), seed=3)
    nb = -(-V // SUB)
    gen = torch.Generator().manual_seed(4)
    m = min(nb, CAP)
    cand = torch.full((B, CAP), -1, dtype=torch.int32)
    for r in range(B):  # m distinct blocks, the partial last one among them, ascending; -1 after
        pick = torch.cat([torch.tensor([nb - 1]), torch.randperm(nb - 1, generator=gen)[:m - 1]])
        cand[r, :m] = pick.sort().values.int()
    cand = cand.to(DEV)
    count = torch.tensor([CAP, 3, 1, 0, CAP + 5], dtype=torch.int32, device=DEV)
    got = score_blocks_triton(h, st.weight, st.bias, cand, count, st.coef, st.gam, st.tiny32)
    want = score_blocks_ref(h, st.weight, st.bias, cand, count, st.coef, st.gam, st.tiny32)
    ids = slot_ids(cand, count, V)
    valid = ids >= 0
    used = (torch.arange(CAP, device=DEV)[None] < count[:, None].clamp(max=CAP)).repeat_interleave(SUB, 1)
    assert torch.equal((torch.isinf(got[0]) & (got[0] < 0))[used], ~valid[used])  # past V: -inf
    # the float64 sums differ in order only: the intervals agree almost everywhere ...
    for a, b in zip(got, want):
        assert (a[used] == b[used]).float().mean() >= 0.99
    # ... and each holds the dense engine's value
    zt = _engine_dense(head, h).gather(1, ids.clamp_min(0))
    z, lo, up = (x.masked_fill(~valid, 0) for x in got)
    assert ((lo <= zt) & (zt <= up) | ~valid).all()
    assert ((z == zt) | (lo != up) | ~valid).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_certify_rows(dtype):
    V, d = 4099, 64
    head, g = _head(V, d, dtype, seed=5)
    W = head.weight
    W[7] = W[5]  # an exact tie between two tokens
    head = CertifiedHead(W, config=HeadConfig(budget=1.0, off_switch=False))
    st = FusedStep(head)
    B = 8
    h = _batch(W, B, g, dtype)
    h[4] = (W[5].float() * 40).to(dtype)  # rows whose top-1 is the tie 5 == 7
    h[5] = (W[5].float() * 40).to(dtype)
    k = torch.tensor([1, 1, 1, 1, 1, 4, 16, 2], dtype=torch.int32, device=DEV)
    need = torch.tensor([0, 0, 0, 0, 0, 1, 1, 0], dtype=torch.int8, device=DEV)
    umax, lmax, ok, consts = _selected(head, st, h, k)
    cand, count, tau, ok, live = select_blocks_ref(umax, lmax, k, ok, *consts, CAP)
    z, lo, up = score_blocks_ref(h, st.weight, None, cand, count, st.coef, st.gam, st.tiny32)
    args = (z, lo, up, cand, count, k, need, tau, ok, live, V, 16, dtype)
    got, want = certify_rows_triton(*args), certify_rows_ref(*args)
    assert torch.equal(got[2], want[2])
    cert = want[2] == 0
    assert torch.equal(got[0][cert], want[0][cert]) and same_bits(got[1][cert], want[1][cert])
    if dtype != torch.float32:  # (an fp32 value is rarely pinned to one number: no replay there)
        assert cert[4], "the replayed tie certifies a k = 1 row"
        assert got[0][4, 0] == 5
    if cert[5]:  # a tie inside the top-k: both kept, the lower id first (as a stable sort)
        assert got[0][5, :2].tolist() == [5, 7]


# ---- the step against the dense head --------------------------------------------------------
def _check_step(head, h, k, values):
    st = FusedStep(head)
    ids, vals, cert = st.topk(h, k, values=values)
    dense = _engine_dense(head, h)
    dv, di = torch.sort(dense, dim=1, descending=True, stable=True)
    assert torch.equal(ids[cert], di[cert, :k]), "a certified row differs from the dense head"
    if values:
        assert same_bits(vals[cert], dv[cert, :k])
    return cert


@pytest.mark.parametrize("dtype,k,values", [(dt, k, v) for dt in DTYPES for k, v in ((1, False), (1, True), (5, True))]
                         + [(torch.bfloat16, 12, True)])  # (k > 8: the sorting path; interpreted, 40 s)
def test_step_matches_dense(dtype, k, values):
    V, d = 4099, 96
    head, g = _head(V, d, dtype, bias=True, seed=6, pad=5)  # padded vocabulary, bias
    B = 12
    h = _batch(head.weight, B, g, dtype)
    cert = _check_step(head, h, k, values)
    # it certifies every row the reference head certifies, but for rows past its capacity
    ref = head.topk(h, k, values=values).certified
    kk = torch.full((B,), k, dtype=torch.int32, device=DEV)
    code = FusedStep(head).run(h, kk, torch.full((B,), int(values), dtype=torch.int8, device=DEV), k)[2]
    assert (cert | ~ref | (code == 2)).all(), (cert, ref, code)
    if k <= 5 and not (values and dtype == torch.float32):  # (fp32 values are rarely pinned to one
        assert cert.float().mean() >= 0.25, cert  # number; a random tail's top-12 rarely separates)
    hn = h.clone()
    hn[6, 3] = math.nan  # a NaN row: no row of the batch is certified (CertifiedHead.prepare)
    assert not _check_step(head, hn, k, values).any()


def test_step_accumulator_overflow():
    """Issue 42's reproducer: finite fp32 inputs whose products overflow the accumulator (the
    dense logit of id 1 is NaN): the fused step does not certify it."""
    from vllm_csv.testing import audit

    case = next(c for c in audit.regressions() if c.family == "accumulator_overflow")
    head = CertifiedHead(case.weight.to(DEV), case.bias.to(DEV), config=HeadConfig(budget=1.0, off_switch=False))
    ids, _, cert = FusedStep(head).topk(case.hidden.to(DEV), 1)
    assert not cert.any() and int(ids[0, 0]) == 1


def test_step_ties_and_huge():
    V, d = 3000, 64
    W, g = peaked_head(V, d, seed=7, dtype=torch.bfloat16)
    W[11] = W[10]
    W[12] = W[10]
    head = CertifiedHead(W.to(DEV), config=HeadConfig(budget=1.0, off_switch=False))
    h = (W[10].float()[None].repeat(4, 1) * torch.tensor([[30.0], [1e30], [2.0**-100], [1.0]])).bfloat16().to(DEV)
    cert = _check_step(head, h, 1, False)
    assert cert[0] and cert[1], cert  # the tie 10 == 11 == 12 replayed, at a normal and a huge norm
    W[0, 0] = math.inf  # a head that is not finite: nothing is certified
    head = CertifiedHead(W.to(DEV), config=HeadConfig(budget=1.0, off_switch=False))
    assert not _check_step(head, h, 1, False).any()


def test_fake_impls():
    """Every op traces with its fake implementation (shapes only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    head, g = _head(1000, 96, torch.bfloat16)
    st = FusedStep(head)
    with FakeTensorMode(allow_non_fake_inputs=True):
        h = torch.empty(3, 96, dtype=torch.bfloat16, device=DEV)
        k = torch.ones(3, dtype=torch.int32, device=DEV)
        ids, vals, code, count = st.run(h, k, k.to(torch.int8), 4)
        assert ids.shape == (3, 4) and vals.shape == (3, 4) and code.shape == (3,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_step_replays_eager():
    head, g = _head(32768, 256, torch.bfloat16)
    st = FusedStep(head)
    gs = GraphedStep(st, [1, 4, 16])
    for B in (1, 3, 4, 9):
        h = _batch(head.weight, B, g, torch.bfloat16)
        k = torch.ones(B, dtype=torch.int32, device=DEV)
        need = torch.zeros(B, dtype=torch.int8, device=DEV)
        want = st.run(h, k, need, 1)
        got = gs.run(h, k, need, 1)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch: a GPU of compute capability 9 or more")
def test_dependent_launches_give_the_same_step_and_draws(monkeypatch):
    """``VLLM_CSV_GPU_PDL=1`` (:func:`vllm_csv.gpu.common.pdl`): every kernel launched dependently
    and waiting first; the step eager and graph-replayed, and the V2 draw, bit for bit as without."""
    from vllm_csv.gpu import common

    head, g = _head(32768, 256, torch.bfloat16, bias=True, seed=9)
    st = FusedStep(head)
    B = 9
    h = _batch(head.weight, B, g, torch.bfloat16)
    k = torch.tensor([1, 2, 5, 1, 3, 1, 8, 1, 1], dtype=torch.int32, device=DEV)
    need = (torch.arange(B, device=DEV) % 2).to(torch.int8)
    seeds = torch.arange(B, dtype=torch.int64, device=DEV) * 7919
    pos = torch.arange(B, dtype=torch.int64, device=DEV) + 3
    temp = torch.linspace(0.0, 1.5, B, device=DEV)

    def outputs():
        return (*st.run(h, k, need, 8), *GraphedStep(st, [16]).run(h, k, need, 8), *st.draw_v2(h, seeds, pos, temp))

    monkeypatch.setattr(common, "_PDL", False)
    want = outputs()
    monkeypatch.setattr(common, "_PDL", True)
    assert common._launch().get("launch_pdl") is True
    for _ in range(3):
        got = outputs()
        assert all(same_bits(a, b) if a.is_floating_point() else torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("kval,values", [(1, False), (3, True)])
def test_head_selects_through_the_step(kval, values):
    """CertifiedHead's glue (``selection.select_fused``, what ``select`` takes on CUDA): the rows it and
    the head's own search both certify hold the same tokens (and, with values, the same bits)."""
    head, g = _head(4099, 96, torch.bfloat16, bias=True, seed=8)
    B = 10
    h = _batch(head.weight, B, g, torch.bfloat16)
    k = torch.full((B,), kval, device=DEV)
    need = torch.full((B,), values, dtype=torch.bool, device=DEV)
    got = selection.select_fused(FusedStep(head), h, k, need)
    want = selection.select_two_sided(head, h, k, need)
    assert got.exact.shape == want.exact.shape == (B, 4099) and got.exact.dtype == torch.bfloat16
    assert [r is None for r in got.reason] == got.certified.tolist()
    both = got.certified & want.certified
    assert both.sum() >= B // 2
    gi = torch.sort(got.exact[both].float(), dim=1, descending=True, stable=True).indices[:, :kval]
    wi = torch.sort(want.exact[both].float(), dim=1, descending=True, stable=True).indices[:, :kval]
    assert torch.equal(gi, wi)
    if values:
        assert same_bits(got.exact[both], want.exact[both])
    assert ((got.exact > -math.inf).sum(1)[got.certified] == kval).all()  # -inf off the top-k
