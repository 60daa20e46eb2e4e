"""Adversarial audit of V2's draw certificate under a top-k alone
(:func:`~vllm_csv.sampling.rows_v2.certify_rows_v2` with ``top`` codes ``k >= 2``, so
:func:`~vllm_csv.sampling.gumbel_v2.top_k_bounds`): hostile heads and hidden states
(:mod:`.families`) as V2 temperature rows with a top-k, on some a min-p, each certified row's
token checked against the draw replayed in float64 on the dense row (:func:`replay_top_k`).

The replay divides as V2 may (:func:`~.audit.v2_divide`), applies min-p, masks the row to its
top ``k`` with ties at the ``k``-th value kept, and takes ``argmax(x + g)`` with the row's Gumbel
noise. Its kept set lies between what the certificate takes as surely kept and as possibly kept,
so a certified winner is its winner too, whichever tied tokens vLLM's kernel keeps by position:
a certified row that differs is a wrong certificate. vLLM's own kernels on the rows the hook
hands over: ``tests/test_sampler_hook_v2.py`` and ``tests/test_v2_top_masks.py`` (Triton's
interpreter)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..gumbel_noise import noise, uniform
from .audit import TEMPERATURES, dense_reference, head_or_none, v2_divide, v2_min_p64
from .families import FAMILIES, _pick

TOP_KS = (2, 3, 5, 20, 64)


@dataclass
class DrawOutcome:
    rows: int
    certified: int
    below_max: int  # certified rows whose token is not the row's argmax (the maximum's rule alone certifies none)
    wrong: int  # certified rows whose token differs from the replay


def replay_top_k(x: torch.Tensor, k: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                 min_p: torch.Tensor | None = None) -> torch.Tensor:
    """``[R]`` int64: V2's draw in float64 from the tempered rows ``x`` (``[R, V]``) with a
    top-k ``k`` (``[R]``; ties at the ``k``-th value kept, no mask where a row has at most ``k``
    finite values) after min-p (``[R]``, 0: none; tokens below ``max + log(min_p)`` dropped)."""
    x = v2_min_p64(x, min_p)
    kth = x.topk(int(k.max()), 1).values.gather(1, (k - 1)[:, None])
    x = torch.where(x >= kth, x, -math.inf)
    return (x + noise(uniform(seeds, pos, torch.arange(x.shape[1])))).argmax(1)


def run_top_k_draw_case(family: str, seed: int, dtype: torch.dtype, screen: str, top=None) -> DrawOutcome:
    """One case: the case's hidden states as V2 rows, each with a temperature from
    :data:`~.audit.TEMPERATURES`, a top-k from :data:`TOP_KS` (below ``V``) and on half of them
    a min-p of 0.05 or 0.3; ``top``: the codes the certificate is told (default: each row's
    ``k``; a mutation test passes others)."""
    from ..sampling.head_adapter import HeadAdapter
    from ..sampling.rows_v2 import certify_rows_v2

    g = torch.Generator().manual_seed(seed)
    case = FAMILIES[family](g, dtype)
    R, V = case.hidden.shape[0], case.weight.shape[0]
    head = head_or_none(case, screen)
    if head is None or V < 3:
        return DrawOutcome(R, 0, 0, 0)
    temp = torch.tensor([_pick(g, TEMPERATURES) for _ in range(R)], dtype=torch.float32)
    k = torch.tensor([min(_pick(g, TOP_KS), V - 1) for _ in range(R)])
    min_p = torch.tensor([_pick(g, (0.0, 0.0, 0.05, 0.3)) for _ in range(R)], dtype=torch.float32)
    seeds = torch.randint(-2**62, 2**62, (R,), generator=g)
    pos = torch.randint(0, 2**20, (R,), generator=g)
    res = certify_rows_v2(HeadAdapter(head), case.hidden, seeds, pos, temp, min_p=min_p,
                          top=k if top is None else top(k))
    c = res.certified
    if not bool(c.any()):
        return DrawOutcome(R, 0, 0, 0)
    dense = dense_reference(case).float()
    x = torch.where(temp[:, None] == 1.0, dense, v2_divide(dense, temp[:, None]))  # (V2 does not divide at T = 1)
    want = replay_top_k(x, k, seeds, pos, min_p)
    below = c & (res.winner != x.nan_to_num(nan=-math.inf).argmax(1))
    return DrawOutcome(R, int(c.sum()), int(below.sum()), int((c & (res.winner != want)).sum()))
