"""vLLM V2's Gumbel noise replayed (vllm_csv/sampling/gumbel_v2.py) against vLLM's own Triton
functions, and the V2 draw certificate against vLLM's own ``gumbel_sample``.

No GPU here: vLLM's ``vllm/v1/worker/gpu/sample/gumbel.py`` is run by Triton's interpreter
(``TRITON_INTERPRET=1``) on the CPU, in a subprocess (vLLM disables Triton on a CPU platform,
so the module's source is loaded with Triton imported directly). The hash and the uniform are
integer and exactly rounded arithmetic: compared bit for bit. The noise goes through the
interpreter's fp32 ``log`` (numpy's), not the GPU's: it must lie within the replica's bounds."""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vllm_csv.sampling import gumbel_v2

triton = pytest.importorskip("triton")
vllm = pytest.importorskip("vllm")
GUMBEL_PY = Path(vllm.__file__).parent / "v1" / "worker" / "gpu" / "sample" / "gumbel.py"

REFERENCE = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, triton
    from vllm_csv.testing.vllm_v2 import NOISE_KERNEL, load_vllm_v2_gumbel

    mod = load_vllm_v2_gumbel(NOISE_KERNEL)
    noise_kernel = mod._csv_noise_kernel

    case = torch.load(sys.argv[1])
    out = {}
    if case.get("noise", True):
        seeds, pos, n = case["seeds"], case["pos"], case["n"]
        R = seeds.numel()
        r = torch.zeros(R, n, dtype=torch.int64); u = torch.zeros(R, n); g = torch.zeros(R, n)
        noise_kernel[(R, triton.cdiv(n, 1024))](seeds, pos, r, u, g, n, BLOCK=1024)
        out.update(r=r, u=u, g=g)
    x = case["logits"]
    idx = case.get("idx_mapping", torch.arange(x.shape[0], dtype=torch.int32))
    out["draw"] = mod.gumbel_sample(x.clone(), idx, case["temp"], case["seeds"], case["pos"],
                                    apply_temperature=case.get("apply_temperature", False), is_drafting=False)
    torch.save(out, sys.argv[2])
