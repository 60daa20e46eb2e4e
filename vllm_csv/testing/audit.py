"""Adversarial audit of the certificate: hostile heads and hidden states, and the check of
every certified row against the dense head of the same batch.

The cases are :mod:`.families`' (:data:`FAMILIES`, :func:`regressions`, :func:`aligned_residual`;
re-exported here, where the tests and the campaign read them).

:func:`check` runs a :class:`~vllm_csv.CertifiedHead` on a case and compares each
certified row with the dense head (``F.linear`` on the same batch, then vLLM's soft-cap and
scale written out here independently): the ids always, and the values bit for bit where the
head was asked for values. :func:`check_sampled` does the same for sampled top-k rows: what
vLLM's sampler keeps after the temperature division and its top-k mask, bit for bit. The CI property suite (``tests/test_audit.py``) and the long
campaign (``benchmarks/audit.py``) both use this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .families import (DTYPES, FAMILIES, MOSTLY_REFUSED, Case, _pick, aligned_residual,  # noqa: F401
                       copy_residual, flush_to_zero, regressions)


@dataclass
class Outcome:
    rows: int
    certified: int
    wrong_ids: int
    wrong_values: int


def dense_reference(case: Case) -> torch.Tensor:
    """The dense head exactly as vLLM computes it (``LogitsProcessor.forward``)."""
    z = F.linear(case.hidden, case.weight, case.bias)
    if case.softcap is not None:
        z = z / case.softcap
        z = torch.tanh(z)
        z = z * case.softcap
    if case.scale != 1.0:
        z = z * case.scale
    return z


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def check(head, case: Case, values: bool) -> Outcome:
    """Compare every certified row of ``head.topk(case.hidden, case.k, values)`` with the
    dense reference. With ``values``: the ids in order (descending, ties to the lowest id) and
    the value bits. Without: the top-k *set* (its order follows values that are only known
    to within their rounding interval; for ``k = 1`` the set is the argmax)."""
    res = head.topk(case.hidden, case.k, values=values)
    dense = dense_reference(case)
    dv, di = torch.sort(dense, dim=1, descending=True, stable=True)
    dv, di = dv[:, : case.k], di[:, : case.k]
    c = res.certified
    ids = res.ids if values else res.ids.sort(1).values
    di = di if values else di.sort(1).values
    wrong_ids = int(((ids != di).any(1) & c).sum())
    wrong_values = int(((_bits(res.values) != _bits(dv)).any(1) & c).sum()) if values else 0
    return Outcome(case.hidden.shape[0], int(c.sum()), wrong_ids, wrong_values)


def v2_divide(x: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    """``x / t`` in fp32 as V2's Triton ``/`` may compute it (``fl(x fl(1 / t))``, within 2 ulps
    of the quotient; subnormal results flushed to zero), not correctly rounded (``t`` broadcasts)."""
    q = x.float() * (1.0 / torch.as_tensor(t, dtype=torch.float32))
    return torch.where(q.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(q), q)


def v2_min_p64(x: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """V2's min-p in float64 on rows ``x`` (``[R, V]``, after the temperature): every token below
    ``max + log(min_p)`` of its row ``-inf`` (``min_p [R]``, 0 or None: none)."""
    x = x.double()
    if min_p is None:
        return x
    thr = x.amax(1, keepdim=True) + torch.log(min_p.double().clamp(min=1e-300))[:, None]
    return torch.where((min_p[:, None] > 0) & (x < thr), -math.inf, x)


def sampler_kept(logits: torch.Tensor, k: torch.Tensor, temp: torch.Tensor, v2: bool = False) -> torch.Tensor:
    """What vLLM's sampler draws from for top-k rows, written out here independently: fp32,
    divided by the row's temperature, every token below the k-th largest value masked to
    ``-inf`` (ties at the k-th value kept). The division is V1's (torch, correctly rounded), or
    with ``v2`` one as V2's may be (:func:`v2_divide`)."""
    x = v2_divide(logits, temp[:, None]) if v2 else logits.float() / temp[:, None]
    kth = x.topk(int(k.max()), dim=1).values.gather(1, (k - 1)[:, None])
    return x.masked_fill(x < kth, -math.inf)


def check_sampled(head, case: Case, temp: float) -> Outcome:
    """Sampled top-k: every certified row of ``head.sampler_logits`` (temperature ``temp``)
    must give vLLM's sampler the same kept tokens as the dense row (else ``wrong_ids``) and,
    where it keeps more than one, the same bits (else ``wrong_values``: the draw reads them;
    a single kept token is drawn whatever its value)."""
    B = case.hidden.shape[0]
    k = torch.full((B,), case.k, dtype=torch.long)
    t = torch.full((B,), temp, dtype=torch.float32)
    out, _ = head.sampler_logits(case.hidden, k, temperature=t)
    c = head.last_certified
    wrong_set, wrong_bits = sampled_mismatch(out, dense_reference(case), k, t, c)
    return Outcome(B, int(c.sum()), int(wrong_set.sum()), int(wrong_bits.sum()))


