"""The certified V2 Gumbel draw on the device (:mod:`vllm_csv.gpu.gumbel_draw`): the Triton
kernels against their torch reference (odd V, ties, NaN/inf bounds, greedy, tiny and huge
temperatures), every certified draw against vLLM's own V2 ``gumbel_sample`` on the dense logits
with the same seeds and positions, the device rule never certifying a row the CPU rule
(:func:`vllm_csv.sampling.gumbel_v2.certify_draw_v2`) would not, and the whole fused draw
(:meth:`vllm_csv.gpu.step.FusedStep.draw_v2`) on heads.

On CUDA the kernels run compiled; elsewhere under Triton's interpreter, in a process started with
``TRITON_INTERPRET=1`` (``tests/test_gpu_kernels_interpreted.py`` starts it), where vLLM's
``gumbel.py`` is loaded with Triton imported directly (:func:`vllm_csv.testing.vllm_v2.load_vllm_v2_gumbel`)
and run in the same process.
"""

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from vllm_csv import CertifiedHead, HeadConfig  # noqa: E402
from vllm_csv.gpu.common import CAP, INTERPRET, SUB  # noqa: E402
from vllm_csv.gpu.gumbel_draw import (BPP, CODE_CERTIFIED, CODE_NOT_LIVE, CODE_TEMPERATURE,  # noqa: E402
                                      block_upper, gumbel_draw_ref, gumbel_draw_triton)
from vllm_csv.gpu.step import FusedStep  # noqa: E402
from vllm_csv.sampling.gumbel_v2 import certify_draw_v2  # noqa: E402
from vllm_csv.testing.heads import hidden_near_rows, peaked_head  # noqa: E402
from vllm_csv.testing.vllm_v2 import load_vllm_v2_gumbel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return INTERPRET and isinstance(triton.language.standard.zeros, InterpretedFunction)


pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or _interpreted()),
                                reason="on a CPU: run by test_gpu_kernels_interpreted.py, under the interpreter")


@pytest.fixture(scope="module")
def vllm_gumbel():
    mod = load_vllm_v2_gumbel()
    if mod is None:
        pytest.skip("no vLLM gumbel.py here")
    return mod


def vllm_draw(mod, x, seeds, pos, temp):
    """vLLM V2's ``gumbel_sample`` on ``x [B, V]`` fp32 (row i = request slot i), the temperature
    applied in its kernel (what ``_temperature_kernel`` then ``gumbel_sample`` compute: ``T``
    0 or 1 undivided either way, ``x / 1`` being ``x``)."""
    idx = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    return mod.gumbel_sample(x.float().contiguous().clone(), idx, temp.float().contiguous(), seeds.contiguous(),
                             pos.contiguous(), apply_temperature=True, is_drafting=False)


