"""vLLM V2's Gumbel draw on a GPU: vLLM's own Triton kernels compiled for the device, against the
replica and the draw certificate of vllm_csv/sampling/gumbel_v2.py, at real vocabulary sizes.

The CPU test (test_sampling_gumbel_v2.py) runs the same kernels in Triton's interpreter, whose
fp32 ``log`` and ``/`` are numpy's; here they are the GPU's. vLLM's
``vllm/v1/worker/gpu/sample/gumbel.py`` is loaded from the installed vLLM or, on a machine
without vLLM, from the path in ``VLLM_V2_GUMBEL_PY`` (a copy of that file, vLLM 0.32.0).
Checked: hash and uniform bit for bit and the noise within its bounds over 512 x 262144
tokens; vLLM's temperature division within :func:`gumbel_v2.temperature_bounds`; over 131072
rows, every certified draw equal to ``gumbel_sample``'s, with temperature; and
:func:`~vllm_csv.sampling.rows_v2.certify_rows_v2` on a CUDA head, its rows written as the V2
hook writes them, drawn to the dense tokens; the same with min-p and vLLM's logit-bias and
penalties kernels (``min_p.py``, ``logit_bias.py``, ``penalties.py``, loaded the same way or from
``VLLM_V2_SAMPLE_DIR``), and the GPU's ``log`` of min-p within its bounds. Skipped without CUDA.
"""

import math

import pytest
import torch

from vllm_csv.sampling import gumbel_v2
from vllm_csv.testing.vllm_v2 import NOISE_KERNEL, load_vllm_v2_gumbel, load_vllm_v2_sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def v2():
    mod = load_vllm_v2_gumbel(NOISE_KERNEL)
    if mod is None:
        pytest.skip("neither vLLM nor VLLM_V2_GUMBEL_PY")
    return mod


def _seeds_pos(R: int, g: torch.Generator):
    seeds = torch.randint(-2**62, 2**62, (R,), generator=g)
    seeds[:4] = torch.tensor([0, 1, 2**32 + 5, -1])
    pos = torch.randint(0, 2**20, (R,), generator=g)
    pos[:3] = torch.tensor([0, 1, 2**31 - 1])
    return seeds.cuda(), pos.cuda()


def test_noise_at_vocab_scale(v2):
    """512 rows x 262144 tokens (Gemma-3's vocabulary): r and u bit for bit, g within bounds."""
    g = torch.Generator().manual_seed(1)
    n, worst = 262144, 0.0
    for _ in range(4):
        seeds, pos = _seeds_pos(128, g)
        R = seeds.numel()
        r = torch.empty(R, n, dtype=torch.int64, device="cuda")
        u = torch.empty(R, n, dtype=torch.float32, device="cuda")
        gn = torch.empty(R, n, dtype=torch.float32, device="cuda")
        v2._csv_noise_kernel[(R, triton.cdiv(n, 1024))](seeds, pos, r, u, gn, n, BLOCK=1024)
        ids = torch.arange(n, device="cuda")
        assert torch.equal(gumbel_v2.murmur3(seeds, pos, ids), r)
        assert torch.equal(gumbel_v2.uniform(seeds, pos, ids), u)
        lo, hi = gumbel_v2.noise_bounds(seeds, pos, ids)
        gd = gn.double()
        assert bool(((lo <= gd) & (gd <= hi)).all())
        real = gumbel_v2.noise(u)
        worst = max(worst, float(((gd - real).abs() / (gumbel_v2.EPS_ABS + gumbel_v2.EPS_REL * real.abs())).max()))
    print(f"GPU noise: worst |g - g(u)| = {worst:.3f} of the bound's eps")


def test_temperature_division_within_bounds(v2):
    """vLLM's ``apply_temperature`` (Triton's fp32 ``/`` on the GPU) inside temperature_bounds, on
    logits over the whole fp32 range; reports how far it is from the correctly rounded quotient."""
    g = torch.Generator().manual_seed(2)
    R, n = 256, 65536
    x = torch.randn(R, n, generator=g) * torch.pow(10.0, torch.empty(R, n).uniform_(-40, 38, generator=g))
    x[:, :16] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.17549435e-38, 3.4028235e38, -3.4028235e38, 1.0,
                              -1.0, 0.5, 1e-30, 7.0, -math.inf, -math.inf, 2.0**-140, 2.0**127])
    temp = torch.cat([torch.tensor([1.0, 0.5, 2.0, 1e-5, 3.0, 0.7, 100.0, 1.3]),
                      torch.empty(R - 8).uniform_(0.05, 5.0, generator=g)])
    xc = x.cuda()
    out = xc.clone()
    v2.apply_temperature(out, torch.arange(R, dtype=torch.int32, device="cuda"), temp.cuda())
    lo, hi = gumbel_v2.temperature_bounds(xc, xc, temp.cuda())
    ok = (lo <= out) & (out <= hi)
    assert bool(ok.all()), (x[~ok.cpu()][:5], temp[(~ok.cpu()).any(1)][:5])
    exact = (x.double() / temp.double()[:, None]).float().cuda()  # correctly rounded (53 >= 2 * 24 + 2)
    fin = torch.isfinite(exact) & torch.isfinite(out) & (exact != 0)
    ulps = ((out.view(torch.int32).long() - exact.view(torch.int32).long()).abs())[fin]
    print(f"GPU temperature division: {float((ulps > 0).float().mean()):.2%} not correctly rounded, "
          f"worst {int(ulps.max())} ulps")


