"""vLLM's top-k / top-p Triton kernels (Qrita, ``topk_topp_triton.py``), which V2 runs on the
tempered logits before its Gumbel draw, keep a row's maximum, value unchanged, wherever it lies
:func:`~vllm_csv.gumbel_noise.top_mask_margin` above every other token, for any ``k`` and ``p``;
they leave a row with neither untouched; and without the margin they may drop the maximum (so
the margin is needed, and this test can see it). Under a top-k alone they keep any token that
lies :func:`~vllm_csv.gumbel_noise.top_k_keep_margin` above the row's ``k``-th largest value,
and drop any that lies that margin below it, searches that run out of rounds included; a token
ranked ``k`` may be dropped. Run by Triton's interpreter on the CPU
(``v2_top_masks_interpreted.py``, a subprocess); the compiled kernels want a GPU with vLLM."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_csv.gumbel_noise import finite_abs_max, top_k_keep_margin, top_mask_margin

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


def magnitude(x: torch.Tensor, kind: str, g: torch.Generator) -> torch.Tensor:
    """``x`` for the row kinds ``huge`` (``300 x + 2000``), ``tiny`` (``1e-4 x``) and ``masked``
    (half the row ``-inf``, a grammar's mask); others as they are."""
    if kind == "huge":
        x = x * 300.0 + 2000.0
    if kind == "tiny":
        x = x * 1e-4
    if kind == "masked":
        x[torch.randperm(V, generator=g)[:V // 2]] = -math.inf
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
            x = magnitude(x, kind, g)
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


def above_kth(x: torch.Tensor, w: int, k: int) -> torch.Tensor:
    """``x`` (a row) with ``x[w]`` raised to the smallest fp32 value at least
    :func:`~vllm_csv.gumbel_noise.top_k_keep_margin` (of the row's largest ``|x|``, that value's
    included) above the ``(k - 1)``-th largest of the other tokens: ``w`` then ranks at most
    ``k - 1``, that far above the row's ``k``-th largest value."""
    rest = x.clone()
    rest[w] = -math.inf
    kth = rest.topk(k - 1).values[-1].double()
    A = finite_abs_max(rest[None].double())[0]
    v = torch.tensor(float(kth + top_k_keep_margin(A + 1.0)), dtype=torch.float32)
    while float(v.double() - kth) < float(top_k_keep_margin(torch.maximum(v.double().abs(), A))):
        v = torch.nextafter(v, torch.tensor(math.inf))
    x[w] = v
    return x


def ranked_rows(seed: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Rows with a token ``w`` at the top-k margin, and each row's ``k`` and ``w``: spread, a
    flat crowd at the ``k``-th value (the kernel keeps some of it by position), huge and tiny
    magnitudes, half the row ``-inf``, and ``runout``: a cluster of distinct values ``1e-8`` apart
    around the ``k``-th, far from both ends of a wide row, so that the pivot search runs out of
    rounds (the kernel then keeps a count other than ``k``, which the test checks happens)."""
    g = torch.Generator().manual_seed(seed)
    xs, ks, ws = [], [], []
    for kind in ("spread", "crowd", "huge", "tiny", "masked", "runout", "runout"):
        for k in (2, 3, 7, 50, 400):
            x = torch.randn(V, generator=g)
            if kind == "crowd":
                top = torch.randperm(V, generator=g)[:k + 30]
                x[top[:k // 2]] += 6.0
                x[top[k // 2:]] = float(x.max()) + 0.5  # one value, held by 30 + k/2 tokens
            x = magnitude(x, kind, g)
            if kind == "runout":
                x = x - 30.0
                x[int(torch.randint(V, (1,), generator=g))] = 60.0
                cl = torch.randperm(V, generator=g)[:2 * k + 20]
                x[cl] = 1e-3 + torch.arange(cl.numel(), dtype=torch.float32) * 1e-8
            finite = (x > -math.inf).nonzero().squeeze(1)
            order = finite[x[finite].argsort(descending=True)]
            rank = int(torch.randint(1, k, (1,), generator=g)) if k > 2 else 1  # 1 .. k - 1
            w = int(order[min(rank - 1, order.numel() - 1)])
            xs.append(above_kth(x, w, k))
            ks.append(k)
            ws.append(w)
    return torch.stack(xs), torch.tensor(ks, dtype=torch.int32), ws


@pytest.mark.parametrize("seed", [0, 1])
def test_vllm_top_k_kernel_keeps_and_drops_tokens_at_the_top_k_margin(tmp_path, seed):
    x, k, ws = ranked_rows(seed)
    p = torch.ones(x.shape[0], dtype=torch.float32)
    for pp in (None, p):  # a top-k alone; in a batch with top-p rows, a top-p of 1
        y = qrita({"x": x, "k": k, "p": pp}, tmp_path)
        for r, w in enumerate(ws):
            assert y[r, w] == x[r, w], (r, int(k[r]), w)
            kept = y[r] > -math.inf
            assert torch.equal(y[r][kept], x[r][kept])  # kept values unchanged
            # and every token the margin below the k-th value dropped (the kernel masks: more
            # than k finite values, the (k+1)-th the margin below the maximum)
            xr = x[r].double()
            top = xr.topk(int(k[r]) + 1).values
            m = top_k_keep_margin(finite_abs_max(xr[None])[0])
            assert top[-1] + m < top[0]
            assert not bool(kept[xr < top[-2] - m].any()), (r, int(k[r]))
        n_kept = (y > -math.inf).sum(1)
        assert bool((n_kept < (x > -math.inf).sum(1)).all())  # every row masked
        runout = slice(5 * len((2, 3, 7, 50, 400)), None)
        assert bool((n_kept[runout] != k[runout]).any()), "no search ran out of rounds"


def test_a_token_ranked_k_may_be_dropped(tmp_path):
    """Rank ``k`` is outside the rule (at most ``k - 2`` others within the margin): ``k - 1``
    tokens ahead, then ``w`` among equal values at the boundary, after one of them: the kernel
    keeps one by position, not ``w``."""
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(9))
    ws = []
    for r in range(4):
        x[r, :5] = 10.0 + torch.arange(5.0)  # k - 1 = 5 tokens ahead
        x[r, 100 + r] = 8.0  # the k-th value, first
        x[r, 2000 + r] = 8.0  # w: the same value, later
        ws.append(2000 + r)
    y = qrita({"x": x, "k": torch.full((4,), 6, dtype=torch.int32), "p": None}, tmp_path)
    assert all(y[r, w] == -math.inf for r, w in enumerate(ws))
    assert all(y[r, 100 + r] == 8.0 for r in range(4))