def _layout(x: torch.Tensor, nc, width=0.0):
    """The fused step's layout from dense logits ``x [B, V]``: the ``nc[b]`` blocks of largest
    maxima as candidates (ascending), their tokens' bounds ``x -+ width`` (``-inf`` past ``V``),
    every block's maximum (plus ``width``) as ``block_hi``."""
    B, V = x.shape
    nb = -(-V // SUB)
    pad = torch.full((B, nb * SUB), -math.inf, device=x.device)
    pad[:, :V] = x
    bmax = pad.view(B, nb, SUB).amax(2)
    cand = torch.full((B, CAP), -1, dtype=torch.int32, device=x.device)
    count = torch.zeros(B, dtype=torch.int32, device=x.device)
    lower = torch.full((B, CAP * SUB), -math.inf, device=x.device)
    upper = lower.clone()
    for b in range(B):
        n = min(int(nc[b]), nb, CAP)
        top = bmax[b].nan_to_num(nan=math.inf).topk(n).indices.sort().values
        cand[b, :n] = top.int()
        count[b] = int(nc[b]) if int(nc[b]) > CAP else n
        for c in range(n):
            v = pad[b, int(top[c]) * SUB:(int(top[c]) + 1) * SUB]
            lower[b, c * SUB:(c + 1) * SUB] = v - width
            upper[b, c * SUB:(c + 1) * SUB] = v + width
    return cand, count, lower, upper, bmax + width


def _rows(B, V, g, peak=6.0):
    """Rows of logits: Gaussian bulk (scale 1-3), a few peaked tokens, exact ties at the top in
    some rows, a flat row, ``-inf`` stretches."""
    x = torch.randn(B, V, generator=g) * (1 + 2 * torch.rand(B, 1, generator=g))
    top = torch.randint(0, V, (B, 3), generator=g)
    x.scatter_(1, top, x.gather(1, top) + peak * torch.rand(B, 3, generator=g) + 2)
    if B > 2:
        x[1, top[1, 1]] = x[1, top[1, 0]]  # an exact tie between two peaks
        x[2] = 0.0  # flat: the noise decides
    if B > 4:
        x[4, : V // 2] = -math.inf
    return x.to(torch.bfloat16).float()


# ---- kernels against the reference ----------------------------------------------------------
@pytest.mark.parametrize("V", [1000, 777, 4099, BPP * SUB + 1])
def test_kernel_matches_reference(V):
    g = torch.Generator().manual_seed(V)
    B = 16
    x = _rows(B, V, g)
    nc = torch.randint(1, CAP + 1, (B,), generator=g)
    nc[5:10] = 2
    nc[3] = CAP + 3  # more blocks than the list holds (the caller's live refuses it; read the first CAP)
    width = 0.0
    cand, count, lower, upper, block_hi = _layout(x, nc, width)
    lower[5, 3] = math.nan  # a NaN bound: refused
    upper[6, 0] = math.inf  # a +inf bound: refused
    nb = block_hi.shape[1]
    outside = [i for i in range(nb) if i not in cand[7].tolist()]
    block_hi[7, outside[0]] = math.nan  # a NaN bound outside the candidates: refused
    lower[8], upper[8] = -math.inf, -math.inf  # nothing finite among the candidates
    block_hi[8] = -math.inf
    lower[9, 0:2], upper[9, 0:2] = 5.0, 5.0  # an exact tie (greedy row below): never certified
    lower[9, 2:], upper[9, 2:] = -3.0, -3.0
    block_hi[9] = -4.0
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g)
    seeds[:2] = torch.tensor([0, -1])
    pos = torch.randint(0, 2**20, (B,), generator=g)
    pos[0] = 2**31 - 1
    temp = torch.tensor([1.0, 0.7, 1.0, 0.5, 2.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1e-3, 1e3, 2.0**-126, 1e-40, -1.0,
                         math.nan])
    live = torch.ones(B, dtype=torch.int8)
    live[13] = 0
    args = [a.to(DEV) for a in (cand, count, lower, upper, block_hi, seeds, pos, temp, live)]
    tok, code = gumbel_draw_triton(*args, V)
    rtok, rcode = gumbel_draw_ref(*args, V)
    assert torch.equal(code, rcode) and torch.equal(tok, rtok), (code, rcode, tok, rtok)
    code = code.cpu()
    assert int(code[13]) == CODE_NOT_LIVE and int(code[14]) == CODE_TEMPERATURE and int(code[15]) == CODE_TEMPERATURE
    for r in (5, 6, 7, 8, 9):
        assert int(code[r]) != CODE_CERTIFIED, r
    assert int(code[0]) == CODE_CERTIFIED or int(code[11]) == CODE_CERTIFIED or int(code[10]) == CODE_CERTIFIED
    # the greedy row without the tie: the larger candidate, strictly
    lower[9, 0] = upper[9, 0] = 5.5
    args[2], args[3] = lower.to(DEV), upper.to(DEV)
    tok, code = gumbel_draw_triton(*args, V)
    assert int(code[9]) == CODE_CERTIFIED and int(tok[9]) == int(cand[9, 0]) * SUB


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_matches_reference_from_screen_maxima(dtype):
    """The first kernel turning the screen's block maxima into bounds (block_upper's arithmetic,
    operation for operation) against the reference; a NaN norm refuses its row."""
    g = torch.Generator().manual_seed(21)
    B, V = 10, 2111
    x = _rows(B, V, g)
    cand, count, lower, upper, bmax = _layout(x, torch.full((B,), 3))
    bmax = bmax - 0.01 * torch.rand(bmax.shape, generator=g)  # screen values a little off the logits
    hnorm = torch.rand(B, generator=g) * 8
    hnorm[4] = math.nan
    e = torch.rand(B, generator=g) * 0.1
    consts = (1e-3, 0.02, 1e-30, 1e-6, 2.0**-20, dtype)  # rad_max, act_coef, tiny, bslack_max, delta
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g)
    pos = torch.randint(0, 2**20, (B,), generator=g)
    temp = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.0, 1.5, 0.05, 3.0, 1.0, 0.7])
    live = torch.ones(B, dtype=torch.int8)
    args = [a.to(DEV) for a in (cand, count, lower, upper, bmax, seeds, pos, temp, live)]
    tail = [hnorm.to(DEV), e.to(DEV), *consts]
    tok, code = gumbel_draw_triton(*args, V, *tail)
    rtok, rcode = gumbel_draw_ref(*args, V, *tail)
    assert torch.equal(code, rcode) and torch.equal(tok, rtok), (code, rcode)
    assert int(code[4]) != CODE_CERTIFIED and bool((code == CODE_CERTIFIED).any())
    bh = block_upper(bmax.to(DEV), hnorm.to(DEV), e.to(DEV), dict(zip(
        ("rad_max", "act_coef", "tiny", "bslack_max", "delta"), consts[:5])), dtype)
    assert bool((bh[hnorm.isfinite()] >= bmax.to(DEV)[hnorm.isfinite()]).all())
    assert torch.equal(bh, bh.to(dtype).float()) or bool(torch.isnan(bh).any())


