"""The certified V2 Gumbel draw on the device (:mod:`vllm_csv.gpu.gumbel_draw`, its first stages
:mod:`vllm_csv.gpu.draw_bounds`): the Triton kernels against their torch reference (odd V, ties,
NaN/inf bounds, greedy, tiny and huge temperatures), every certified draw against vLLM's own V2
``gumbel_sample`` on the dense logits with the same seeds and positions, the device rule never
certifying a row the CPU rule (:func:`vllm_csv.sampling.gumbel_v2.certify_draw_v2`) would not, and
the whole fused draw (:meth:`vllm_csv.gpu.step.FusedStep.draw_v2`) on heads.

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
from vllm_csv.gpu.common import CAP, INTERPRET, SUB, slot_ids  # noqa: E402
from vllm_csv.gpu.draw_bounds import (block_bounds_ref, block_bounds_triton, block_upper,  # noqa: E402
                                      draw_select_ref, draw_select_triton, min_p_dropped_ref)
from vllm_csv.gpu.gumbel_draw import (BPP, CODE_CERTIFIED, CODE_NOT_LIVE, CODE_TEMPERATURE,  # noqa: E402
                                      gumbel_draw_ref, gumbel_draw_triton)
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


@pytest.fixture(scope="module")
def vllm_min_p():
    from vllm_csv.testing.vllm_v2 import load_vllm_v2_sample

    try:
        mod = load_vllm_v2_sample("min_p")
    except FileNotFoundError:
        mod = None
    if mod is None:
        pytest.skip("no vLLM min_p.py here (a machine without vLLM)")
    return mod


def vllm_min_p_draw(mod, mp_mod, x, seeds, pos, temp, min_p):
    """vLLM V2's sampler on ``x [B, V]`` fp32 with min-p: its ``apply_temperature``, ``apply_min_p``
    (``min_p.py``) then ``gumbel_sample`` without the temperature, as ``Sampler`` runs them."""
    idx = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    x = x.float().contiguous().clone()
    temp = temp.float().contiguous()
    mod.apply_temperature(x, idx, temp)
    mp_mod.apply_min_p(x, idx, min_p.float().contiguous())
    return mod.gumbel_sample(x, idx, temp, seeds.contiguous(), pos.contiguous(), apply_temperature=False,
                             is_drafting=False)


def vllm_draw(mod, x, seeds, pos, temp):
    """vLLM V2's ``gumbel_sample`` on ``x [B, V]`` fp32 (row i = request slot i), the temperature
    applied in its kernel (what ``_temperature_kernel`` then ``gumbel_sample`` compute: ``T``
    0 or 1 undivided either way, ``x / 1`` being ``x``)."""
    idx = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    return mod.gumbel_sample(x.float().contiguous().clone(), idx, temp.float().contiguous(), seeds.contiguous(),
                             pos.contiguous(), apply_temperature=True, is_drafting=False)


def _stages(x: torch.Tensor, seeds, pos, temp, live, cap=CAP, width=0.0, block_hi=None, kernels=True, min_p=None,
            masked=None, removed=None):
    """The draw on dense logits ``x [B, V]`` as the fused step lays it out: each block's bound the
    block's maximum (plus ``width``; or ``block_hi``), the candidate blocks chosen by
    :func:`draw_select`, their tokens' bounds ``x -+ width`` (``-inf`` past ``V``), the draw.
    Returns ``(token, code, cand, count, lower, upper, bound, out_hi, block_hi)`` (on ``DEV``)."""
    B, V = x.shape
    nb = -(-V // SUB)
    pad = torch.full((B, nb * SUB), -math.inf)
    pad[:, :V] = x
    if block_hi is None:
        block_hi = pad.view(B, nb, SUB).amax(2) + width
    bb, ds, gd = ((block_bounds_triton, draw_select_triton, gumbel_draw_triton) if kernels
                  else (block_bounds_ref, draw_select_ref, gumbel_draw_ref))
    min_p = torch.zeros(B) if min_p is None else min_p
    seeds, pos, temp, live, bh, min_p = (a.to(DEV) for a in (seeds, pos, temp, live, block_hi, min_p))
    bound, qhi = bb(bh, seeds, pos, temp, V)
    flat = bh.nan_to_num(0.0)
    cand, count, out_hi, out_abs, out_q, ok = ds(bound, qhi, flat, flat, live, math.inf, 0.0, cap)
    ids = slot_ids(cand, count, V).cpu()
    vals = pad.gather(1, ids.clamp_min(0))
    lower = torch.where(ids >= 0, vals - width, -math.inf).to(DEV)
    upper = torch.where(ids >= 0, vals + width, -math.inf).to(DEV)
    token, code = gd(cand, count, lower, upper, out_hi, out_abs, out_q, seeds, pos, temp, min_p, live, V,
                     None if masked is None else masked.to(DEV), None if removed is None else removed.to(DEV))
    return token, code, cand, count, lower, upper, bound, out_hi, block_hi


def _spread_tempered(cand, count, lower, upper, block_hi, temp, V):
    """``(qlo, qhi, greedy)``: the draw's bounds spread over every token (a candidate's own, each
    other token its block's ``block_hi``), through V2's temperature as the CPU rule takes them
    (a greedy row's untouched), for :func:`certify_draw_v2`."""
    from vllm_csv.sampling.gumbel_v2 import temperature_bounds

    B = lower.shape[0]
    ylo = torch.full((B, V), -math.inf)
    yhi = block_hi.repeat_interleave(SUB, 1)[:, :V].clone()
    ids = slot_ids(cand, count, V)
    for b in range(B):
        keep = ids[b] >= 0
        ylo[b, ids[b, keep]] = lower[b, keep]
        yhi[b, ids[b, keep]] = upper[b, keep]
    greedy = temp == 0
    qlo, qhi = temperature_bounds(ylo, yhi, torch.where(greedy, 1.0, temp))
    return torch.where(greedy[:, None], ylo, qlo), torch.where(greedy[:, None], yhi, qhi), greedy


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
def test_kernels_match_references(V):
    """Each of the three kernels against its reference on the same inputs (the first within an
    ulp: float64 logarithms of two libraries; the others bit for bit), over ties, NaN and
    ``+inf`` bounds, nothing finite, greedy rows, tiny, huge and unusable temperatures."""
    g = torch.Generator().manual_seed(V)
    B = 16
    x = _rows(B, V, g)
    x[8] = -math.inf  # nothing finite
    x[9, :] = -3.0  # an exact tie at the top (greedy row below): never certified
    x[9, 5] = x[9, 700] = 5.0
    nb = -(-V // SUB)
    pad = torch.full((B, nb * SUB), -math.inf)
    pad[:, :V] = x
    block_hi = pad.view(B, nb, SUB).amax(2)
    block_hi[7, :] = math.nan  # NaN bounds on every block: more than the list holds, refused
    block_hi[6, 0] = math.inf  # one +inf block: a candidate (scored exactly)
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g)
    seeds[:2] = torch.tensor([0, -1])
    pos = torch.randint(0, 2**20, (B,), generator=g)
    pos[0] = 2**31 - 1
    temp = torch.tensor([1.0, 0.7, 1.0, 0.5, 2.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1e-3, 1e3, 2.0**-126, 1e-40, -1.0,
                         math.nan])
    live = torch.ones(B, dtype=torch.int8)
    live[13] = 0
    dev = [a.to(DEV) for a in (block_hi, seeds, pos, temp, live)]
    got = block_bounds_triton(*dev[:4], V)
    want = block_bounds_ref(*dev[:4], V)
    for a, b in zip(got, want):
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        assert bool((same | (torch.nextafter(b, a) == a)).all()) and float(same.float().mean()) > 0.99
    bound, qhi = want
    ok = live.to(DEV)
    flat = dev[0].nan_to_num(0.0)
    sel = [f(bound, qhi, flat, flat, ok, math.inf, 0.0, cap) for f in (draw_select_triton, draw_select_ref)
           for cap in (CAP, 3)]
    for a, b in zip(sel[0], sel[2]):
        assert torch.equal(a, b)
    for a, b in zip(sel[1], sel[3]):
        assert torch.equal(a, b)
    assert not bool(sel[0][5].any())  # one row not ok: none of the batch is (select_blocks' rule)
    cand, count, out_hi, out_abs, out_q, _ = sel[0]
    ids = slot_ids(cand, count, V).cpu()
    xs = torch.cat([x, torch.full((B, nb * SUB - V), -math.inf)], 1).gather(1, ids.clamp_min(0))
    lower = torch.where(ids >= 0, xs, -math.inf)
    upper = lower.clone()
    lower[5, 3] = math.nan  # a NaN candidate bound: refused
    upper[4, 1] = math.inf  # a +inf candidate bound: refused
    no_min_p = torch.zeros(B, device=DEV)
    args = [cand, count, lower.to(DEV), upper.to(DEV), out_hi, out_abs, out_q, *dev[1:4], no_min_p,
            torch.ones(B, dtype=torch.int8, device=DEV)]
    args[-1][13] = 0
    tok, code = gumbel_draw_triton(*args, V)
    rtok, rcode = gumbel_draw_ref(*args, V)
    assert torch.equal(code, rcode) and torch.equal(tok, rtok), (code, rcode, tok, rtok)
    # with min-p (none, usual values, 1 and above, NaN, negative, tiny), kernel and reference alike
    mp = torch.tensor([0.05, 0.1, 0.5, 0.9, 1.0, 2.0, math.nan, -0.1, 1e-30, 0.3, 0.05, 0.2, 0.1, 0.1, 0.1, 0.1])
    args[10] = mp.to(DEV)
    tok_mp, code_mp = gumbel_draw_triton(*args, V)
    rtok_mp, rcode_mp = gumbel_draw_ref(*args, V)
    assert torch.equal(code_mp, rcode_mp) and torch.equal(tok_mp, rtok_mp), (code_mp, rcode_mp, tok_mp, rtok_mp)
    cert_mp = code_mp.cpu() == CODE_CERTIFIED
    assert not bool(cert_mp[4:6].any())  # min-p 1 and 2: no token is surely kept
    none = torch.isnan(mp) | (mp <= 0)  # NaN and negative min-p: none, as the kernel reads them
    assert torch.equal(code_mp.cpu()[none], code.cpu()[none]) and torch.equal(tok_mp.cpu()[none], tok.cpu()[none])
    assert int(cert_mp.sum()) >= 3, code_mp
    # with a grammar's mask (the candidates' likeliest tokens forbidden in some rows), alike again
    masked = torch.rand(B, V, generator=g) < 0.3
    masked[:4, ids[:4].clamp_min(0)[:, :8].flatten()] = True
    masked[10] = True  # everything forbidden: nothing to draw, refused
    tok_m, code_m = gumbel_draw_triton(*args, V, masked.to(DEV))
    rtok_m, rcode_m = gumbel_draw_ref(*args, V, masked.to(DEV))
    assert torch.equal(code_m, rcode_m) and torch.equal(tok_m, rtok_m), (code_m, rcode_m)
    cert_m = code_m.cpu() == CODE_CERTIFIED
    assert not bool(cert_m[10]) and not bool(masked[cert_m, tok_m.cpu()[cert_m]].any())
    # with a removed token (a candidate, the row's best, in half the rows), min-p on, alike again
    removed = torch.where(torch.arange(B) % 2 == 0, x.argmax(1), -1)
    tok_r, code_r = gumbel_draw_triton(*args, V, None, removed.to(DEV))
    rtok_r, rcode_r = gumbel_draw_ref(*args, V, None, removed.to(DEV))
    assert torch.equal(code_r, rcode_r) and torch.equal(tok_r, rtok_r), (code_r, rcode_r)
    cert_r = code_r.cpu() == CODE_CERTIFIED
    assert int(cert_r.sum()) >= 3 and not bool((tok_r.cpu() == removed)[cert_r].any())
    code = code.cpu()
    assert int(code[13]) == CODE_NOT_LIVE and int(code[14]) == CODE_TEMPERATURE and int(code[15]) == CODE_TEMPERATURE
    for r in (4, 5, 8, 9) + ((7,) if nb > CAP else ()):  # (every block a candidate: all scored exactly)
        assert int(code[r]) != CODE_CERTIFIED, r
    assert int((code == CODE_CERTIFIED).sum()) >= 4, code
    # the greedy row without the tie: the larger token, strictly
    args[2][9][ids[9] == 700] = 5.5
    args[3][9][ids[9] == 700] = 5.5
    tok, code = gumbel_draw_triton(*args, V)
    assert int(code[9]) == CODE_CERTIFIED and int(tok[9]) == 700


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_match_references_from_screen_bounds(dtype):
    """The first kernel taking the screen's block upper bounds to the model dtype (block_upper)
    and the selection's ``ok`` (the batch's, the overflow check of the row's largest upper bound)
    against the references; an overflowing row refuses itself, a row not ``ok`` the batch."""
    g = torch.Generator().manual_seed(21)
    B, V = 10, 2111
    nb = -(-V // SUB)
    umax = torch.randn(B, nb, generator=g) * 3
    lmax = umax - torch.rand(B, nb, generator=g) * 0.05
    umax[4, 3] = 1e35  # past the limits below: row 4 not ok
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g)
    pos = torch.randint(0, 2**20, (B,), generator=g)
    temp = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.0, 1.5, 0.05, 3.0, 1.0, 0.7])
    dev = [a.to(DEV) for a in (umax, seeds, pos, temp, lmax)]
    got = block_bounds_triton(*dev[:4], V, True, dtype)
    want = block_bounds_ref(*dev[:4], V, True, dtype)
    for a, b in zip(got, want):
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        assert bool((same | (torch.nextafter(b, a) == a)).all()) and float(same.float().mean()) > 0.99
    bh = block_upper(dev[0], dtype)
    assert torch.equal(bh, dev[0].to(dtype).float())
    if dtype != torch.float32:
        assert not torch.equal(bh, dev[0])  # rounded to the model dtype, both ways
    ok = torch.ones(B, dtype=torch.int8, device=DEV)
    oks = []
    for limit in (1e30, float(umax.amax(1).median()) + 0.6):
        a = draw_select_triton(*want, dev[0], dev[4], ok, limit, 0.5, CAP)
        b = draw_select_ref(*want, dev[0], dev[4], ok, limit, 0.5, CAP)
        assert all(torch.equal(u, v) for u, v in zip(a, b))
        oks.append(a[5].bool().cpu())
    assert not bool(oks[0][4]) and bool(oks[0][torch.arange(B) != 4].all())  # the overflowing row alone
    assert bool(oks[1].any()) and bool((oks[0] & ~oks[1]).any())  # a lower limit: the rows that may pass it
    ok0 = ok.clone()
    ok0[2] = 0
    for f in (draw_select_triton, draw_select_ref):
        assert not bool(f(*want, dev[0], dev[4], ok0, 1e30, 0.5, CAP)[5].any())  # one row not ok: none is
    # with min-p: the blocks it surely drops and the maximum's block first, kernel and reference alike
    min_p = torch.tensor([0.0, 0.05, 0.1, 0.3, 0.9, 1.0, math.nan, -1.0, 2.0, 0.2]).to(DEV)
    for cap in (CAP, 3):
        a = draw_select_triton(*want, dev[0], dev[4], ok, math.inf, 0.5, cap, dev[3], min_p, dtype)
        b = draw_select_ref(*want, dev[0], dev[4], ok, math.inf, 0.5, cap, dev[3], min_p, dtype)
        assert all(torch.equal(u, v) for u, v in zip(a, b)), (a, b)
    on, dropped, top = min_p_dropped_ref(want[1], dev[4], dev[3], min_p, dtype)
    assert not bool(on[[0, 6, 7, 8]].any()) and bool(on[[1, 2, 3]].all())  # T = 0; NaN, < 0, > 1: none
    assert not bool(dropped[~on].any()) and bool(dropped[on].any())
    assert not bool(dropped.gather(1, top[:, None]).any())  # the maximum's block is never dropped
    cand, count = a[0].cpu(), a[1].cpu()
    for r in torch.nonzero(on.cpu()).flatten().tolist():  # it is a candidate, and no dropped block is
        ids = cand[r, :count[r]]
        assert int(top[r]) in ids.tolist() and not bool(dropped[r].cpu()[ids.long()].any())