def sampled_mismatch(out: torch.Tensor, dense: torch.Tensor, k: torch.Tensor, temp: torch.Tensor,
                     certified: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(wrong_set [B], wrong_bits [B])`` bool: certified rows of ``out`` whose kept set under
    :func:`sampler_kept` (V1's division or V2's) differs from the dense row's, and those keeping
    more than one token whose bits differ."""
    wrong_set = torch.zeros_like(certified)
    wrong_bits = torch.zeros_like(certified)
    for v2 in (False, True):
        a, b = sampler_kept(out, k, temp, v2), sampler_kept(dense, k, temp, v2)
        ka, kb = a != -math.inf, b != -math.inf  # kept (+inf kept too: overflow by the division)
        wrong_set |= (ka != kb).any(1) & certified
        wrong_bits |= (_bits(a) != _bits(b)).any(1) & certified & (kb.sum(1) > 1)
    return wrong_set, wrong_bits




def excluded_tokens(g: torch.Generator, case: Case) -> torch.Tensor:
    """Tokens a model might set to ``-inf`` after the head (Gemma 4's ``suppress_tokens``): the
    dense argmax of some rows (the tokens that matter) and a few at random, fewer than ``V - k``."""
    V = case.weight.shape[0]
    dense = dense_reference(case).float().nan_to_num(nan=-math.inf)
    rows = torch.randperm(case.hidden.shape[0], generator=g)[: 1 + int(torch.randint(0, 4, (1,), generator=g))]
    n = int(torch.randint(0, 6, (1,), generator=g))
    ids = torch.cat([dense[rows].argmax(1), torch.randint(0, V, (n,), generator=g)]).unique()
    return ids[: max(1, V - case.k - 1)]


def check_excluded(head, case: Case, exclude: torch.Tensor) -> Outcome:
    """Rows certified over the tokens ``exclude`` left out (``head.sampler_logits(..., exclude=)``,
    ``case.k`` a row: the argmax for ``k = 1``, else the top-k with its values), each compared,
    after the model's ``-inf`` on ``exclude``, with the dense row with the same ``-inf``: the ids
    (descending, ties to the lowest id) and, for ``k >= 2``, the value bits."""
    B = case.hidden.shape[0]
    out, _ = head.sampler_logits(case.hidden, torch.full((B,), case.k, dtype=torch.long), exclude=exclude)
    c = head.last_certified
    dense = dense_reference(case).index_fill(1, exclude, -math.inf)
    out = out.index_fill(1, exclude, -math.inf)
    dv, di = torch.sort(dense, dim=1, descending=True, stable=True)
    ov, oi = torch.sort(out, dim=1, descending=True, stable=True)
    k = case.k
    wrong_ids = int(((oi[:, :k] != di[:, :k]).any(1) & c).sum())
    wrong_values = int(((_bits(ov[:, :k]) != _bits(dv[:, :k])).any(1) & c).sum()) if k >= 2 else 0
    return Outcome(B, int(c.sum()), wrong_ids, wrong_values)


def make_head(case: Case, screen: str, budget: float = 1.0):
    """A :class:`CertifiedHead` for ``case`` (its own index for ``ball``), without off-switch."""
    from ..head import CertifiedHead, HeadConfig
    from ..index import build_index

    index = None
    if screen == "ball":
        index = build_index(case.weight.float(), None if case.bias is None else case.bias.float(),
                            num_clusters=max(1, case.weight.shape[0] // 16), progress=False, iters=5)
    cfg = HeadConfig(screen=screen, budget=budget, off_switch=False)
    return CertifiedHead(case.weight, case.bias, config=cfg, index=index, softcap=case.softcap,
                         scale=case.scale)


TEMPERATURES = (1e-2, 0.7, 1.0, 3.0, 1e4)  # vLLM's smallest sampled temperature is 0.01


def head_or_none(case: Case, screen: str):
    """:func:`make_head`, or None where the screen refuses the head (a ``CSVError``: e.g. fp16
    overflow), which is no wrong row."""
    from ..errors import CSVError

    try:
        return make_head(case, screen)
    except CSVError:
        return None


def run_sampled_case(family: str, seed: int, dtype: torch.dtype, screen: str) -> Outcome:
    """One case as sampled top-k rows, at a temperature drawn from :data:`TEMPERATURES`."""
    g = torch.Generator().manual_seed(seed)
    case = FAMILIES[family](g, dtype)
    temp = _pick(g, TEMPERATURES)
    head = head_or_none(case, screen)
    return Outcome(case.hidden.shape[0], 0, 0, 0) if head is None else check_sampled(head, case, temp)


def run_excluded_case(family: str, seed: int, dtype: torch.dtype, screen: str) -> Outcome:
    """One case certified over a few left-out tokens (:func:`excluded_tokens`), greedy
    (``k = 1``) or top-k with values."""
    g = torch.Generator().manual_seed(seed)
    case = FAMILIES[family](g, dtype)
    head = head_or_none(case, screen)
    if head is None:
        return Outcome(case.hidden.shape[0], 0, 0, 0)
    return check_excluded(head, case, excluded_tokens(g, case))


def run_case(family: str, seed: int, dtype: torch.dtype, screen: str) -> tuple[Outcome, Outcome]:
    """One case: ``(ids-only outcome, ids-and-values outcome)``."""
    case = FAMILIES[family](torch.Generator().manual_seed(seed), dtype)
    head = head_or_none(case, screen)
    if head is None:
        z = Outcome(case.hidden.shape[0], 0, 0, 0)
        return z, z
    return check(head, case, values=False), check(head, case, values=True)
