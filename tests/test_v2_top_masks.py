"""vLLM's top-k / top-p Triton kernels (Qrita, ``topk_topp_triton.py``), which V2 runs on the
tempered logits before its Gumbel draw, keep a row's maximum, value unchanged, wherever it lies
:func:`~vllm_csv.gumbel_noise.top_mask_margin` above every other token, for any ``k`` and ``p``;
they leave a row with neither untouched; and without the margin they may drop the maximum (so
the margin is needed, and this test can see it). Run by Triton's interpreter on the CPU
(``v2_top_masks_interpreted.py``, a subprocess); the compiled kernels want a GPU with vLLM."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_csv.gumbel_noise import top_mask_margin

pytest.importorskip("vllm")
pytest.importorskip("triton")

HELPER = Path(__file__).with_name("v2_top_masks_interpreted.py")
V = 3001  # odd, not a multiple of the kernels' tiles


def qrita(case: dict, d: Path) -> torch.Tensor:
    torch.save(case, d / "case.pt")
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, str(HELPER), str(d / "case.pt"), str(d / "out.pt")],
                       capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:
        pytest.skip(f"Triton's interpreter could not run vLLM's top-k/top-p kernels here: {p.stderr[-500:]}")
    return torch.load(d / "out.pt")["y"]


def above_by_margin(x: torch.Tensor, w: int) -> torch.Tensor:
    """``x`` (a row, float32) with ``x[w]`` raised to the smallest fp32 value above every other
    finite value by more than the margin of the row's largest ``|x|``."""
    rest = x.clone()
    rest[w] = -math.inf
    second = rest.max().double()
    A = max(rest[torch.isfinite(rest)].abs().max().double(), second.abs())
    v = torch.tensor(float(second + top_mask_margin(V, A + 1.0) * 1.0001), dtype=torch.float32)
    while float(v.double() - second) <= float(top_mask_margin(V, torch.maximum(v.double().abs(), A))):
        v = torch.nextafter(v, torch.tensor(math.inf))
    x[w] = v
    return x


def rows(seed: int) -> torch.Tensor:
    """Rows with a strict maximum at the margin: spread, flat (every other token one value just
    below the maximum), a crowd of near-duplicates just below it on both sides of its position,
    huge and tiny magnitudes, half the row ``-inf`` (a grammar's mask)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for kind in ("spread", "flat", "crowd", "huge", "tiny", "masked"):
        for scale in (0.05, 1.0, 6.0):
            x = torch.randn(V, generator=g) * scale
            if kind == "flat":
                x.fill_(scale)
            if kind == "huge":
                x = x * 300.0 + 2000.0
            if kind == "tiny":
                x = x * 1e-4
            if kind == "masked":
                x[torch.randperm(V, generator=g)[:V // 2]] = -math.inf
            w = int(torch.randint(V // 4, 3 * V // 4, (1,), generator=g))
            if kind == "masked":
                x[w] = 0.0
            x = above_by_margin(x, w)
            if kind == "crowd":
                second = x.clone()
                second[w] = -math.inf
                near = torch.randperm(V, generator=g)[:40]
                near = near[near != w]
                x[near] = second.max()
                x = above_by_margin(x, w)
            out.append(x)
    return torch.stack(out)


KS = (1, 2, 7, 100, V - 1, V)
PS = (0.02, 0.5, 0.9, 0.999, 1.0)


def check(x, y, k, p):
    for r in range(x.shape[0]):
        w = int(x[r].argmax())
        assert y[r, w] == x[r, w], (r, k[r] if k is not None else None, p[r] if p is not None else None)
        kept = y[r] > -math.inf
        assert torch.equal(y[r][kept], x[r][kept])  # kept values unchanged
        if (k is None or int(k[r]) >= V) and (p is None or float(p[r]) >= 1.0):
            assert torch.equal(y[r], x[r])  # a row with neither: untouched


@pytest.mark.parametrize("seed", [0, 1])
def test_vllm_top_k_top_p_kernels_keep_the_maximum_at_the_margin(tmp_path, seed):
    x = rows(seed)
    R = x.shape[0]
    k = torch.tensor([KS[(i + seed) % len(KS)] for i in range(R)], dtype=torch.int32)
    p = torch.tensor([PS[(i * 3 + seed) % len(PS)] for i in range(R)], dtype=torch.float32)
    for kk, pp in ((k, p), (k, None), (None, p)):
        y = qrita({"x": x, "k": kk, "p": pp}, tmp_path)
        check(x, y, kk, pp)
        assert bool((y == -math.inf).sum(1).gt((x == -math.inf).sum(1)).any())  # the masks masked
    y = qrita({"x": x, "k": None, "p": p, "split": True}, tmp_path)  # CUDA's split top-p pipeline
    check(x, y, None, p)


def test_without_the_margin_the_kernels_may_drop_the_maximum(tmp_path):
    """Near-duplicates of the maximum within the kernels' ``1e-9`` (tiny logits, a few fp32 ulps
    apart) ahead of it: top-k 1 keeps one of them by position, not the maximum. The margin rules
    these rows out; this shows it is not idle."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, V, generator=g) * 1e-6 - 1.0
    for r in range(8):
        x[r, 10 + r] = 3e-6
        x[r, 400 + r] = torch.nextafter(torch.tensor(3e-6), torch.tensor(1.0))  # the maximum, later
    y = qrita({"x": x, "k": torch.ones(8, dtype=torch.int32), "p": None}, tmp_path)
    dropped = [r for r in range(8) if y[r, 400 + r] == -math.inf]
    assert dropped, "the kernels kept every maximum even without the margin"