@pytest.mark.parametrize("width", [0.0, 1e-3])
def test_certified_draws_equal_gumbel_sample(v2, width):
    """131072 rows (64 batches of 2048, V 32768): vLLM's ``gumbel_sample`` with temperature applied
    in its kernel; every row certified from ``[x - width, x + width]`` draws vLLM's token."""
    g = torch.Generator().manual_seed(3)
    R, n, rows, cert, agree = 2048, 32768, 0, 0, 0
    scales = torch.tensor([0.1, 1.0, 4.0, 30.0])
    temps = torch.tensor([1.0, 0.7, 0.3, 1.3, 2.0])
    for b in range(64):
        seeds, pos = _seeds_pos(R, g)
        x = torch.randn(R, n, generator=g) * scales[torch.arange(R) % 4][:, None]
        x[:, 10:20] = x[:, 20:30]  # exact ties
        x[::5, 100:3000] = -math.inf
        x[7, 42] = 1e30
        x[9] = 0.0
        x[11, :] = 1e38  # overflows when divided by T < 1
        temp = temps[torch.randint(0, len(temps), (R,), generator=g)]
        x, temp = x.cuda(), temp.cuda()
        draw = v2.gumbel_sample(x.clone(), torch.arange(R, dtype=torch.int32, device="cuda"), temp, seeds, pos,
                                apply_temperature=True, is_drafting=False)
        qlo, qhi = gumbel_v2.temperature_bounds(x - width, x + width, temp)
        winner, certified, _ = gumbel_v2.certify_draw_v2(qlo, qhi, seeds, pos)
        assert torch.equal(winner[certified], draw[certified]), b
        rows += R
        cert += int(certified.sum())
        agree += int((winner == draw).sum())
    print(f"GPU draws, width {width}: {rows} rows, {cert / rows:.2%} certified, "
          f"{agree / rows:.2%} of all winners equal vLLM's")
    if width == 0.0:
        assert cert / rows > 0.9


def test_a_wrong_noise_is_caught(v2):
    """Broken replica (the next position's noise): certified rows draw other tokens than vLLM."""
    g = torch.Generator().manual_seed(4)
    seeds, pos = _seeds_pos(1024, g)
    x = torch.randn(1024, 32768, generator=g).cuda()
    temp = torch.ones(1024, device="cuda")
    draw = v2.gumbel_sample(x.clone(), torch.arange(1024, dtype=torch.int32, device="cuda"), temp, seeds, pos,
                            apply_temperature=True, is_drafting=False)
    winner, certified, _ = gumbel_v2.certify_draw_v2(x, x, seeds, pos + 1)
    assert bool((winner[certified] != draw[certified]).any())


@pytest.mark.parametrize("screen", ["int8", "fp16"])
def test_certified_rows_draw_the_dense_tokens(v2, screen):
    """certify_rows_v2 on a bf16 CUDA head (V 151936 x d 1024), its certified rows written as the
    V2 hook writes them (exact on S, -inf elsewhere; the others dense), then drawn by vLLM's
    gumbel_sample with temperature in its kernel: the dense logits' tokens on every row."""
    from vllm_csv import CertifiedHead, HeadConfig
    from vllm_csv.sampling.head_adapter import HeadAdapter
    from vllm_csv.sampling.rows_v2 import certify_rows_v2
    from vllm_csv.testing.heads import hidden_near_rows, peaked_head

    W, g = peaked_head(151936, 1024, seed=7)
    W = W.to("cuda", torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen=screen, off_switch=False))
    adapter = HeadAdapter(head)
    rows, cert = 0, 0
    for b in range(8):
        R = 128
        h = torch.cat([hidden_near_rows(W.cpu(), R - 16, g, scale=float(1 + b % 4)),
                       torch.randn(16, 1024, generator=g).bfloat16()]).cuda()
        seeds, pos = _seeds_pos(R, g)
        temp = torch.tensor([(0.7, 1.0, 1.3, 0.3, 2.0)[i % 5] for i in range(R)], device="cuda")
        res = certify_rows_v2(adapter, h, seeds, pos, temp)
        dense = head.dense_logits(h)
        written = dense.clone()
        written[res.certified] = res.values[res.certified].to(dense.dtype)
        idx = torch.arange(R, dtype=torch.int32, device="cuda")
        want = v2.gumbel_sample(dense.clone(), idx, temp, seeds, pos, apply_temperature=True, is_drafting=False)
        got = v2.gumbel_sample(written, idx, temp, seeds, pos, apply_temperature=True, is_drafting=False)
        assert torch.equal(got, want), b
        assert torch.equal(res.winner[res.certified], want[res.certified])
        rows += R
        cert += int(res.certified.sum())
    print(f"GPU V2 rows, {screen} screen, bf16 151936 x 1024: {rows} rows, {cert / rows:.1%} certified, "
          f"all draws equal to the dense logits'")


