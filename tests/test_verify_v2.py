"""V2's verification certificate (vllm_csv/sampling/verify_v2.py): its Philox uniform bit for bit
and its bound on the kernel's ``x_d - lse`` against vLLM's own Triton code (interpreted, in a
subprocess: ``v2_verify_interpreted.py``), the decisions it takes and refuses, and whole requests
against a float64 replay of V2's verification. (vLLM's ``RejectionSampler`` itself on the rows the
hook hands over: test_spec_decode_v2.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm_csv.gumbel_noise import RAND_MIN, philox_uniform
from vllm_csv.sampling import verify_v2 as vv
from vllm_csv.sampling import verify_v2_bounds as vb
from vllm_csv.testing.audit_verify import replay, run_verify_case
from vllm_csv.testing.families import DTYPES, FAMILIES


def test_the_uniform_and_the_logprob_bound_hold_against_v2s_own_triton_code(tmp_path):
    pytest.importorskip("triton")
    pytest.importorskip("vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils")
    from test_sampler_hook_v2 import interpreted

    g = torch.Generator().manual_seed(5)
    seeds = torch.randint(-2**63, 2**63 - 1, (3000,), generator=g, dtype=torch.int64)
    seeds[:8] = torch.tensor([0, 1, -1, 2**31, 2**32, -2**63, 2**63 - 1, 12345])
    pos = torch.randint(0, 2**20, (3000,), generator=g)
    pos[:1000] = torch.randint(0, 2**40, (1000,), generator=g)  # (offsets above 2^32: the counter's high word)
    # processed rows over several 8192-blocks: peaked, flat, huge and tiny, -inf tokens, a last partial block
    V, M = 3 * 8192 + 517, 24
    x = torch.randn(M, V, generator=g) * torch.logspace(-3, 2, M)[:, None]
    x[5, ::3] = -math.inf
    x[6] += 1e4
    x[7, 100] += 60
    x[8] = 0.0
    drafts = torch.randint(0, V, (M,), generator=g)
    drafts[7], drafts[5], drafts[9] = 100, 1, 0  # (row 5: a finite token beside the -inf ones; row 9: one of them)
    x[9, 0] = -math.inf
    out = interpreted("v2_verify_interpreted.py", {"seeds": seeds, "pos": pos, "x": x, "drafts": drafts}, tmp_path)
    raw, v2 = out["rand"]
    mine = philox_uniform(seeds, pos)
    assert torch.equal(raw.clamp(min=RAND_MIN).view(torch.int32), mine.view(torch.int32))
    assert torch.equal(v2.view(torch.int32), mine.view(torch.int32))
    # the kernel's x_d - lse within the bound decide() uses, around the real value of the same x
    real = x.double().gather(1, drafts[:, None]).squeeze(1) - torch.logsumexp(x.double(), 1)
    slack = vb.logprob_slack(V, torch.full((M,), 1e4 + 500.0, dtype=torch.float64))
    got = out["logprob"].double()
    fin = torch.isfinite(real)
    assert not bool(fin[9]) and torch.equal(got[~fin], real[~fin])
    assert bool(((got - real)[fin].abs() <= slack[fin]).all()), (got - real)[fin].abs().max()


def _rows(lo, hi=None):
    lo = torch.tensor(lo, dtype=torch.float32)
    return lo, lo.clone() if hi is None else torch.tensor(hi, dtype=torch.float32)


def test_decide_accepts_rejects_and_leaves_open_what_the_bounds_do_not_settle():
    # exact rows: p(d) = softmax(x)[d]; u well below, well above, and within the slack of p(d)
    x = [[2.0, 1.0, 0.0, -1.0]] * 6
    p0 = torch.softmax(torch.tensor(x[0], dtype=torch.float64), 0)
    lo, hi = _rows(x)
    drafts = torch.tensor([0, 0, 3, 3, 0, -1])
    u = torch.tensor([float(p0[0]) * 0.5, min(float(p0[0]) * 1.5, 0.99), float(p0[3]) * 0.5,
                      float(p0[3]) * 2.0, float(p0[0]) * (1 + 1e-6), 0.01], dtype=torch.float32)
    dec = vb.decide(lo, hi, drafts, u).tolist()
    assert dec == [vb.ACCEPT, vb.REJECT, vb.ACCEPT, vb.REJECT, vb.UNDECIDED, vb.UNDECIDED]
    # loose bounds on the other tokens' mass leave a decision open that exact ones settle
    lo2, hi2 = _rows([[2.0, -30.0, -30.0, -30.0]], [[2.0, 2.5, 2.5, 2.5]])
    u2 = torch.tensor([0.7])
    assert vb.decide(lo2, hi2, torch.tensor([0]), u2).tolist() == [vb.UNDECIDED]
    assert vb.decide(lo2, lo2, torch.tensor([0]), u2).tolist() == [vb.ACCEPT]
    # NaN or infinite bounds (a temperature outside fp32's range, a -inf draft) decide nothing
    nan = torch.full((1, 4), math.nan)
    assert vb.decide(nan, nan, torch.tensor([0]), u2).tolist() == [vb.UNDECIDED]
    ninf = torch.tensor([[-math.inf, 0.0, 0.0, 0.0]])
    assert vb.decide(ninf, ninf, torch.tensor([0]), torch.tensor([1e-9])).tolist() == [vb.UNDECIDED]
    # u = 1 (Philox's largest words round to it): log u = 0, nothing is accepted for sure
    assert vb.decide(lo[:1], hi[:1], torch.tensor([0]), torch.tensor([1.0])).tolist() != [vb.ACCEPT]


def test_first_undecided_walks_each_request_to_its_first_row_not_accepted():
    A, Rj, U = vb.ACCEPT, vb.REJECT, vb.UNDECIDED
    dec = torch.tensor([A, A, U, A, Rj, U, U, A, U], dtype=torch.int8)
    cu = [0, 3, 6, 7, 9]  # 2 drafts, 2 drafts, 0 drafts, 1 draft
    assert vb.first_undecided(dec, cu) == ([2, 1, 0, 1], [A, Rj, A, A])
    dec[1] = U
    assert vb.first_undecided(dec, cu)[0][0] == 1 and vb.first_undecided(dec, cu)[1][0] == U


def _learned_requests(screen: str):
    """40 sampled requests of 0-3 drafts (each row's best or second-best dense token) on a
    learned-like head: ``(adapter, hidden, seeds, pos, temp, drafts, cu, x, counts)``, ``x`` the
    dense rows as V2's kernels read them."""
    from vllm_csv.head import CertifiedHead, HeadConfig
    from vllm_csv.sampling.head_adapter import HeadAdapter
    from vllm_csv.testing.heads import hidden_near_rows, peaked_head

    V, D = 4096, 64
    W, gw = peaked_head(V, D, seed=3, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen=screen, off_switch=False, budget=0.2))
    g = torch.Generator().manual_seed(9)
    counts = [int(c) for c in torch.randint(0, 4, (40,), generator=g)]
    cu = [0] + list(np.cumsum([c + 1 for c in counts]))
    N = cu[-1]
    h = hidden_near_rows(W, N, gw, scale=1.5)
    dense = head.dense_logits(h).float()
    temps = torch.tensor([0.5, 0.8, 1.0, 1.3])[torch.randint(0, 4, (len(counts),), generator=g)]
    temp = torch.repeat_interleave(temps, torch.tensor([c + 1 for c in counts]))
    x = (dense / temp[:, None]).float()
    seeds = torch.repeat_interleave(torch.randint(0, 2**62, (len(counts),), generator=g),
                                    torch.tensor([c + 1 for c in counts]))
    pos = torch.arange(N) + 100
    drafts = torch.full((N,), -1, dtype=torch.long)
    top2 = dense.topk(2, 1).indices
    for i, c in enumerate(counts):
        for j in range(c):
            r = cu[i] + j
            drafts[r] = top2[r, int(torch.randint(0, 2, (1,), generator=g))]
    return HeadAdapter(head), h, seeds, pos, temp, drafts, cu, x, counts