def test_select_keeps_every_block_above_the_last_value():
    """Ties at the ``n``-th largest bound come after every larger block: ``[5, 5, 5, 9]`` with
    two slots keeps 9 and the first 5 (a selection by index among ``>= 5`` kept 5, 5)."""
    bound = torch.tensor([[5.0, 5.0, 5.0, 9.0], [-math.inf, -math.inf, 1.0, -math.inf]], device=DEV)
    qhi = bound.clone()
    ok = torch.ones(2, dtype=torch.int8, device=DEV)
    for f in (draw_select_triton, draw_select_ref):
        cand, count = f(bound, qhi, bound, bound, ok, math.inf, 0.0, 2)[:2]
        assert cand.cpu()[0, :2].tolist() == [0, 3] and cand.cpu()[1, :2].tolist() == [0, 2], cand


def test_fake_impls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, V = 3, 1000
    nb = -(-V // SUB)
    ops = torch.ops.vllm_csv_gpu
    with FakeTensorMode(allow_non_fake_inputs=True):
        i64, f32 = torch.zeros(B, dtype=torch.int64), torch.ones(B)
        bound, qhi = ops.block_bounds(torch.zeros(B, nb), i64, i64, f32, V)
        assert bound.shape == qhi.shape == (B, nb)
        cand, count, out_hi, out_abs, out_q, ok = ops.draw_select(bound, qhi, torch.zeros(B, nb), torch.zeros(B, nb),
                                                                  torch.ones(B, dtype=torch.int8), 1e30, 0.0, CAP)
        assert cand.shape == (B, CAP) and count.shape == out_hi.shape == out_q.shape == ok.shape == (B,)
        tok, code = ops.gumbel_draw(cand, count, torch.zeros(B, CAP * SUB), torch.zeros(B, CAP * SUB), out_hi,
                                    out_abs, out_q, i64, i64, f32, f32, ok, V)
        assert tok.shape == (B,) and tok.dtype == torch.int64 and code.shape == (B,) and code.dtype == torch.int32


# ---- against vLLM's own draw ---------------------------------------------------------------
@pytest.mark.parametrize("width", [0.0, 1e-3])
def test_certified_draws_equal_vllm_draws(vllm_gumbel, width):
    """Every certified row draws vLLM's token; the device rule certifies nothing the CPU rule (its
    bounds spread over every token) refuses, and most rows are certified."""
    g = torch.Generator().manual_seed(11)
    B, V = 48, 3001
    x = _rows(B, V, g, peak=10.0)
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g)
    pos = torch.randint(0, 2**20, (B,), generator=g)
    temp = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.5, 1e-3])[torch.arange(B) % 6]
    live = torch.ones(B, dtype=torch.int8)
    tok, code, cand, count, lower, upper, _, _, block_hi = _stages(x, seeds, pos, temp, live, width=width)
    tok, code, cand, count, lower, upper = (t.cpu() for t in (tok, code, cand, count, lower, upper))
    cert = code == CODE_CERTIFIED
    want = vllm_draw(vllm_gumbel, x.to(DEV), seeds.to(DEV), pos.to(DEV), temp.to(DEV)).cpu()
    assert int(cert.sum()) >= B // 2, int(cert.sum())
    assert torch.equal(tok[cert], want[cert])
    # the CPU rule on the same bounds spread over every token (the tempered bounds per row)
    qlo, qhi, greedy = _spread_tempered(cand, count, lower, upper, block_hi, temp, V)
    w, cpu_cert, _ = certify_draw_v2(qlo, qhi, seeds, pos, greedy=greedy)
    assert not bool((cert & ~cpu_cert).any())
    assert torch.equal(w[cert], tok[cert])