LOG_KERNEL = '''

@triton.jit
def _csv_log_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    blk = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = blk < n
    tl.store(y_ptr + blk, tl.log(tl.load(x_ptr + blk, mask=m, other=1.0)), mask=m)
'''


@pytest.fixture(scope="module")
def v2s():
    """vLLM's V2 min-p, logit-bias and penalties modules, compiled for the GPU."""
    mods = {n: load_vllm_v2_sample(n, LOG_KERNEL if n == "min_p" else "") for n in ("min_p", "logit_bias", "penalties")}
    if any(m is None for m in mods.values()):
        pytest.skip("neither vLLM nor VLLM_V2_SAMPLE_DIR")
    return mods


def test_min_p_log_within_bounds(v2s):
    """Triton's fp32 ``log`` on the GPU (the min-p kernel's ``tl.log(min_p)``) within
    gumbel_v2.LOG_ABS + LOG_REL |log p| of the real logarithm, for 2^24 values of ``p`` across
    (0, 1] (every exponent, and the fp32 values just below 1)."""
    g = torch.Generator().manual_seed(5)
    n = 1 << 24
    p = torch.pow(2.0, -torch.empty(n).uniform_(0, 126, generator=g))
    p[: 1 << 16] = 1.0 - torch.arange(1 << 16) * 2.0**-24  # the fp32 values nearest below 1
    p[-8:] = torch.tensor([1.0, 0.5, 0.1, 0.05, 0.01, 1e-4, 1e-6, 0.9])
    x = p.cuda()
    y = torch.empty_like(x)
    v2s["min_p"]._csv_log_kernel[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)
    real = torch.log(x.double())
    err = (y.double() - real).abs() / (gumbel_v2.LOG_ABS + gumbel_v2.LOG_REL * real.abs())
    print(f"GPU log of min-p: worst error {float(err.max()):.4f} of the bound")
    assert float(err.max()) <= 1.0


@pytest.mark.parametrize("width", [0.0, 1e-3])
def test_min_p_bounds_hold_on_the_gpu(v2s, width):
    """min_p_bounds around tempered logits against vLLM's compiled ``apply_min_p``: every token
    called dropped is dropped, every token called kept is kept."""
    g = torch.Generator().manual_seed(6)
    R, n = 1024, 32768
    x = torch.randn(R, n, generator=g) * torch.tensor([0.5, 3.0, 30.0, 1e4])[torch.arange(R) % 4][:, None]
    x[::6, :2000] = -math.inf
    min_p = torch.tensor([0.0, 1e-6, 0.01, 0.1, 0.5, 0.9, 1.0, 0.3])[torch.arange(R) % 8]
    x, min_p = x.cuda(), min_p.cuda()
    out = x.clone()
    v2s["min_p"].apply_min_p(out, torch.arange(R, dtype=torch.int32, device="cuda"), min_p)
    finite, kept_by_vllm = torch.isfinite(x), torch.isfinite(out)
    lo, hi, dropped = gumbel_v2.min_p_bounds(x - width, x + width, min_p)
    assert not bool((dropped & finite & kept_by_vllm).any()) and not bool((torch.isfinite(lo) & ~kept_by_vllm).any())
    decided = (torch.isfinite(lo) | dropped)[finite]
    print(f"GPU min-p, width {width}: {float(decided.float().mean()):.4%} of finite tokens decided")