def test_fake_impl():
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, V = 3, 1000
    nb = -(-V // SUB)
    with FakeTensorMode(allow_non_fake_inputs=True):
        tok, code = torch.ops.vllm_csv_gpu.gumbel_draw(
            torch.zeros(B, CAP, dtype=torch.int32), torch.zeros(B, dtype=torch.int32), torch.zeros(B, CAP * SUB),
            torch.zeros(B, CAP * SUB), torch.zeros(B, nb), torch.zeros(B, dtype=torch.int64),
            torch.zeros(B, dtype=torch.int64), torch.ones(B), torch.ones(B, dtype=torch.int8), V)
        assert tok.shape == (B,) and tok.dtype == torch.int64 and code.shape == (B,) and code.dtype == torch.int32


# ---- against vLLM's own draw ---------------------------------------------------------------
@pytest.mark.parametrize("width", [0.0, 1e-3])
def test_certified_draws_equal_vllm_draws(vllm_gumbel, width):
    """Every certified row draws vLLM's token; the device rule certifies nothing the CPU rule (its
    per-token bounds spread over the blocks) refuses, and with exact candidates most peaked rows
    are certified."""
    g = torch.Generator().manual_seed(11)
    B, V = 48, 3001
    x = _rows(B, V, g, peak=10.0)
    nc = torch.full((B,), 6)
    cand, count, lower, upper, block_hi = _layout(x, nc, width)
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g)
    pos = torch.randint(0, 2**20, (B,), generator=g)
    temp = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.5, 1e-3])[torch.arange(B) % 6]
    live = torch.ones(B, dtype=torch.int8)
    args = [a.to(DEV) for a in (cand, count, lower, upper, block_hi, seeds, pos, temp, live)]
    tok, code = gumbel_draw_triton(*args, V)
    tok, code = tok.cpu(), code.cpu()
    cert = code == CODE_CERTIFIED
    want = vllm_draw(vllm_gumbel, x.to(DEV), seeds.to(DEV), pos.to(DEV), temp.to(DEV)).cpu()
    assert int(cert.sum()) >= B // 3, int(cert.sum())
    assert torch.equal(tok[cert], want[cert])
    # the CPU rule on the same bounds spread over every token (the tempered bounds per row)
    nb = block_hi.shape[1]
    ylo = torch.full((B, V), -math.inf)
    yhi = block_hi.repeat_interleave(SUB, 1)[:, :V].clone()
    ids = torch.arange(CAP * SUB)
    for b in range(B):
        n = int(count[b].clamp(max=CAP))
        for c in range(n):
            t = int(cand[b, c]) * SUB + torch.arange(SUB)
            keep = t < V
            ylo[b, t[keep]] = lower[b, c * SUB:(c + 1) * SUB][keep]
            yhi[b, t[keep]] = upper[b, c * SUB:(c + 1) * SUB][keep]
    from vllm_csv.sampling.gumbel_v2 import temperature_bounds

    greedy = temp == 0
    qlo, qhi = temperature_bounds(ylo, yhi, torch.where(greedy, 1.0, temp))
    qlo, qhi = torch.where(greedy[:, None], ylo, qlo), torch.where(greedy[:, None], yhi, qhi)
    w, cpu_cert, _ = certify_draw_v2(qlo, qhi, seeds, pos, greedy=greedy)
    assert not bool((cert & ~cpu_cert).any())
    assert torch.equal(w[cert], tok[cert])
    del ids, nb


