"""Adversarial audit of V2's verification certificate (:mod:`vllm_csv.sampling.verify_v2`): hostile
heads and hidden states (:mod:`.families`) as the rows of sampled requests with one-hot or
probabilistic drafts,
each certified request checked against V2's verification replayed in float64 on the dense rows
(:func:`replay`: the real-arithmetic decisions, which every certified decision's bounds also
hold, so a certified request that differs is a wrong certificate). vLLM's own kernels on the
rows the hook hands over: ``tests/test_spec_decode_v2.py`` (interpreted) and the GPU tests."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..gumbel_noise import noise, philox_uniform, uniform
from ..sampling.verify_v2 import certify_verification_v2
from .audit import TEMPERATURES, dense_reference, make_head, v2_min_p64
from .families import FAMILIES, _pick


@dataclass
class VerifyOutcome:
    requests: int
    certified: int  # requests whose accepted count and next token were certified
    drafts_accepted: int  # among the certified requests
    rejections: int  # certified requests with a draft rejected
    wrong: int  # certified requests whose accepted count or token differ from the replay


def replay(x: torch.Tensor, drafts: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
           cu: list[int], qx: torch.Tensor | None = None, min_p: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """V2's verification in float64 on rows ``x`` (``[N, V]``, after the temperature): per
    request, the drafts accepted (``t_d > log u + q_d``, ``t = x - lse``, ``u`` the Philox uniform,
    ``q`` the log-softmax of the drafter's tempered logits ``qx``, or 0: one-hot drafts) and the
    next token (``argmax r + g``, the Gumbel noise of the row's seed and position, ``r`` the row
    with the rejected draft removed, or with probabilistic drafts the residual
    ``log(e^t - e^q)`` where positive; the bonus row whole); ``min_p`` (``[N]``, 0: none) first
    drops every token below ``max + log(min_p)`` of its row, the draft still in it."""
    u = philox_uniform(seeds, pos).double()
    x = v2_min_p64(x, min_p)
    t = x - torch.logsumexp(x, 1, keepdim=True)
    q = None if qx is None else qx.double() - torch.logsumexp(qx.double(), 1, keepdim=True)
    d = drafts.clamp(min=0)[:, None]
    lp = t.gather(1, d).squeeze(1) - (0.0 if q is None else q.gather(1, d).squeeze(1))
    out = []
    for i in range(len(cu) - 1):
        a, n = 0, cu[i + 1] - cu[i] - 1
        while a < n and float(lp[cu[i] + a]) > math.log(float(u[cu[i] + a])):
            a += 1
        r = cu[i] + a
        row = x[r].double().clone()
        if a < n and q is None:
            row[int(drafts[r])] = -math.inf
        elif a < n:
            row = torch.where(q[r] < t[r], t[r] + torch.log1p(-torch.exp(q[r] - t[r])), -math.inf)
        g = noise(uniform(seeds[r:r + 1], pos[r:r + 1], torch.arange(x.shape[1])))[0]
        out.append((a, int((row + g).argmax())))
    return out


def run_verify_case(family: str, seed: int, dtype: torch.dtype, screen: str, requests: int = 12,
                    max_drafts: int = 3, probabilistic: bool = False, with_min_p: bool = False,
                    fused: bool = False) -> VerifyOutcome:
    """One case: ``requests`` sampled requests of up to ``max_drafts`` drafts each over the
    case's hidden states, temperatures from :data:`~.audit.TEMPERATURES`, drafts the row's best
    or second-best dense token or a random one; ``probabilistic``: with the drafter's logits,
    the dense row plus noise, the draft token (when not the best) overrated by 8;
    ``with_min_p``: half the requests with a min-p from 0.05 to 0.9; ``fused``: certified on the
    device path instead (:func:`~vllm_csv.sampling.verify_v2_fused.verify_fused`, the head's
    fused step; a head the fused step refuses certifies nothing)."""
    from ..errors import CSVError
    from ..sampling.head_adapter import HeadAdapter

    g = torch.Generator().manual_seed(seed)
    case = FAMILIES[family](g, dtype)
    try:
        head = make_head(case, screen)
    except CSVError:
        return VerifyOutcome(requests, 0, 0, 0, 0)
    counts = [int(c) for c in torch.randint(0, max_drafts + 1, (requests,), generator=g)]
    sizes = torch.tensor([c + 1 for c in counts])
    cu = [0] + sizes.cumsum(0).tolist()
    N, V = cu[-1], case.weight.shape[0]
    hidden = case.hidden[torch.randint(0, case.hidden.shape[0], (N,), generator=g)]
    dense = dense_reference(dataclasses.replace(case, hidden=hidden)).float()
    temps = torch.tensor([_pick(g, TEMPERATURES) for _ in counts], dtype=torch.float32)
    temp = torch.repeat_interleave(temps, sizes)
    min_p = None
    if with_min_p:
        mp = torch.tensor([_pick(g, (0.0, 0.05, 0.3, 0.9)) for _ in counts], dtype=torch.float32)
        min_p = torch.repeat_interleave(mp, sizes)
    x = torch.where(temp[:, None] == 1.0, dense, dense / temp[:, None])  # (V2 does not divide at T = 1)
    seeds = torch.repeat_interleave(torch.randint(-2**62, 2**62, (requests,), generator=g), sizes)
    pos = torch.cat([torch.arange(int(s)) + int(torch.randint(0, 2**20, (1,), generator=g)) for s in sizes])
    top = dense.nan_to_num(nan=-math.inf).topk(min(2, V), 1).indices
    drafts = torch.full((N,), -1, dtype=torch.long)
    for i, c in enumerate(counts):
        for j in range(c):
            r, how = cu[i] + j, int(torch.randint(0, 3, (1,), generator=g))
            drafts[r] = int(torch.randint(0, V, (1,), generator=g)) if how == 2 else int(top[r, min(how, V - 1)])
    draft = qx = None
    if probabilistic:
        draft = dense.nan_to_num(nan=0.0, posinf=1e4, neginf=-1e4) + 0.3 * torch.randn(N, V, generator=g)
        boost = (drafts >= 0) & (drafts != top[:, 0])
        draft[boost.nonzero().squeeze(1), drafts[boost]] += 8.0
        qx = torch.where(temp[:, None] == 1.0, draft, draft / temp[:, None])
    if fused:
        from ..gpu.step import FusedStep
        from ..sampling.verify_v2_fused import verify_fused

        try:
            step = FusedStep(head)
        except CSVError:
            return VerifyOutcome(requests, 0, 0, 0, 0)
        if not step.supports_draw():
            return VerifyOutcome(requests, 0, 0, 0, 0)
        res = verify_fused(step, hidden, seeds, pos, temp, drafts, cu, min_p=min_p, draft_logits=draft)
    else:
        res = certify_verification_v2(HeadAdapter(head), hidden, seeds, pos, temp, drafts, cu, draft, min_p=min_p)
    cert = res.certified.tolist()
    if not any(cert):
        return VerifyOutcome(requests, 0, 0, 0, 0)
    want = replay(x, drafts, seeds, pos, cu, qx, min_p)
    got = [(res.accepted[i], res.token[i]) for i in range(requests)]
    return VerifyOutcome(requests, sum(cert), sum(res.accepted[i] for i in range(requests) if cert[i]),
                         sum(cert[i] and res.accepted[i] < counts[i] for i in range(requests)),
                         sum(cert[i] and got[i] != want[i] for i in range(requests)))
