"""V2's verification certified on the device path (vllm_csv/sampling/verify_v2_fused.py): its lse
bounds, min-p's kept tokens and first rows against their definitions, whole requests against V2's verification
replayed in float64 and against the reference path (verify_v2.py), on a learned-like head and on
the hostile families. Here the fused step's kernels run as their torch references (on CUDA
compiled; under Triton's interpreter through test_gpu_kernels_interpreted.py), which
tests/test_gpu_kernels.py and tests/test_gpu_gumbel_draw.py hold to the kernels bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_csv.gpu.common import CAP, INTERPRET, SUB, slot_ids
from vllm_csv.sampling import verify_v2 as vv
from vllm_csv.sampling import verify_v2_bounds as vb
from vllm_csv.sampling import verify_v2_fused as vf
from vllm_csv.testing.audit_verify import replay, run_verify_case
from vllm_csv.testing.families import DTYPES, FAMILIES

pytest.importorskip("triton")


def _fused(adapter):
    from vllm_csv.gpu.step import FusedStep

    return FusedStep(adapter.head)


def test_lse_bounds_hold_the_rows_lse_and_count_the_other_blocks():
    """On rows whose mass sits in candidate blocks, in blocks left out, or spread flat (V not a
    multiple of the block), ``llo <= logsumexp(x) <= lhi`` for values anywhere within the bounds;
    without the other blocks' mass (a bound on the candidates alone) the upper bound fails on
    the rows whose mass is elsewhere; a NaN block bound leaves ``lhi`` NaN."""
    g = torch.Generator().manual_seed(0)
    V, N = 50 * SUB + 17, 64
    nb = -(-V // SUB)
    x = torch.randn(N, V, generator=g) * torch.tensor([0.1, 1.0, 4.0, 12.0]).repeat(N // 4)[:, None]
    width = torch.rand(N, V, generator=g) * 0.05
    cand = torch.full((N, CAP), -1, dtype=torch.int32)
    k = 6
    for r in range(N):  # a random set of k blocks (the row's mass anywhere)
        cand[r, :k] = torch.randperm(nb, generator=g)[:k].sort().values.int()
    count = torch.full((N,), k, dtype=torch.int32)
    ids = slot_ids(cand, count, V)
    lo, hi = x - width, x + width
    qlo = torch.where(ids >= 0, lo.gather(1, ids.clamp(min=0)), -math.inf)
    qhi = torch.where(ids >= 0, hi.gather(1, ids.clamp(min=0)), -math.inf)
    pad = torch.full((N, nb * SUB - V), -math.inf)
    block_q = torch.cat([hi, pad], 1).view(N, nb, SUB).amax(2)
    llo, lhi, gmax = vf.lse_bounds_blocks(qlo, qhi, block_q, cand, V)
    for t in (0.0, 0.5, 1.0):
        lse = torch.logsumexp((lo + t * (hi - lo)).double(), 1)
        assert bool((llo <= lse).all() & (lse <= lhi).all()), t
    assert bool((gmax >= x.amax(1).abs()).all())
    alone = torch.logsumexp(qhi.double(), 1)  # the mutation: the candidates' mass only
    assert bool((alone < torch.logsumexp(x.double(), 1)).any())
    nan_q = block_q.clone()
    nan_q[0, :] = math.nan  # (the candidates' blocks are read from their slots: the others' NaN)
    assert math.isnan(float(vf.lse_bounds_blocks(qlo, qhi, nan_q, cand, V)[1][0]))


def test_min_p_kept_holds_v2s_min_p():
    """Rows with min-p (0, 0.05 to 0.95, above 1, NaN): every token V2's min-p keeps on values
    anywhere within the bounds keeps its upper bound, every token it drops on some such values
    loses its lower bound, and a block all of whose tokens it drops ``-inf``, for candidates
    and blocks alike; the row's maximum within ``(m_lo, m_hi)``."""
    g = torch.Generator().manual_seed(3)
    N, S, nb = 40, 64, 8
    x = torch.randn(N, S, generator=g) * torch.tensor([0.5, 2.0, 6.0, 20.0]).repeat(N // 4)[:, None]
    w = torch.rand(N, S, generator=g) * 0.05
    block = torch.randn(N, nb, generator=g) * 3 + x.amax(1, keepdim=True) - 4
    block[:, :2] = torch.maximum(block[:, :2], x.amax(1, keepdim=True))  # (a block above every candidate)
    min_p = torch.tensor([0.0, 0.05, 0.2, 0.5, 0.95, 1.5, math.nan, 0.3])[torch.arange(N) % 8]
    qlo, qhi, bq, (m_lo, m_hi) = vf.min_p_kept(x - w, x + w, block, min_p)  # (the same bounds as lo, hi below)
    lo, hi = x - w, x + w
    for t in (0.0, 0.5, 1.0):  # values within the bounds; the other blocks' tokens at their bound
        v = torch.minimum(torch.maximum(lo + 2 * t * w, lo), hi)
        m = torch.maximum(v.amax(1), block.amax(1))
        thr = m + torch.log(min_p)
        on = (min_p > 0)[:, None]
        kept = ~on | (v >= thr[:, None])
        assert bool((qhi[kept] > -math.inf).all())
        assert bool((qlo[~kept] == -math.inf).all())
        assert bool((bq[on & (block >= thr[:, None])] > -math.inf).all())
        assert bool((m_lo <= m).all()) and bool((m <= m_hi).all())
    assert bool((qlo[min_p.isnan() | (min_p == 0)] == (x - w)[min_p.isnan() | (min_p == 0)]).all())


def test_first_rows_are_the_walk_of_each_request():
    """Each request's accepted lead and first row not accepted, on the device
    (:func:`~vllm_csv.sampling.verify_v2_bounds.first_rows`, which the host's
    ``first_undecided`` reads too), equal a walk of each request's rows on random decisions, a
    bonus row marked accepted included (it ends the walk all the same)."""
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        sizes = torch.randint(1, 6, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        cu = [0] + sizes.cumsum(0).tolist()
        N = cu[-1]
        dec = torch.tensor([vb.ACCEPT, vb.REJECT, vb.UNDECIDED])[torch.randint(0, 3, (N,), generator=g)]
        lead, a = vb.first_rows(dec.to(torch.int8), torch.tensor(cu), N)
        want = []
        for i in range(len(cu) - 1):  # the walk: accepted rows from the first, the bonus row last
            n, j = cu[i + 1] - cu[i] - 1, 0
            while j < n and int(dec[cu[i] + j]) == vb.ACCEPT:
                j += 1
            want.append(j)
        assert a.tolist() == want
        assert lead.tolist() == [j - cu[i] < want[i] for i in range(len(cu) - 1) for j in range(cu[i], cu[i + 1])]


def test_certified_requests_are_v2s_verification_replayed_in_float64():
    """Whole requests on a learned-like head (test_verify_v2's): every request the device path
    certifies has V2's accepted count and next token (float64 replay on the dense rows), most are
    certified, with drafts accepted and rejected; the rows it hands over hold the accepted drafts
    alone and the next token alone on the row after them; and it certifies nearly what the
    reference path does."""
    from test_verify_v2 import _learned_requests

    adapter, h, seeds, pos, temp, drafts, cu, x, counts = _learned_requests("int8")
    res = vf.verify_fused(_fused(adapter), h, seeds, pos, temp, drafts, cu)
    ref = vv.certify_verification_v2(adapter, h, seeds, pos, temp, drafts, cu)
    want = replay(x, drafts, seeds, pos, cu)
    cert = res.certified.tolist()
    assert sum(cert) >= 0.8 * len(counts) and sum(cert) >= int(ref.certified.sum()) - 4, (sum(cert), res.reason)
    for i, ok in enumerate(cert):
        if not ok:
            continue
        assert (res.accepted[i], res.token[i]) == want[i], i
        r0, a = cu[i], res.accepted[i]
        for j in range(a):  # the accepted rows: the draft alone
            assert torch.isfinite(res.values[r0 + j]).nonzero().flatten().tolist() == [int(drafts[r0 + j])]
        assert torch.isfinite(res.values[r0 + a]).nonzero().flatten().tolist() == [res.token[i]]
    assert sum(res.accepted[i] for i in range(len(cert)) if cert[i]) > 0
    assert sum(cert[i] and res.accepted[i] < counts[i] for i in range(len(cert))) > 0


def test_hostile_families_never_certify_what_the_float64_replay_contradicts():
    """The campaign's check (``benchmarks/audit.py --verify-fused``) on two seeds of every family
    and dtype, one-hot and probabilistic drafts, min-p on half the requests of the second: no
    request certified on the device path
    differs from V2's verification replayed in float64; requests are certified, with drafts
    accepted and rejected. (Under Triton's interpreter: one seed, with min-p, bf16, one-hot
    drafts, to keep its kernels' run within minutes.)"""
    for probabilistic in (False,) if INTERPRET else (False, True):
        tot = [0, 0, 0, 0]
        for seed in (1,) if INTERPRET else (0, 1):
            for fam in FAMILIES:
                for dt in (torch.bfloat16,) if INTERPRET else DTYPES:
                    o = run_verify_case(fam, seed, dt, "int8", fused=True, probabilistic=probabilistic,
                                        with_min_p=seed == 1)
                    assert o.wrong == 0, (fam, seed, dt, probabilistic, o)
                    tot = [a + b for a, b in zip(tot, (o.requests, o.certified, o.drafts_accepted, o.rejections))]
        assert tot[1] > tot[0] // 4 and tot[2] > 0 and tot[3] > 0, (probabilistic, tot)


def test_the_residual_map_bounds_v2s_residual_on_rows_of_some_tokens():
    """:func:`~vllm_csv.sampling.verify_v2_fused.residual_process` on what the device draw gives
    it, rows holding some tokens only: the candidates' exact values (``-inf`` elsewhere) and each
    block's bound spread over its tokens (``-inf`` below), most of the row's mass in tokens not
    given, min-p's threshold from the whole row's maximum. Wherever the kernel's lse ``L`` lies
    within the bounds given (2 wide), its bounds hold the real residual ``t + log(1 - e^(q - t))``
    (``t = x - L``) shifted by ``L - S`` (``S`` the lower lse bound: a shift common to the row,
    which the draw's comparisons do not see), and they stay narrow (under 0.01) where the draft's
    probability is well below the target's, where bounds on the residual itself would be 2 wide.
    Rows not marked residual come back as given."""
    from vllm_csv.sampling.verify_v2_bounds import draft_logprob_bounds

    g = torch.Generator().manual_seed(11)
    R, V = 16, 6 * SUB + 5
    x = torch.randn(R, V, generator=g) * 2
    x[:, :SUB] += 3.0  # (the first block holds most of the mass; it is never given below)
    draft = x + torch.randn(R, V, generator=g)
    draft[:, SUB::2] -= 6.0  # (tokens the drafter underrates: narrow residual bounds)
    temp = torch.tensor([1.0, 0.7, 1.3, 2.0]).repeat(R // 4)
    min_p = torch.tensor([0.0, 0.0, 1e-3, 1e-2]).repeat(R // 4)
    q = (x / temp[:, None]).double()
    m = q.amax(1)
    q = torch.where(q < m[:, None] + torch.log(min_p.double())[:, None], -math.inf, q)  # (V2's min-p)
    lse = torch.logsumexp(q, 1)
    d = torch.log_softmax((draft / temp[:, None]).double(), 1)
    dlp = draft_logprob_bounds(draft, temp)
    residual = torch.arange(R) % 5 != 4
    S, hi = lse - 1.5, lse + 0.5
    run = vf.residual_process(None, residual, temp, min_p, (m, m), dlp, (S, hi), m.abs())
    given = torch.zeros(R, V, dtype=torch.bool)
    given[:, SUB:] = torch.rand(R, V - SUB, generator=g) < 0.3
    part = x.masked_fill(~given, -math.inf)
    zlo, zhi = run(part, part)
    nb = -(-V // SUB)
    spread = torch.nn.functional.pad(x, (0, nb * SUB - V), value=-math.inf).view(R, nb, SUB).amax(2)
    _, bhi = run(torch.full((R, V), -math.inf), spread.repeat_interleave(SUB, 1)[:, :V])
    on = given & residual[:, None]
    for L in (S, lse, hi):  # (the kernel's lse, anywhere within the bounds)
        t = q - L[:, None]
        z = torch.where(d < t, t + torch.log1p(-torch.exp(d - t)), -math.inf) + (L - S)[:, None]
        assert bool((zlo[on] <= z[on]).all()) and bool((z[on] <= zhi[on]).all()), L
        assert bool((z[residual] <= bhi[residual]).all())
    narrow = on & (d < q - hi[:, None] - 6)
    assert int(narrow.sum()) > 100 and bool(((zhi - zlo)[narrow] < 0.01).all())
    assert torch.equal(zlo[~residual], part[~residual]) and torch.equal(zhi[~residual], part[~residual])


@pytest.mark.skipif(INTERPRET, reason="CI time: the kernels on probabilistic drafts run interpreted in "
                                       "test_spec_decode_v2.py's hook case with seed 2")
def test_probabilistic_requests_are_v2s_verification_replayed_in_float64():
    """Probabilistic drafts (the drafter's logits near the target's, each draft overrated) on the
    learned-like head: every request the device path certifies has V2's accepted count and next
    token (float64 replay with the drafter's log-probabilities and the residual draw), requests
    with a rejected draft (a residual draw) among them, handed over as the winner alone. (It
    certifies fewer than the reference path, whose rounds pin a rejected row's lse before its
    residual draw: here the lse comes from the acceptance's blocks.)"""
    from test_verify_v2 import _learned_requests

    adapter, h, seeds, pos, temp, drafts, cu, x, counts = _learned_requests("int8")
    g = torch.Generator().manual_seed(4)
    draft = x * temp[:, None] + 0.5 * torch.randn(x.shape, generator=g)
    rows = (drafts >= 0).nonzero().squeeze(1)
    draft[rows, drafts[rows]] += 1.5
    res = vf.verify_fused(_fused(adapter), h, seeds, pos, temp, drafts, cu, draft_logits=draft)
    want = replay(x, drafts, seeds, pos, cu, draft / temp[:, None])
    cert = res.certified.tolist()
    assert sum(cert) >= 0.5 * len(counts), (sum(cert), res.reason)
    for i, ok in enumerate(cert):
        if ok:
            assert (res.accepted[i], res.token[i]) == want[i], i
            assert torch.isfinite(res.values[cu[i] + res.accepted[i]]).nonzero().flatten().tolist() == [res.token[i]]
    assert sum(cert[i] and res.accepted[i] < counts[i] for i in range(len(cert))) > 0


@pytest.mark.skipif(INTERPRET, reason="the composition's mutation: run with the kernels' references")
def test_a_draft_block_left_out_is_caught():
    """The draft's own block is always scored (its value an exact interval): drafts of random
    tokens (far from the row's likely ones, so plainly rejected) are rejected and the requests
    certified; where the draft's block is not forced among the candidates, such a draft is not
    scored and its rejection is not decidable (its value no interval), so fewer requests are
    certified; none is certified wrong either way."""
    from test_verify_v2 import _learned_requests

    adapter, h, seeds, pos, temp, drafts, cu, x, counts = _learned_requests("int8")
    g = torch.Generator().manual_seed(2)
    drafts = torch.where(drafts >= 0, torch.randint(0, x.shape[1], drafts.shape, generator=g), drafts)
    step = _fused(adapter)
    base = vf.verify_fused(step, h, seeds, pos, temp, drafts, cu)
    real_scatter = torch.Tensor.scatter
    try:  # the mutation: the draft's block keeps its own bound (not forced first)
        torch.Tensor.scatter = lambda self, dim, index, src: self.clone()
        cut = vf.verify_fused(step, h, seeds, pos, temp, drafts, cu)
    finally:
        torch.Tensor.scatter = real_scatter
    want = replay(x, drafts, seeds, pos, cu)
    for res in (base, cut):
        assert all((res.accepted[i], res.token[i]) == want[i] for i, ok in enumerate(res.certified.tolist()) if ok)
    assert int(cut.certified.sum()) < int(base.certified.sum()) and int(base.certified.sum()) >= 30


def test_min_p_decides_the_acceptance_where_it_drops_the_tail():
    """A draft at logit 10 over 4095 tokens at 7 (without min-p its probability is about 1/205,
    so most uniforms reject it); with ``min_p = 0.1`` V2's threshold ``10 + log 0.1`` drops the
    tail, the row holds the draft alone and every uniform accepts it, and the bonus row (the
    same) draws it again. The device path certifies that, as the float64 replay has it; one that
    bounded the lse without min-p's drops would reject it (teeth: checked on the replay without
    min-p, which rejects in most seeds)."""
    from vllm_csv.head import CertifiedHead, HeadConfig
    from vllm_csv.sampling.head_adapter import HeadAdapter

    V, d = 4096, 16
    W = torch.zeros(V, d)
    W[:, 0] = 7.0
    W[0, 0] = 10.0
    W = W.bfloat16()
    adapter = HeadAdapter(CertifiedHead(W, config=HeadConfig(screen="int8", off_switch=False, budget=0.5)))
    h = torch.zeros(2, d, dtype=torch.bfloat16)
    h[:, 0] = 1.0
    drafts, cu, temp = torch.tensor([0, -1]), [0, 2], torch.ones(2)
    x = (h.float() @ W.float().T)
    rejected_without = 0
    for seed in range(20):
        seeds, pos = torch.tensor([seed, seed]), torch.tensor([7, 8])
        res = vf.verify_fused(_fused(adapter), h, seeds, pos, temp, drafts, cu, min_p=torch.full((2,), 0.1))
        assert bool(res.certified[0]) and (res.accepted[0], res.token[0]) == (1, 0), (seed, res.reason)
        assert replay(x, drafts, seeds, pos, cu, None, torch.full((2,), 0.1))[0] == (1, 0)
        rejected_without += replay(x, drafts, seeds, pos, cu)[0][0] == 0
    assert rejected_without >= 15


def test_a_draft_past_the_vocabulary_certifies_nothing():
    """A draft id at or past ``V`` (V2 never sends one; the hook keeps such a request dense) is
    read by nothing out of range on the device path: its request is not certified, the others
    are as before."""
    from test_verify_v2 import _learned_requests

    adapter, h, seeds, pos, temp, drafts, cu, x, counts = _learned_requests("int8")
    if INTERPRET:  # (CI time: the kernels interpreted twice, on the first 10 requests)
        n = int(cu[10])
        h, seeds, pos, temp, drafts, x = (t[:n] for t in (h, seeds, pos, temp, drafts, x))
        cu, counts = cu[:11], counts[:10]
    step = _fused(adapter)
    base = vf.verify_fused(step, h, seeds, pos, temp, drafts, cu)
    i = next(i for i, c in enumerate(counts) if c > 0 and bool(base.certified[i]))
    bad = drafts.clone()
    bad[cu[i]] = x.shape[1]
    res = vf.verify_fused(step, h, seeds, pos, temp, bad, cu)
    assert not bool(res.certified[i])
    others = [j for j in range(len(counts)) if j != i]
    assert res.certified[others].tolist() == base.certified[others].tolist()