""")


def vllm_v2_run(case: dict, d: Path) -> dict:
    """vLLM's own V2 kernels on ``case`` (Triton's interpreter, in a subprocess): the noise of
    every row and token (unless ``case["noise"]`` is False) and ``gumbel_sample``'s draw, with
    ``case``'s ``idx_mapping`` (default: row = request slot) and ``apply_temperature``."""
    torch.save(case, d / "case.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", VLLM_V2_GUMBEL_PY=str(GUMBEL_PY))
    p = subprocess.run([sys.executable, "-c", REFERENCE, str(d / "case.pt"), str(d / "out.pt")],
                       capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:
        pytest.skip(f"Triton's interpreter could not run vLLM's kernel here: {p.stderr[-500:]}")
    return torch.load(d / "out.pt")


@pytest.fixture(scope="module")
def vllm_v2(tmp_path_factory):
    """vLLM's own V2 noise and draw on one case: random and edge seeds (negative, above 2^32),
    positions, 5000 tokens; logits with exact ties, -inf, huge values and near-ties."""
    d = tmp_path_factory.mktemp("v2")
    g = torch.Generator().manual_seed(0)
    R, n = 48, 5000
    seeds = torch.randint(-2**62, 2**62, (R,), generator=g)
    seeds[:4] = torch.tensor([0, 1, 2**32 + 5, -1])
    pos = torch.randint(0, 2**20, (R,), generator=g)
    pos[:3] = torch.tensor([0, 1, 2**31 - 1])
    x = torch.randn(R, n, generator=g) * torch.tensor([0.1, 1.0, 4.0, 30.0])[torch.arange(R) % 4][:, None]
    x[:, 10:20] = x[:, 20:30]  # exact ties
    x[::5, 100:3000] = -math.inf
    x[7, 42] = 1e30
    x[9] = 0.0  # the draw is the noise's argmax
    case = {"seeds": seeds, "pos": pos, "n": n, "logits": x, "temp": torch.ones(R)}
    return case, vllm_v2_run(case, d)


def test_hash_and_uniform_bit_for_bit(vllm_v2):
    case, out = vllm_v2
    ids = torch.arange(case["n"])
    assert torch.equal(gumbel_v2.murmur3(case["seeds"], case["pos"], ids), out["r"])
    assert torch.equal(gumbel_v2.uniform(case["seeds"], case["pos"], ids), out["u"])


def test_noise_within_its_bounds(vllm_v2):
    case, out = vllm_v2
    lo, hi = gumbel_v2.noise_bounds(case["seeds"], case["pos"], torch.arange(case["n"]))
    g = out["g"].double()
    assert bool(((lo <= g) & (g <= hi)).all())
    assert float(g.min()) >= gumbel_v2.GUMBEL_MIN and float(g.max()) <= gumbel_v2.GUMBEL_MAX
    # the bounds are not vacuous: well below the gaps that decide a draw
    assert float((hi - lo).max()) < 1e-3


@pytest.mark.parametrize("width", [0.0, 1e-4, 0.05])
def test_certified_draws_equal_vllm_draws(vllm_v2, width):
    """On boxes around the logits vLLM's kernel drew from: every certified row is vLLM's token, and
    with exact bounds nearly every row is certified."""
    case, out = vllm_v2
    x = case["logits"]
    winner, certified, contenders = gumbel_v2.certify_draw_v2(x - width, x + width, case["seeds"], case["pos"])
    assert torch.equal(winner[certified], out["draw"][certified])
    assert bool(certified[7]) and int(winner[7]) == 42  # 1e30: the margin scales with it, and it still wins
    if width == 0.0:
        assert float(certified.float().mean()) > 0.9
    assert bool(contenders[torch.arange(x.shape[0]), winner][certified].all())


def test_a_wrong_noise_is_caught(vllm_v2, monkeypatch):
    """Broken replica: the noise of the next position: certified rows draw other tokens than vLLM."""
    case, out = vllm_v2
    x = case["logits"]
    winner, certified, _ = gumbel_v2.certify_draw_v2(x, x, case["seeds"], case["pos"] + 1)
    assert bool((winner[certified] != out["draw"][certified]).any())


def test_temperature_bounds_hold_any_quotient_within_two_ulps():
    """Every value within 2 ulps of the correctly rounded ``x / T`` (what Triton's fp32 ``/`` may
    return on a GPU; test_sampling_gumbel_v2_cuda.py measures it) lies within the bounds of any
    box holding ``x``; ``-inf`` stays ``-inf``; an unusable ``T`` gives NaN rows."""
    g = torch.Generator().manual_seed(5)
    R, n = 64, 4096
    x = torch.randn(R, n, generator=g) * torch.pow(10.0, torch.empty(R, n).uniform_(-42, 38, generator=g))
    x[:, :6] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, -math.inf])
    temp = torch.empty(R).uniform_(0.01, 10.0, generator=g)
    temp[:3] = torch.tensor([1.0, 1e-5, 1e30])
    width = (torch.rand(R, n, generator=g) * x.abs() * 1e-3).nan_to_num_(posinf=0.0)
    lo, hi = gumbel_v2.temperature_bounds(x - width, x + width, temp)
    q = (x.double() / temp.double()[:, None]).float()
    for steps in range(-2, 3):
        v = q
        for _ in range(abs(steps)):
            v = torch.nextafter(v, torch.full_like(v, math.inf if steps > 0 else -math.inf))
        ok = (lo <= v) & (v <= hi) | torch.isinf(q)  # an overflowed quotient is inf either way
        assert bool(ok.all()), steps
    assert bool((lo[:, 5] == -math.inf).all() & (hi[:, 5] == -math.inf).all())
    fin = torch.isfinite(lo) & torch.isfinite(hi)  # not vacuous: a few ulps wider than the box's quotient
    spread = (hi.double() - lo.double()) - 2 * width.double() / temp.double()[:, None]
    assert bool((spread <= q.abs().double() * 2.0**-20 + 2.0**-120)[fin].all()) and float(fin.float().mean()) > 0.9
    for bad in (0.0, -1.0, math.nan, 2.0**-127):
        blo, bhi = gumbel_v2.temperature_bounds(x[:1], x[:1], torch.tensor([bad]))
        assert bool(torch.isnan(blo).all() & torch.isnan(bhi).all())