@pytest.mark.parametrize("screen", ["int8", "fp16"])
def test_certified_requests_are_v2s_verification_replayed_in_float64(screen):
    """Whole requests on a learned-like head: every certified request's accepted count and next
    token are those of V2's verification replayed in float64 on the dense rows (the real-arithmetic
    decisions, which the certificate's bounds hold too); most requests are certified; drafts are
    accepted and rejected."""
    adapter, h, seeds, pos, temp, drafts, cu, x, counts = _learned_requests(screen)
    res = vv.certify_verification_v2(adapter, h, seeds, pos, temp, drafts, cu)
    want = replay(x, drafts, seeds, pos, cu)
    cert = res.certified.tolist()
    assert sum(cert) >= 0.8 * len(counts), res.reason
    rejected = 0
    for i, ok in enumerate(cert):
        if ok:
            assert (res.accepted[i], res.token[i]) == want[i], i
            rejected += res.accepted[i] < counts[i]
    assert rejected > 0 and sum(res.accepted[i] for i in range(len(cert)) if cert[i]) > 0


class _Counting:
    """A :class:`HeadAdapter` that records its screens and the columns it scores."""

    def __init__(self, adapter):
        self.adapter, self.screens, self.columns = adapter, 0, []

    def __getattr__(self, name):
        return getattr(self.adapter, name)

    def intervals(self, hidden):
        self.screens += 1
        return self.adapter.intervals(hidden)

    def score_columns(self, hidden, hnorm, ids, *state):  # (the loops' one way to score: HeadAdapter.score_columns)
        self.columns.append((hidden.shape[0], set(ids.tolist())))
        return self.adapter.score_columns(hidden, hnorm, ids, *state)