def test_certified_min_p_draws_equal_vllm_draws(vllm_gumbel, vllm_min_p):
    """With min-p (V2's kernel after the temperature): every certified row draws vLLM's token, the
    device rule certifies nothing the CPU rule (:func:`~vllm_csv.sampling.gumbel_v2.min_p_bounds`
    then :func:`certify_draw_v2`, bounds spread over every token) refuses, most rows are
    certified, and min-p matters here: the draw certified without it differs from vLLM's in some
    rows (a hot temperature, a large min-p: the Gumbel winner of the whole row is dropped)."""
    from vllm_csv.sampling.gumbel_v2 import min_p_bounds

    g = torch.Generator().manual_seed(13)
    B, V = 64, 3001
    x = _rows(B, V, g, peak=4.0)
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g)
    pos = torch.randint(0, 2**20, (B,), generator=g)
    temp = torch.tensor([0.0, 0.7, 1.0, 1.5, 3.0, 5.0, 1.0, 2.0])[torch.arange(B) % 8]
    min_p = torch.tensor([0.05, 0.1, 0.3, 0.6, 0.9, 0.0, 1.0, 0.5, 0.2, 0.8, 0.95])[torch.arange(B) % 11]
    live = torch.ones(B, dtype=torch.int8)
    want = vllm_min_p_draw(vllm_gumbel, vllm_min_p, x.to(DEV), seeds.to(DEV), pos.to(DEV), temp.to(DEV),
                           min_p.to(DEV)).cpu()
    tok, code, cand, count, lower, upper, _, _, block_hi = _stages(x, seeds, pos, temp, live, width=1e-3,
                                                                    min_p=min_p)
    rtok, rcode = _stages(x, seeds, pos, temp, live, width=1e-3, min_p=min_p, kernels=False)[:2]
    tok, code, cand, count, lower, upper = (t.cpu() for t in (tok, code, cand, count, lower, upper))
    assert torch.equal(code, rcode.cpu()) and torch.equal(tok, rtok.cpu())
    cert = code == CODE_CERTIFIED
    assert int(cert.sum()) >= B // 2, int(cert.sum())
    assert torch.equal(tok[cert], want[cert])
    assert not bool(cert[min_p >= 1.0].any())
    # the CPU rule on the same bounds spread over every token
    qlo, qhi, greedy = _spread_tempered(cand, count, lower, upper, block_hi + 1e-3, temp, V)
    qlo, qhi, _ = min_p_bounds(qlo, qhi, min_p.masked_fill(greedy, 0.0))
    w, cpu_cert, _ = certify_draw_v2(qlo, qhi, seeds, pos, greedy=greedy)
    assert not bool((cert & ~cpu_cert).any())
    assert torch.equal(w[cert], tok[cert])
    # teeth: the same bounds certified without min-p miss vLLM's min-p draw somewhere
    tok0, code0 = (t.cpu() for t in _stages(x, seeds, pos, temp, live, width=1e-3)[:2])
    cert0 = code0 == CODE_CERTIFIED
    assert bool((tok0[cert0] != want[cert0]).any())


