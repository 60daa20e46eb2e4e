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
    import os, sys, types
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, triton, triton.language as tl
    src = open(sys.argv[1]).read().replace("from vllm.triton_utils import tl, triton",
                                           "import triton, triton.language as tl")
    mod = types.ModuleType("vllm_v2_gumbel")
    exec(compile(src, sys.argv[1], "exec"), mod.__dict__)

    @triton.jit
    def noise_kernel(seed_ptr, pos_ptr, r_ptr, u_ptr, g_ptr, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        blk = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = blk < n
        seed = tl.load(seed_ptr + row)
        pos = tl.load(pos_ptr + row)
        r = mod.murmur3_hash32(seed, pos, blk)
        u = mod.murmur3_uniform32(seed, pos, blk)
        g = -tl.log(-mod._log1p_neg_stable(u))  # gumbel_noised_argmax's fp32 noise
        tl.store(r_ptr + row * n + blk, r.to(tl.int64), mask=m)
        tl.store(u_ptr + row * n + blk, u, mask=m)
        tl.store(g_ptr + row * n + blk, g, mask=m)

    case = torch.load(sys.argv[2])
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
    torch.save(out, sys.argv[3])
""")


def vllm_v2_run(case: dict, d: Path) -> dict:
    """vLLM's own V2 kernels on ``case`` (Triton's interpreter, in a subprocess): the noise of
    every row and token (unless ``case["noise"]`` is False) and ``gumbel_sample``'s draw, with
    ``case``'s ``idx_mapping`` (default: row = request slot) and ``apply_temperature``."""
    torch.save(case, d / "case.pt")
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", REFERENCE, str(GUMBEL_PY), str(d / "case.pt"), str(d / "out.pt")],
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