def test_the_draws_go_on_from_the_acceptance_rounds_bounds():
    """The rows are screened once, and the draws after the acceptance rounds (one group of rows
    each: the bonus and rejected rows) score no column the rounds scored: they go on from the
    rounds' bounds and scored set (``certify_rows_v2(start=)``); the certified requests still
    replay V2's verification."""
    adapter, h, seeds, pos, temp, drafts, cu, x, counts = _learned_requests("int8")
    counting = _Counting(adapter)
    res = vv.certify_verification_v2(counting, h, seeds, pos, temp, drafts, cu)
    assert counting.screens == 1
    N = h.shape[0]
    rounds = set().union(*(ids for n, ids in counting.columns if n == N))
    draws = [ids for n, ids in counting.columns if n < N]
    assert draws and not any(ids & rounds for ids in draws)
    want = replay(x, drafts, seeds, pos, cu)
    assert all((res.accepted[i], res.token[i]) == want[i] for i, ok in enumerate(res.certified.tolist()) if ok)
    assert int(res.certified.sum()) >= 0.8 * len(counts)


def test_hostile_families_never_certify_a_verification_the_float64_replay_contradicts():
    """The campaign's check (benchmarks/audit.py ``--verify-requests``) on two seeds of every
    family, dtype and CUDA screen, one-hot and probabilistic drafts, min-p on the second seed: no
    certified request differs from V2's verification replayed in float64; requests are
    certified, with drafts accepted and rejected."""
    for probabilistic in (False, True):
        tot = [0, 0, 0, 0]
        for seed in (0, 1):
            for fam in FAMILIES:
                for dt in DTYPES:
                    for sc in ("int8", "fp16"):
                        o = run_verify_case(fam, seed, dt, sc, probabilistic=probabilistic, with_min_p=seed == 1)
                        assert o.wrong == 0, (fam, seed, dt, sc, probabilistic, o)
                        tot = [a + b for a, b in zip(tot, (o.requests, o.certified, o.drafts_accepted, o.rejections))]
        assert tot[1] > tot[0] // 3 and tot[2] > 0 and tot[3] > 0, (probabilistic, tot)


def test_min_p_takes_its_threshold_with_the_rejected_draft_in_the_row():
    """V2 applies min-p to the whole row, then its kernel draws with the rejected draft removed:
    logits 10 (the draft), 9.5 and 9.0 at ``min_p = 0.5`` keep {10, 9.5}, so after a rejection
    the next token is always the 9.5 one; a certificate that took the threshold without the
    draft (9.5 + log 0.5 keeps 9.0 too) would draw among two."""
    from vllm_csv.head import CertifiedHead, HeadConfig
    from vllm_csv.sampling.head_adapter import HeadAdapter

    V, d = 256, 16
    W = torch.zeros(V, d)
    W[:, 1] = -torch.linspace(1.0, 3.0, V)
    W[:3, 1] = 0.0
    W[0, 0], W[1, 0], W[2, 0] = 10.0, 9.5, 9.0
    W = W.bfloat16()
    head = CertifiedHead(W, config=HeadConfig(screen="int8", off_switch=False, budget=0.5))
    h = torch.zeros(2, d, dtype=torch.bfloat16)
    h[:, 0] = h[:, 1] = 1.0
    drafts = torch.tensor([0, -1])
    rejected = 0
    for seed in range(60):
        res = vv.certify_verification_v2(HeadAdapter(head), h, torch.tensor([seed, seed]), torch.tensor([7, 8]),
                                         torch.ones(2), drafts, [0, 2], min_p=torch.full((2,), 0.5))
        if bool(res.certified[0]) and res.accepted[0] == 0:
            rejected += 1
            assert res.token[0] == 1, seed
            assert torch.isfinite(res.values[0]).nonzero().flatten().tolist() == [1], seed
    assert rejected >= 5, rejected