def test_certified_masked_draws_equal_vllm_draws(vllm_gumbel, vllm_min_p):
    """With a grammar's mask (``-inf`` on the forbidden tokens before the sampler: half the rows
    forbid their likeliest tokens and a random third of the others), with min-p on some rows and
    greedy ones: every certified row draws vLLM's token from the masked dense logits, most rows
    are certified, and the draw told no mask draws a forbidden token somewhere (teeth)."""
    g = torch.Generator().manual_seed(14)
    B, V = 48, 3001
    x = _rows(B, V, g, peak=6.0)
    masked = torch.rand(B, V, generator=g) < 0.3
    top = x.topk(3, dim=1).indices
    masked[torch.arange(0, B, 2)[:, None], top[::2]] = True
    masked[5] = False
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g)
    pos = torch.randint(0, 2**20, (B,), generator=g)
    temp = torch.tensor([0.0, 0.5, 0.7, 1.0, 1.5])[torch.arange(B) % 5]
    min_p = torch.tensor([0.0, 0.1, 0.0, 0.3])[torch.arange(B) % 4]
    live = torch.ones(B, dtype=torch.int8)
    xm = x.masked_fill(masked, -math.inf)
    want = vllm_min_p_draw(vllm_gumbel, vllm_min_p, xm.to(DEV), seeds.to(DEV), pos.to(DEV), temp.to(DEV),
                           min_p.to(DEV)).cpu()
    # (the blocks' bounds from the unmasked row, as the screen sees it)
    tok, code = (t.cpu() for t in _stages(x, seeds, pos, temp, live, width=1e-3, min_p=min_p, masked=masked)[:2])
    cert = code == CODE_CERTIFIED
    assert int(cert.sum()) >= B // 2, int(cert.sum())
    assert torch.equal(tok[cert], want[cert])
    assert not bool(masked[cert, tok[cert]].any())
    tok0, code0 = (t.cpu() for t in _stages(x, seeds, pos, temp, live, width=1e-3, min_p=min_p)[:2])
    cert0 = code0 == CODE_CERTIFIED
    assert bool(masked[cert0, tok0[cert0]].any())