def _v2_min_p_draw(x, temp, min_p, seeds, pos):
    """V2's temperature, min-p and Gumbel argmax replayed in torch fp32 (``min_p.py``: ``-inf``
    below ``fl32(max + log(min_p))``; the noise the replica's real ``g``; exact ties aside)."""
    q = x.float() / temp[:, None]
    thr = q.amax(1, keepdim=True) + torch.log(min_p)[:, None]
    q = q.masked_fill((min_p[:, None] > 0) & (q < thr), -math.inf)
    return (q + gumbel_v2.noise(gumbel_v2.uniform(seeds, pos, torch.arange(x.shape[1]))).float()).argmax(1)


def test_min_p_partial_rows_draw_the_certified_token():
    """certify_rows_v2 with min-p on flat rows at high temperatures (the full row's maximum often
    left unscored): the partial rows it returns, put through V2's min-p and draw, give the full
    rows' tokens; partial rows keeping the tokens min-p certainly drops do not (their maximum,
    hence their threshold, is lower than the full row's, so a dropped token can come back)."""
    from vllm_csv import CertifiedHead, HeadConfig
    from vllm_csv.sampling import rows_v2
    from vllm_csv.sampling.head_adapter import HeadAdapter
    from vllm_csv.testing.heads import peaked_head

    V, D, R = 2048, 48, 3000
    g = torch.Generator().manual_seed(0)
    W, _ = peaked_head(V, D, seed=0, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", off_switch=False))
    h = (torch.randn(R, D, generator=g) * torch.rand(R, 1, generator=g) * 3).bfloat16()
    temp = torch.tensor([0.5, 1.0, 2.0, 4.0])[torch.randint(0, 4, (R,), generator=g)]
    min_p = torch.tensor([0.05, 0.2, 0.5, 0.8])[torch.randint(0, 4, (R,), generator=g)]
    seeds, pos = torch.randint(-2**62, 2**62, (R,), generator=g), torch.randint(0, 2**20, (R,), generator=g)
    want = _v2_min_p_draw(head.dense_logits(h), temp, min_p, seeds, pos)
    bounds = rows_v2.min_p_bounds
    wrong = {}
    for name in ("ok", "no_drop"):
        if name == "no_drop":  # the same certificate; nothing dropped in the written rows
            rows_v2.min_p_bounds = lambda *a: (*bounds(*a)[:2], torch.zeros((), dtype=torch.bool))
        try:
            res = rows_v2.certify_rows_v2(HeadAdapter(head), h, seeds, pos, temp, min_p=min_p)
        finally:
            rows_v2.min_p_bounds = bounds
        c = res.certified
        assert int(c.sum()) >= 100 and torch.equal(res.winner[c], want[c])
        wrong[name] = int((_v2_min_p_draw(res.values, temp, min_p, seeds, pos) != want)[c].sum())
    assert wrong["ok"] == 0 and wrong["no_drop"] > 0, wrong


def test_grammar_masked_rows_draw_the_certified_token():
    """certify_rows_v2 with a grammar mask (the tokens V2's bitmask set to ``-inf``), greedy and
    sampled, with and without min-p, on 3000 rows in batches of 20: random halves allowed, each
    row's 8 likeliest tokens forbidden, its argmax alone forbidden, one token allowed, none, all.
    Every certified winner, and the draw of every partial row it returns, is the masked full
    row's; no row with nothing allowed is certified; a certificate that ignores the mask is
    caught."""
    from vllm_csv import CertifiedHead, HeadConfig
    from vllm_csv.sampling import rows_v2
    from vllm_csv.sampling.head_adapter import HeadAdapter
    from vllm_csv.testing.heads import peaked_head

    V, D, R, B = 2048, 48, 3000, 20
    g = torch.Generator().manual_seed(1)
    W, _ = peaked_head(V, D, seed=1, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", off_switch=False, budget=0.5))
    h = torch.cat([(W[torch.randint(0, V, (R // 2,), generator=g)].float() * 4
                    + torch.randn(R // 2, D, generator=g)).bfloat16(),
                   (torch.randn(R - R // 2, D, generator=g) * torch.rand(R - R // 2, 1, generator=g) * 3).bfloat16()])
    dense = head.dense_logits(h)
    order = dense.float().argsort(1, descending=True)
    family = torch.arange(R) % 6
    masked = torch.rand(R, V, generator=g) < 0.5  # 0: a random half allowed
    masked[family == 1] = torch.zeros_like(masked[family == 1]).scatter_(1, order[family == 1, :8], True)
    masked[family == 2] = torch.zeros_like(masked[family == 2]).scatter_(1, order[family == 2, :1], True)
    one = torch.randint(0, V, (int((family == 3).sum()), 1), generator=g)
    masked[family == 3] = torch.ones_like(masked[family == 3]).scatter_(1, one, False)
    masked[family == 4] = True  # nothing allowed
    masked[family == 5] = False  # everything allowed (a grammar in its reasoning phase, or terminated)
    temp = torch.tensor([0.0, 0.5, 1.0, 2.0])[torch.randint(0, 4, (R,), generator=g)]
    min_p = torch.where(torch.rand(R, generator=g) < 0.5, 0.0, 0.2)
    seeds, pos = torch.randint(-2**62, 2**62, (R,), generator=g), torch.randint(0, 2**20, (R,), generator=g)
    t_div = torch.where(temp == 0, 1.0, temp)

    def drawn(logits):  # V2's draw: a greedy row's argmax, else temperature, min-p and the noise
        sampled = _v2_min_p_draw(logits, t_div, min_p, seeds, pos)
        return torch.where(temp == 0, logits.float().argmax(1), sampled)

    want = drawn(dense.masked_fill(masked, -math.inf))
    out = {}
    for name, m in (("ok", masked), ("blind", None)):
        parts = [rows_v2.certify_rows_v2(HeadAdapter(head), h[i:i + B], seeds[i:i + B], pos[i:i + B], temp[i:i + B],
                                         min_p=min_p[i:i + B], masked=None if m is None else m[i:i + B])
                 for i in range(0, R, B)]
        out[name] = [torch.cat([getattr(p, f) for p in parts]) for f in ("certified", "winner", "values")]
    c, winner, values = out["ok"]
    for f in (0, 1, 2, 3, 5):
        assert int(c[family == f].sum()) >= 0.5 * int((family == f).sum()), f
    assert not bool(c[family == 4].any())
    assert torch.equal(winner[c], want[c]) and not bool(masked[c, winner[c]].any())
    assert torch.equal(drawn(values)[c], want[c])
    bc, bw, _ = out["blind"]
    assert int((bw != want)[bc].sum()) > 0


MIN_P_REFERENCE = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from vllm_csv.testing.vllm_v2 import load_vllm_v2_sample
    x, min_p = torch.load(sys.argv[1])
    load_vllm_v2_sample("min_p").apply_min_p(x, torch.arange(x.shape[0], dtype=torch.int32), min_p)
    torch.save(x, sys.argv[2])
""")


def vllm_min_p(x: torch.Tensor, min_p: torch.Tensor, d: Path) -> torch.Tensor:
    """vLLM's V2 ``apply_min_p`` on ``x`` (row i reading ``min_p[i]``), Triton's interpreter."""
    torch.save((x.clone(), min_p), d / "min_p.pt")
    p = subprocess.run([sys.executable, "-c", MIN_P_REFERENCE, str(d / "min_p.pt"), str(d / "min_p_out.pt")],
                       capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=900)
    if p.returncode != 0:
        pytest.skip(f"Triton's interpreter could not run vLLM's kernel here: {p.stderr[-500:]}")
    return torch.load(d / "min_p_out.pt")


def test_min_p_bounds_hold_vllm_min_p(tmp_path):
    """min_p_bounds on exact values (and on boxes around them) against vLLM's own V2 min-p kernel
    (Triton's interpreter): every token it calls dropped is dropped by the kernel, every token it
    calls kept is kept; on exact values nearly every token is decided."""
    g = torch.Generator().manual_seed(3)
    R, n = 32, 3000
    x = torch.randn(R, n, generator=g) * torch.tensor([0.5, 3.0, 30.0, 1e4])[torch.arange(R) % 4][:, None]
    x[::6, :2000] = -math.inf
    x[5, 7] = x[5].max()  # a tie at the maximum
    min_p = torch.tensor([0.0, 1e-6, 0.01, 0.1, 0.5, 0.9, 1.0, 0.3])[torch.arange(R) % 8]
    finite = torch.isfinite(x)  # (-inf stays -inf either way)
    kept_by_vllm = torch.isfinite(vllm_min_p(x, min_p, tmp_path))
    for w in (0.0, 1e-3):
        lo, hi, dropped = gumbel_v2.min_p_bounds(x - w, x + w, min_p)
        kept = torch.isfinite(lo)
        assert not bool((dropped & finite & kept_by_vllm).any()) and not bool((kept & ~kept_by_vllm).any())
        assert torch.equal(torch.isfinite(hi), ~dropped & finite)
        if w == 0.0:
            assert float((kept | dropped)[finite].float().mean()) > 0.999
    assert bool((finite & ~kept_by_vllm).any()) and bool((finite & kept_by_vllm & (min_p > 0)[:, None]).any())


def test_rounds_without_processors_rescore_only_what_moved():
    """Without processors, certify_rows_v2 keeps the tempered bounds across its rounds and
    recomputes only the columns it scored (each token's bounds are its own): the same
    certificates, winners, rows and scored set as recomputing every row each round (an identity
    processor forces that), on rows that take several rounds, with min-p and greedy rows mixed."""
    from vllm_csv import CertifiedHead, HeadConfig
    from vllm_csv.sampling import rows_v2
    from vllm_csv.sampling.head_adapter import HeadAdapter
    from vllm_csv.testing.heads import peaked_head

    V, D, R = 2048, 48, 400
    g = torch.Generator().manual_seed(4)
    W, _ = peaked_head(V, D, seed=4, dtype=torch.bfloat16)
    adapter = HeadAdapter(CertifiedHead(W, config=HeadConfig(screen="int8", off_switch=False, budget=0.1)))
    h = (torch.randn(R, D, generator=g) * torch.rand(R, 1, generator=g) * 3).bfloat16()
    temp = torch.tensor([0.0, 0.5, 1.0, 2.0, 4.0])[torch.randint(0, 5, (R,), generator=g)]
    min_p = torch.where(torch.rand(R, generator=g) < 0.5, 0.0, 0.2)
    seeds, pos = torch.randint(-2**62, 2**62, (R,), generator=g), torch.randint(0, 2**20, (R,), generator=g)
    for mp in (None, min_p):
        kept = rows_v2.certify_rows_v2(adapter, h, seeds, pos, temp, min_p=mp)
        full = rows_v2.certify_rows_v2(adapter, h, seeds, pos, temp, process=lambda lo, hi: (lo, hi), min_p=mp)
        assert torch.equal(kept.certified, full.certified) and kept.scored == full.scored
        assert torch.equal(kept.winner[kept.certified], full.winner[full.certified])
        assert torch.equal(kept.values, full.values) and 50 < int(kept.certified.sum()) < R



def test_top_k_bounds_decide_from_the_bounds():
    """:func:`~vllm_csv.sampling.gumbel_v2.top_k_bounds` on exact rows: the tokens ``x_(k) + m``
    and more above the ``k``-th value kept (``lo`` kept), those ``m`` below it dropped (``hi``
    ``-inf``), those within the margin neither (``near``); rows without a lower bound on some
    token (a one-sided screen), with a NaN or ``+inf`` bound, beyond the kernel's range, with
    ``k`` 0, 1 or ``V`` not taken; a row whose ``x_(k+1)`` is not the margin below its maximum
    (the kernel may leave it unmasked) keeps its tokens but drops none; pre-min-p bounds let a
    row with tokens min-p may drop be taken."""
    from vllm_csv.gumbel_noise import TOP_K_A_MAX, top_k_keep_margin

    V, k = 64, 5
    x = -torch.arange(V, dtype=torch.float64) * 0.5  # token i ranks i + 1, 0.5 apart
    m = float(top_k_keep_margin(torch.tensor(31.5)))
    rows = x.repeat(10, 1)
    rows[1, 3] = rows[1, 4] + m * 0.5  # token 3 within the margin above the k-th (token 4)
    rows[1, 5] = rows[1, 4] - m * 0.5  # token 5 within it below
    rows[4, :7] = 0.0  # x_(k+1) is the maximum: the kernel may not mask
    rows[6, 40] = math.nan  # a NaN bound
    rows[8] *= TOP_K_A_MAX  # beyond the kernel's range
    lo, hi = rows.clone(), rows.clone()
    lo[7, 50] = -math.inf  # a token with no lower bound (one-sided screen)
    kk = torch.tensor([k, k, 0, 1, k, V, k, k, k, k])
    qlo, qhi, dropped, near, on = gumbel_v2.top_k_bounds(lo.float(), hi.float(), kk)
    assert on.tolist() == [True, True, False, False, True, False, False, False, False, True]
    assert (qlo[0] > -math.inf).nonzero().squeeze(1).tolist() == [0, 1, 2, 3]  # ranks 1 .. k - 1
    assert dropped[0].nonzero().squeeze(1).tolist() == list(range(5, V))  # ranks k + 1 ...
    assert near[0].nonzero().squeeze(1).tolist() == [4]  # the k-th itself: neither
    assert (qlo[1] > -math.inf).nonzero().squeeze(1).tolist() == [0, 1, 2]
    assert dropped[1].nonzero().squeeze(1).tolist() == list(range(6, V))
    assert near[1].nonzero().squeeze(1).tolist() == [3, 4, 5]
    assert not dropped[4].any() and (qlo[4] > -math.inf).sum() == 0  # all 7 tied: none surely kept
    for r in (2, 3, 5, 6, 7, 8):  # not taken: as given
        torch.testing.assert_close(qlo[r], lo[r].float(), rtol=0, atol=0, equal_nan=True)
        assert not dropped[r].any() and not near[r].any()
    assert torch.equal(qhi[0][5:], torch.full((V - 5,), -math.inf))
    # pre-min-p bounds: a token min-p may drop (lo -inf after it) is still bounded before it
    lo_mp = lo.clone()
    lo_mp[0, 60] = -math.inf
    assert not gumbel_v2.top_k_bounds(lo_mp.float(), hi.float(), kk)[4][0]
    assert gumbel_v2.top_k_bounds(lo_mp.float(), hi.float(), kk, pre=(lo.float(), hi.float()))[4][0]


def test_top_k_bounds_hold_for_every_row_within_the_bounds():
    """On random rows with random interval widths: every token :func:`top_k_bounds` keeps is at
    least the margin above the ``k``-th value, and every token it drops the margin below it,
    for every ``x`` within the bounds (the extremes: the token at its lower bound and the rest
    at their upper, or the token at its upper and the rest at their lower)."""
    from vllm_csv.gumbel_noise import top_k_keep_margin

    g = torch.Generator().manual_seed(0)
    R, V = 300, 200
    x = torch.randn(R, V, generator=g, dtype=torch.float64) * torch.rand(R, 1, generator=g, dtype=torch.float64) * 4
    wid = torch.rand(R, V, generator=g, dtype=torch.float64) * 10 ** torch.randint(-6, 0, (R, 1), generator=g)
    lo, hi = (x - wid).float().double(), (x + wid).float().double()
    k = torch.randint(2, 40, (R,), generator=g)
    qlo, qhi, dropped, near, on = gumbel_v2.top_k_bounds(lo.float(), hi.float(), k)
    assert bool(on.all())
    kept = qlo > -math.inf
    assert 0 < int(kept.sum()) and 0 < int(dropped.sum())
    m = top_k_keep_margin(torch.maximum(lo.abs().amax(1), hi.abs().amax(1)))
    for r in range(R):
        kr = int(k[r])
        for j in kept[r].nonzero().squeeze(1).tolist():
            worst = hi[r].clone()
            worst[j] = lo[r, j]
            assert worst[j] >= worst.topk(kr).values[-1] + m[r], (r, j)
        for j in dropped[r].nonzero().squeeze(1).tolist()[:5]:
            worst = lo[r].clone()
            worst[j] = hi[r, j]
            assert worst[j] < worst.topk(kr).values[-1] - m[r], (r, j)