def test_a_wrong_position_is_caught(vllm_gumbel):
    """The draw of the next position certified against vLLM's at this one: some rows differ (the
    test above has teeth)."""
    g = torch.Generator().manual_seed(12)
    B, V = 48, 3001
    x = _rows(B, V, g, peak=3.0)
    cand, count, lower, upper, block_hi = _layout(x, torch.full((B,), 8))
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g)
    pos = torch.randint(0, 2**20, (B,), generator=g)
    temp = torch.full((B,), 1.0)
    args = [a.to(DEV) for a in (cand, count, lower, upper, block_hi, seeds, pos + 1, temp,
                                torch.ones(B, dtype=torch.int8))]
    tok, code = (t.cpu() for t in gumbel_draw_triton(*args, V))
    want = vllm_draw(vllm_gumbel, x.to(DEV), seeds.to(DEV), pos.to(DEV), temp.to(DEV)).cpu()
    cert = code == CODE_CERTIFIED
    assert bool((tok[cert] != want[cert]).any())


# ---- the fused draw on heads ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V,d", [(4099, 64), (1000, 96)])
def test_fused_draw_matches_vllm(vllm_gumbel, V, d, dtype):
    """:meth:`FusedStep.draw_v2` on peaked rows: kernels and references agree, every certified
    token is vLLM's draw from the dense head's logits, the blocks' bounds hold every dense
    logit of their block, and a fair share of rows is certified."""
    W, g = peaked_head(V, d, seed=2, dtype=dtype)
    head = CertifiedHead(W.to(DEV), vocab_size=V, config=HeadConfig(budget=1.0, off_switch=False))
    st = FusedStep(head)
    B = 12
    h = hidden_near_rows(W.float(), B, g, scale=2.0).to(dtype)
    h[1] = (torch.randn(d, generator=g) * 0.05).to(dtype)  # flat: refused or drawn right
    h = h.to(DEV)
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g).to(DEV)
    pos = torch.randint(0, 2**20, (B,), generator=g).to(DEV)
    temp = torch.tensor([0.0, 0.5, 0.7, 1.0])[torch.arange(B) % 4].to(DEV)
    tok, code, count = st.draw_v2(h, seeds, pos, temp)
    dense = torch.nn.functional.linear(h.float(), head.weight.float()).to(dtype).float()
    want = vllm_draw(vllm_gumbel, dense, seeds, pos, temp)
    cert = code == CODE_CERTIFIED
    assert torch.equal(tok[cert], want[cert])
    assert int(cert.sum()) >= B // 3 and bool((cert & (temp > 0)).any()), (code, count)
    # the bound every block outside the candidates stands on
    from vllm_csv.gpu.quantize import quantize_rows_ref
    from vllm_csv.gpu.screen import screen_block_max_ref
    from vllm_csv.gpu.common import batch_tile

    p, t, e, hn, ok = quantize_rows_ref(h, True, batch_tile(B))
    bmax = screen_block_max_ref(p, st.q, st.s, t, st.sbias, B)
    bh = block_upper(bmax, hn, e, st.consts, dtype)
    nb = bh.shape[1]
    pad = torch.full((B, nb * SUB), -math.inf, device=h.device)
    pad[:, :V] = dense
    ok = ok.bool()
    assert bool((pad.view(B, nb, SUB).amax(2) <= bh)[ok].all())