def _vllm_draw_without(vllm_gumbel, vllm_min_p, x, seeds, pos, temp, min_p, removed):
    """vLLM V2's draw of rows ``x`` after a rejection: temperature, min-p (its threshold taken with
    the rejected token ``removed`` in the row), the token then set to ``-inf``, the Gumbel draw."""
    B = x.shape[0]
    idx = torch.arange(B, dtype=torch.int32, device=DEV)
    q = x.float().to(DEV).contiguous().clone()
    vllm_gumbel.apply_temperature(q, idx, temp.float().to(DEV))
    vllm_min_p.apply_min_p(q, idx, min_p.float().to(DEV))
    q[torch.arange(B, device=DEV), removed.to(DEV)] = -math.inf
    return vllm_gumbel.gumbel_sample(q, idx, temp.float().to(DEV), seeds.to(DEV), pos.to(DEV), apply_temperature=False,
                                     is_drafting=False).cpu()


def test_certified_draws_without_a_removed_token_equal_vllm_draws(vllm_gumbel, vllm_min_p):
    """V2's verification draws after a rejection from the row processed whole (min-p's threshold
    taken with the rejected draft in it), the draft then set to ``-inf``: with ``removed`` the
    row's best token and min-p on most rows, every certified row draws vLLM's token so computed and
    never the removed one, most rows are certified; the draw told to mask the token instead (the
    threshold taken without it) draws another token somewhere (teeth)."""
    g = torch.Generator().manual_seed(15)
    B, V = 64, 3001
    x = _rows(B, V, g, peak=2.0)
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g)
    pos = torch.randint(0, 2**20, (B,), generator=g)
    temp = torch.tensor([0.7, 1.0, 2.0, 3.0, 5.0])[torch.arange(B) % 5]
    min_p = torch.tensor([0.0, 0.3, 0.5, 0.8])[torch.arange(B) % 4]
    removed = x.argmax(1)
    live = torch.ones(B, dtype=torch.int8)
    want = _vllm_draw_without(vllm_gumbel, vllm_min_p, x, seeds, pos, temp, min_p, removed)
    tok, code = (t.cpu() for t in _stages(x, seeds, pos, temp, live, width=1e-3, min_p=min_p, removed=removed)[:2])
    cert = code == CODE_CERTIFIED
    assert int(cert.sum()) >= B // 3, int(cert.sum())
    assert torch.equal(tok[cert], want[cert]) and not bool((tok == removed)[cert].any())
    one_hot = torch.zeros(B, V, dtype=torch.bool).scatter_(1, removed[:, None], True)
    tok_m, code_m = (t.cpu() for t in _stages(x, seeds, pos, temp, live, width=1e-3, min_p=min_p, masked=one_hot)[:2])
    cert_m = code_m == CODE_CERTIFIED
    assert bool((tok_m[cert_m] != want[cert_m]).any())