@pytest.mark.parametrize("screen", ["int8", "fp16"])
def test_min_p_and_processor_rows_draw_the_dense_tokens(v2, v2s, screen):
    """certify_rows_v2 with min-p and vLLM's logit-bias and penalties kernels run on the bounds
    (as the V2 hook runs the processors), on a bf16 CUDA head (V 151936 x d 1024); certified
    rows written as the hook writes them, then V2's pipeline compiled for the GPU (processors,
    ``apply_temperature``, ``apply_min_p``, ``gumbel_sample``) on the written and the dense
    logits: the same tokens on every row."""
    from vllm_csv import CertifiedHead, HeadConfig
    from vllm_csv.sampling.head_adapter import HeadAdapter
    from vllm_csv.sampling.rows_v2 import certify_rows_v2
    from vllm_csv.testing.heads import hidden_near_rows, peaked_head

    V, D, R = 151936, 1024, 128
    W, g = peaked_head(V, D, seed=8)
    W = W.to("cuda", torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen=screen, off_switch=False))
    adapter = HeadAdapter(head)
    cu = dict(device="cuda")
    idx = torch.arange(R, dtype=torch.int32, **cu)
    rows, cert, why, by_p = 0, 0, {}, {}  # (by min-p, greedy rows apart)
    for b in range(6):
        h = torch.cat([hidden_near_rows(W.cpu(), R - 16, g, scale=float(1 + b % 3)),
                       torch.randn(16, D, generator=g).bfloat16()]).cuda()
        seeds, pos = _seeds_pos(R, g)
        dense = head.dense_logits(h)
        top = dense.float().topk(3, dim=1).indices
        # every seventh row greedy (V2's argmax of the processed logits; min-p leaves it alone)
        temp = torch.tensor([0.0 if i % 7 == 3 else (0.7, 1.0, 1.3, 0.3, 2.0)[i % 5] for i in range(R)], **cu)
        min_p = torch.tensor([(0.0, 0.05, 0.2, 0.6, 0.9)[(i + b) % 5] for i in range(R)], **cu)
        # logit bias: -8 on each row's top token, +3 on its third (every other row)
        nb = torch.where(idx % 2 == 0, 2, 0).to(torch.int32)
        bias_ids = torch.zeros(R, 1024, dtype=torch.int32, **cu)
        bias_ids[:, 0], bias_ids[:, 1] = top[:, 0], top[:, 2]
        bias = torch.zeros(R, 1024, **cu)
        bias[:, 0], bias[:, 1] = -8.0, 3.0
        zeros_i = torch.zeros(R, dtype=torch.int32, **cu)
        allowed = torch.zeros(R, 1024, dtype=torch.int32, **cu)
        stop = torch.zeros(R, 128, dtype=torch.int32, **cu)
        # penalties on every third row: the top two tokens in the output, the third in the prompt
        rep = torch.where(idx % 3 == 0, 1.8, 1.0).float()
        freq = torch.where(idx % 3 == 0, 0.7, 0.0).float()
        pres = torch.where(idx % 3 == 0, 1.1, 0.0).float()
        counts = torch.zeros(R, V, dtype=torch.int32, **cu)
        counts.scatter_(1, top[:, :2], 2)
        prompt_mask = torch.zeros(R, (V + 31) // 32, dtype=torch.int32, **cu)
        t3 = top[:, 2]
        prompt_mask.scatter_(1, (t3 // 32)[:, None], torch.where(t3 % 32 == 31, -2**31, 1 << (t3 % 32)).int()[:, None])
        local = torch.zeros(R, dtype=torch.int32, **cu)
        input_ids = torch.zeros(R, dtype=torch.int32, **cu)

        def processors(x):
            x = x.float().clone()
            v2s["logit_bias"].apply_logit_bias(x, idx, pos, zeros_i, allowed, nb, bias_ids, bias, zeros_i, zeros_i,
                                               zeros_i, stop)
            v2s["penalties"].apply_penalties(x, idx, input_ids, local, rep, freq, pres, prompt_mask, counts)
            return x

        def pipeline(logits, process=True):
            x = processors(logits) if process else logits.float()
            v2.apply_temperature(x, idx, temp)
            v2s["min_p"].apply_min_p(x, idx, min_p)
            return v2.gumbel_sample(x, idx, temp, seeds, pos, apply_temperature=False, is_drafting=False)

        res = certify_rows_v2(adapter, h, seeds, pos, temp, process=lambda lo, hi: (processors(lo), processors(hi)),
                              min_p=min_p)
        written = dense.clone()
        written[res.certified] = res.values[res.certified].to(dense.dtype)
        want = pipeline(dense)
        assert torch.equal(pipeline(written), want), b
        assert torch.equal(res.winner[res.certified], want[res.certified])
        assert bool((want != pipeline(dense, process=False)).any())  # the processors change draws
        rows += R
        cert += int(res.certified.sum())
        for r, m, t, c in zip(res.reason, min_p.tolist(), temp.tolist(), res.certified.tolist()):
            why[r] = why.get(r, 0) + 1
            by_p.setdefault("greedy" if t == 0 else round(m, 2), []).append(c)
    print(f"GPU V2 min-p + processor rows, {screen} screen, bf16 {V} x {D}: {rows} rows, {cert / rows:.1%} "
          f"certified ({why}; by min-p: { {p: f'{sum(c) / len(c):.0%}' for p, c in sorted(by_p.items(), key=str)} }), "
          f"all draws equal to the dense logits'")
    assert cert / rows > 0.9