def test_a_greedy_row_with_min_p_and_a_removed_token_is_not_certified(vllm_gumbel, vllm_min_p):
    """A greedy row (``T = 0``) whose min-p took its threshold with a token that is then removed:
    V2 masks every token below that threshold, the whole row possibly (token 0), so "min-p keeps
    the maximum" no longer holds; such a row is not certified, by the kernel and its reference
    alike (found by review: the runner-up was certified where vLLM drew token 0). Greedy rows
    without a min-p, and sampled rows, are certified as before."""
    g = torch.Generator().manual_seed(16)
    B, V = 24, 3001
    x = _rows(B, V, g, peak=2.0)
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g)
    pos = torch.randint(0, 2**20, (B,), generator=g)
    temp = torch.tensor([0.0, 0.0, 0.7, 1.0])[torch.arange(B) % 4]
    min_p = torch.tensor([0.9, 0.0, 0.0, 0.3, 0.5, 0.9])[torch.arange(B) % 6]
    removed = x.argmax(1)
    live = torch.ones(B, dtype=torch.int8)
    want = _vllm_draw_without(vllm_gumbel, vllm_min_p, x, seeds, pos, temp, min_p, removed)
    refused = (temp == 0) & (min_p > 0)
    for kernels in (True, False):
        tok, code = (t.cpu() for t in _stages(x, seeds, pos, temp, live, width=1e-3, min_p=min_p, removed=removed,
                                             kernels=kernels)[:2])
        cert = code == CODE_CERTIFIED
        assert not bool(cert[refused].any()) and bool(cert[(temp == 0) & (min_p == 0)].all())
        assert torch.equal(tok[cert], want[cert])


def test_a_wrong_position_is_caught(vllm_gumbel):
    """The draw of the next position certified against vLLM's at this one: some rows differ (the
    test above has teeth)."""
    g = torch.Generator().manual_seed(12)
    B, V = 48, 3001
    x = _rows(B, V, g, peak=3.0)
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g)
    pos = torch.randint(0, 2**20, (B,), generator=g)
    temp = torch.full((B,), 1.0)
    tok, code = (t.cpu() for t in _stages(x, seeds, pos + 1, temp, torch.ones(B, dtype=torch.int8))[:2])
    want = vllm_draw(vllm_gumbel, x.to(DEV), seeds.to(DEV), pos.to(DEV), temp.to(DEV)).cpu()
    cert = code == CODE_CERTIFIED
    assert bool((tok[cert] != want[cert]).any())


# ---- the fused draw on heads ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V,d", [(4099, 64), (1000, 96)])
def test_fused_draw_matches_vllm(vllm_gumbel, V, d, dtype):
    """:meth:`FusedStep.draw_v2` on peaked and softer rows, without min-p and with it (where vLLM's
    ``min_p.py`` is at hand): every certified token is vLLM's draw from the dense head's logits,
    the blocks' bounds hold every dense logit of their block, and
    most rows are certified."""
    from vllm_csv.testing.vllm_v2 import load_vllm_v2_sample

    try:
        vllm_min_p = load_vllm_v2_sample("min_p")
    except FileNotFoundError:
        vllm_min_p = None
    W, g = peaked_head(V, d, seed=2, dtype=dtype)
    head = CertifiedHead(W.to(DEV), vocab_size=V, config=HeadConfig(budget=1.0, off_switch=False))
    st = FusedStep(head)
    B = 12
    h = torch.cat([hidden_near_rows(W.float(), B // 2, g, scale=2.0), hidden_near_rows(W.float(), B // 2, g,
                                                                                       scale=1.0)]).to(dtype)
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
    assert int(cert.sum()) >= B // 2 and bool((cert & (temp > 0)).any()), (code, count)
    if vllm_min_p is not None:  # min-p on the same rows: vLLM's draw with its kernels
        min_p = torch.tensor([0.05, 0.2, 0.5, 0.1])[torch.arange(B) % 4].to(DEV)
        tok, code, count = st.draw_v2(h, seeds, pos, temp, min_p=min_p)
        want = vllm_min_p_draw(vllm_gumbel, vllm_min_p, dense, seeds, pos, temp, min_p)
        cert = code == CODE_CERTIFIED
        assert torch.equal(tok[cert], want[cert])
        assert int(cert.sum()) >= B // 2 and bool((cert & (temp > 0)).any()), (code, count)
        # the blocks min-p surely drops, from the screen alone, hold only tokens vLLM's min-p drops
        from vllm_csv.gpu.draw_bounds import block_bounds_ref

        umax, lmax, _ = bounds_of(st, h)
        qhi = block_bounds_ref(umax, seeds, pos, temp, V, True, dtype)[1]
        on, dropped, _ = min_p_dropped_ref(qhi, lmax, temp, min_p, dtype)
        x = dense.clone()
        idx = torch.arange(B, dtype=torch.int32, device=DEV)
        vllm_gumbel.apply_temperature(x, idx, temp.float().contiguous())
        vllm_min_p.apply_min_p(x, idx, min_p.float().contiguous())
        nb = qhi.shape[1]
        pad = torch.full((B, nb * SUB), -math.inf, device=x.device)
        pad[:, :V] = x
        kept = (pad.view(B, nb, SUB) > -math.inf).any(2)
        assert bool(dropped.any()) and not bool((dropped & kept).any())
    # the bound every block outside the candidates stands on
    umax, _, ok = bounds_of(st, h)
    bh = block_upper(umax, dtype)
    nb = bh.shape[1]
    pad = torch.full((B, nb * SUB), -math.inf, device=h.device)
    pad[:, :V] = dense
    ok = ok.bool()
    assert bool((pad.view(B, nb, SUB).amax(2) <= bh)[ok].all())


def bounds_of(st, h):
    """``(umax, lmax, ok)``: the screen's block bounds of ``h`` on the step's head (its quantize and
    screen stages, torch references)."""
    from vllm_csv.gpu.common import batch_tile
    from vllm_csv.gpu.quantize import quantize_rows_ref
    from vllm_csv.gpu.screen import screen_block_max_ref

    p, t, e, hn, ok = quantize_rows_ref(h, True, batch_tile(h.shape[0]), st.guard_scale, st.babs_max)
    c = st.consts
    umax, lmax = screen_block_max_ref(p, st.q, st.s, t, st.sbias, h.shape[0], hn, e, st.rad, st.nrm, c["delta"],
                                      c["cst"])
    return umax, lmax, ok


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_draw_v2_graph_replays_eager():
    """:meth:`FusedStep.draw_v2` captured in a CUDA graph (fixed shapes, no host sync) replays the
    eager draw, with new seeds and temperatures copied into its inputs."""
    V, d, B = 32768, 256, 8
    W, g = peaked_head(V, d, seed=6, dtype=torch.bfloat16)
    head = CertifiedHead(W.to(DEV), config=HeadConfig(budget=1.0, off_switch=False))
    st = FusedStep(head)
    h = hidden_near_rows(W.float(), B, g, scale=1.5).bfloat16().to(DEV)
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g).to(DEV)
    pos = torch.randint(0, 2**20, (B,), generator=g).to(DEV)
    temp = torch.full((B,), 0.7, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            st.draw_v2(h, seeds, pos, temp)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = st.draw_v2(h, seeds, pos, temp)
    for T in (0.7, 1.0, 0.0):
        seeds.copy_(torch.randint(-2**62, 2**62, (B,), generator=g).to(DEV))
        temp.fill_(T)
        graph.replay()
        want = st.draw_v2(h, seeds, pos, temp)
        assert all(torch.equal(a, b) for a, b in zip(out, want))
