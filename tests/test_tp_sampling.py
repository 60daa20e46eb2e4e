"""Tensor parallelism (issue 11): deferred rows (the sampler's draw: temperature, top-p, min-p,
penalties, logit_bias, ...) certified over a sharded head, simulated in one process.

Each rank runs ``vllm_plugin.v1.sampler.resolve`` in its own thread (tests/test_tp.py's ThreadGroup) over
its own shard in vLLM's layout; the seeds are peeked once (the ranks' RNGs are in step in vLLM;
threads share one here). Every rank must write the same logits and take the same decision;
vLLM's sampler on those logits must draw what it draws on vLLM's dense TP logits.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from test_sampler_hook import CASES, metadata, run
from test_tp import bits, dense_tp, run_ranks, shard_of

pytest.importorskip("vllm")
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from vllm_csv.errors import CSVError  # noqa: E402
from vllm_csv.head import HeadConfig  # noqa: E402
from vllm_csv.sampling import sharded_rows  # noqa: E402
from vllm_csv.sampling.nucleus.min_p import min_p_bounds  # noqa: E402
from vllm_csv.sampling.nucleus.top_p import top_p_bounds  # noqa: E402
from vllm_csv.sampling.sharded_rows import ShardedAdapter  # noqa: E402
from vllm_csv.sharded import Shard, ShardedHead  # noqa: E402
from vllm_csv.testing import audit  # noqa: E402
from vllm_csv.testing.fakes import Tally  # noqa: E402
from vllm_csv.vllm_plugin import step as csv_step  # noqa: E402
from vllm_csv.vllm_plugin.v1 import sampler as v1_sampler  # noqa: E402

PEEK = v1_sampler.peek_seeds  # the real one (tests replace it for the threads)


def resolve_tp(W, bias, h, md, rows, size, monkeypatch, screen="int8", softcap=None, scale=1.0, patch=None,
               budget=0.5, off_switch=False):
    """Every rank's ``(logits, stats, no_top_p, dense TP logits, dense calls)``."""
    V, B = W.shape[0], h.shape[0]
    torch.manual_seed(5)
    for i, gen in md.generators.items():
        gen.manual_seed(1000 + i)
    seeds = PEEK(B, md.generators)
    monkeypatch.setattr(v1_sampler, "peek_seeds", lambda n, gens: seeds.clone())

    def rank(r, comm):
        shard = Shard.vllm_layout(V, r, size)
        w, b = shard_of(W, bias, shard)
        head = ShardedHead(w, b, shard, comm, config=HeadConfig(screen=screen, budget=budget, off_switch=off_switch),
                           softcap=softcap, scale=scale)
        if patch is not None:
            patch(r, head)
        dense = dense_tp(comm, w, b, V, head.engine)
        ref = dense(h)
        logits = ref.clone()
        logits[rows] = csv_step.PLACEHOLDER
        calls = []
        d = csv_step.Deferred(logits, h[rows].clone(), rows, ["sampling"] * rows.numel(), ShardedAdapter(head),
                              lambda: calls.append(1) or dense(h), Tally().account())
        st, no_top_p, _ = v1_sampler.resolve(Sampler(), d, logits, md)
        return logits, st, no_top_p, ref, len(calls), head

    return run_ranks(size, rank)[0]


def draw(logits, md, no_top_p):
    saved = None if md.top_p is None else md.top_p.clone()
    if md.top_p is not None and no_top_p.numel():
        md.top_p[no_top_p] = 1.0  # as the hook does for certified top-p rows
    try:
        return run(Sampler(), logits, md, seed=5)[0]
    finally:
        if saved is not None:
            md.top_p.copy_(saved)


def check_same_and_exact(res, md, rows):
    """Every rank wrote the same logits and stats; the draw is vLLM's dense TP draw. Returns
    the certified count."""
    logits, st, no_top_p, ref, calls, _ = res[0]
    for r in res[1:]:
        assert torch.equal(bits(r[0]), bits(logits)) and torch.equal(r[2], no_top_p)
        assert r[1].certified == st.certified and r[1].fallbacks == st.fallbacks and r[4] == calls
    want = run(Sampler(), ref.clone(), md, seed=5)[0]
    got = draw(logits, md, no_top_p)
    assert torch.equal(got, want), (got, want)
    return sum(st.certified.values())


@pytest.mark.parametrize("size", (2, 4))
@pytest.mark.parametrize("case", sorted(CASES))
def test_tp_deferred_rows_draw_like_dense(case, size, monkeypatch):
    """A learned-like head, V not a multiple of 64 (padding rows on the last shard), every
    processing case of the single-rank hook test, sampled and greedy rows, seeded or not."""
    from vllm_csv.testing.heads import hidden_near_rows, peaked_head

    V, D, B = 1000, 48, 16
    g = torch.Generator().manual_seed(3 + size)
    W, _ = peaked_head(V, D, seed=17, dtype=torch.bfloat16)
    h = hidden_near_rows(W, B, g, scale=1.5)
    temps = [0.0 if i % 4 == 0 else 0.8 for i in range(B)]
    md = metadata(g, temps, seeded=range(1, B, 2), V=V, **CASES[case])
    certified = 0
    top_k_rows = torch.zeros(B, dtype=torch.bool) if md.top_k is None else (md.top_k < V) & (torch.tensor(temps) > 0)
    for rows in (torch.arange(B), torch.arange(0, B, 3)):
        res = resolve_tp(W, None, h, md, rows, size, monkeypatch)
        here = check_same_and_exact(res, md, rows)
        # top-k is not decided on gathered summaries: those rows are dense on every rank
        assert here <= int((~top_k_rows)[rows].sum()), here
        certified += here
    assert certified > int((~top_k_rows).sum()) // 2, certified


@pytest.mark.parametrize("size", (2, 4))
def test_tp_deferred_rows_on_adversarial_families(size, monkeypatch):
    """The audit's adversarial heads (near ties, exact ties, overflow, soft-cap, bias
    cancellation, non-finite hidden states, norms) at its temperatures, with top-p / min-p."""
    rows_total = cert_total = 0
    for family in sorted(audit.FAMILIES):
        for seed in range(3):
            g = torch.Generator().manual_seed(100 * seed + size)
            case = audit.FAMILIES[family](g, audit.DTYPES[seed % 3])
            V, B = case.weight.shape[0], case.hidden.shape[0]
            T = audit.TEMPERATURES[(seed + len(family)) % len(audit.TEMPERATURES)]
            temps = [0.0 if i % 3 == 0 else T for i in range(B)]
            kind = ("top_p", "min_p", "temperature")[seed]
            md = metadata(g, temps, seeded=range(0, B, 2), V=V, **CASES[kind])
            try:
                res = resolve_tp(case.weight, case.bias, case.hidden, md, torch.arange(B), size, monkeypatch,
                                 softcap=case.softcap, scale=case.scale)
            except CSVError:  # a screen may refuse a head (fp16 overflow) on some rank
                continue
            cert_total += check_same_and_exact(res, md, torch.arange(B))
            rows_total += B
    assert cert_total > 0.2 * rows_total, (cert_total, rows_total)


@pytest.mark.parametrize("size", (2, 3))
def test_tp_rows_with_their_own_sampling_parameters(size, monkeypatch):
    """The sampler audit's batches (vllm_csv.testing.audit_sampler.draw_batch: each row its own greedy,
    temperature, top-k, top-p or min-p mix at edge values, seeded or not; penalties, logit bias,
    allowed ids and bad words by batch; some or all rows deferred) over the sharded adversarial
    heads. (Grammar masks: the single-rank audit; here they are left out.)"""
    from vllm_csv.testing.audit_sampler import draw_batch

    rows_total = cert_total = 0
    for family in sorted(audit.FAMILIES):
        for seed in range(2):
            g = torch.Generator().manual_seed(1000 * seed + size)
            case = audit.FAMILIES[family](g, audit.DTYPES[(seed + size) % 3])
            batch = draw_batch(g, case.hidden.shape[0], case.weight.shape[0])
            try:
                res = resolve_tp(case.weight, case.bias, case.hidden, batch.md, batch.deferred, size, monkeypatch,
                                 softcap=case.softcap, scale=case.scale)
            except CSVError:  # a screen may refuse a head (fp16 overflow) on some rank
                continue
            cert_total += check_same_and_exact(res, batch.md, batch.deferred)
            rows_total += batch.deferred.numel()
    assert cert_total > 0.2 * rows_total, (cert_total, rows_total)


def test_tp_disagreeing_ranks_go_dense_together(monkeypatch):
    """Rank 1 alone cannot bound row 0 (as with a NaN in its hidden state there), its exact
    scores of row 1 come with a useless upper bound, it would draw row 2 with another seed, and
    one of its tokens has a NaN bound in row 3:
    those rows are dense on *every* rank (the collective dense path runs once on each), the
    others certified, the logits the same everywhere."""
    from vllm_csv.testing.heads import hidden_near_rows, peaked_head

    V, D, B = 777, 40, 8
    g = torch.Generator().manual_seed(11)
    W, _ = peaked_head(V, D, seed=5, dtype=torch.bfloat16)
    h = hidden_near_rows(W, B, g, scale=2.5)
    md = metadata(g, [0.7] * B, seeded=range(B), V=V, **CASES["top_p"])

    rank1 = []

    def patch(r, head):
        if r != 1:
            return
        real, score = head.local.intervals, head.local.score

        def broken(hidden, **kw):
            lo, hi, hnorm, ok = real(hidden, **kw)
            ok = ok.clone()
            ok[0] = False  # as a NaN in row 0 would make it
            hi = hi.clone()
            hi[3, -1] = math.nan  # a NaN bound on one token (in a block, not sent one by one)
            return lo, hi, hnorm, ok

        def broken_score(hidden, ids, hnorm):
            z, lower, upper = score(hidden, ids, hnorm)
            upper = upper.clone()
            upper[1] = math.inf  # this rank cannot bound row 1 from above
            return z, lower, upper

        head.local.intervals, head.local.score = broken, broken_score
        peek = v1_sampler.peek_seeds

        def other_seed(n, gens):  # (each thread reads the module's function when it resolves)
            s = peek(n, gens)
            if threading.current_thread() is rank1[0]:
                s[2] += 1
            return s

        rank1.append(threading.current_thread())
        monkeypatch.setattr(v1_sampler, "peek_seeds", other_seed)

    res = resolve_tp(W, None, h, md, torch.arange(B), 2, monkeypatch, patch=patch)
    check_same_and_exact(res, md, torch.arange(B))
    (l0, s0, _, ref, calls0, _), (l1, s1, _, _, calls1, _) = res
    assert calls0 == calls1 == 1
    assert torch.equal(bits(l0[:2]), bits(ref[:2]))  # dense rows: vLLM's dense TP rows
    assert torch.equal(bits(l0[:4]), bits(ref[:4]))
    assert s0.fallbacks.get("nonfinite", 0) == 3 and s0.fallbacks.get("uncertified", 0) >= 1
    assert sum(s0.certified.values()) >= B - 4


def _mutation_mismatches(monkeypatch, mutate, families=("near_tie", "peaked", "norms"), seeds=6) -> int:
    mutate(monkeypatch)
    wrong = 0
    for family in families:
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)
            case = audit.FAMILIES[family](g, torch.float32)
            V, B = case.weight.shape[0], case.hidden.shape[0]
            for kind, T in (("top_p", 3.0), ("temperature", 1.0), ("temperature", 1e-6)):
                md = metadata(g, [T] * B, seeded=range(B), V=V, **CASES[kind])
                md.top_p = None if md.top_p is None else torch.full((B,), 0.95)
                res = resolve_tp(case.weight, case.bias, case.hidden, md, torch.arange(B), 2, monkeypatch,
                                 screen="int4", budget=1.0)
                logits, _, no_top_p, ref, _, _ = res[0]
                wrong += int((draw(logits, md, no_top_p) != run(Sampler(), ref.clone(), md, seed=5)[0]).sum())
            if wrong:
                return wrong
    return wrong


def _weaken_block(field, value):
    def mutate(monkeypatch):
        real = sharded_rows._combine

        def weak(G, R, V):
            out = list(real(G, R, V))
            setattr(out[3], field, torch.full_like(getattr(out[3], field), value))
            return tuple(out)

        monkeypatch.setattr(sharded_rows, "EXPLICIT", 2)  # a small explicit set: the block matters
        monkeypatch.setattr(sharded_rows, "_combine", weak)
    return mutate


@pytest.mark.parametrize("field,value", (("hi", -math.inf), ("noisy", -math.inf), ("leh", -math.inf),
                                         ("lel", 0.0), ("lo", math.inf)))
def test_broken_outside_block_is_caught(field, value, monkeypatch):
    """Mutation: one summary of the outside block made wrong (greedy rows' largest bound,
    sampled rows' largest noisy bound, top-p's upper mass dropped; top-p's lower mass raised;
    its smallest lower bound raised, so that every block sorts after every token): the draw
    differs from the dense draw. (For the noisy bound, the explicit tokens are chosen by
    ``yhi`` alone, a sound but weaker choice, so that the draw's winner is sometimes in the
    block.)"""
    monkeypatch.setattr(sharded_rows, "NOISY_KEY", field != "noisy")
    assert _mutation_mismatches(monkeypatch, _weaken_block(field, value)) > 0


@pytest.mark.parametrize("noisy_key", (True, False))
def test_small_explicit_set_stays_exact(noisy_key, monkeypatch):
    """The same runs as the mutation tests, unmutated (2 explicit tokens a key): no mismatch."""
    monkeypatch.setattr(sharded_rows, "EXPLICIT", 2)
    monkeypatch.setattr(sharded_rows, "NOISY_KEY", noisy_key)
    assert _mutation_mismatches(monkeypatch, lambda mp: None) == 0


def test_tp_sampler_keeps_the_off_switch_ledger_common(monkeypatch):
    """The shared off-switch's pending step time, different on each rank, is folded on the
    sampler's first gather: both ranks' ledgers take the slowest rank's time."""
    from vllm_csv.off_switch import WARMUP_STEPS
    from vllm_csv.testing.heads import hidden_near_rows, peaked_head

    V, D, B = 500, 32, 4
    g = torch.Generator().manual_seed(2)
    W, _ = peaked_head(V, D, seed=3, dtype=torch.bfloat16)
    h = hidden_near_rows(W, B, g, scale=2.0)
    md = metadata(g, [0.9] * B, seeded=range(B), V=V, **CASES["temperature"])

    def patch(r, head):
        sw = head.off_switch
        sw.switch.dense_seconds[B] = 0.01
        sw.switch._warm[sw._kind] = WARMUP_STEPS  # past the kind's uncharged warm-up steps
        sw.observe(B, 0.02 + 0.01 * r)  # a CSV step: 10 or 20 ms over dense

    res = resolve_tp(W, None, h, md, torch.arange(B), 2, monkeypatch, patch=patch, off_switch=True)
    check_same_and_exact(res, md, torch.arange(B))
    ledgers = [r[5].off_switch.switch.excess for r in res]
    assert ledgers[0] == ledgers[1] == pytest.approx(0.02)
    assert all(r[5].off_switch.pending_tensor().tolist() == [-1.0] for r in res)


def test_shared_off_switch_measures_a_memoized_dense_step_once():
    """The plugin's dense function is computed at most once a step: a second call returns the
    memo at once. The shared switch's first guess of the dense time is the real computation's,
    not the memo's (``min`` of two calls would keep ~0 and turn CSV off for good under TP,
    where in-place dense samples are not taken)."""
    from vllm_csv.sharded import SharedOffSwitch

    class Solo:
        rank, size = 0, 1

        def all_gather(self, x):
            return x[None]

    memo = []

    def measure():
        if memo:
            return 1e-7  # the memo
        memo.append(1)
        return 0.01

    sw = SharedOffSwitch(Solo())
    sw.allow(8, measure)
    assert sw.dense_seconds[8] == pytest.approx(0.01)


def _gathered(lo, hi, size, min_p):
    """Every rank's payload (contiguous shards of ``lo, hi`` ``[R, V]``, no token scored, greedy
    rows) gathered and combined as :func:`~vllm_csv.sampling.sharded_rows.certify_rows_sharded`
    does; returns ``(ylo, yhi, outside)``."""
    R, V = lo.shape
    rows = []
    for r in range(size):
        a, b = r * V // size, (r + 1) * V // size
        p = sharded_rows._explicit_and_block(lo[:, a:b], hi[:, a:b], torch.full((R, b - a), math.nan),
                                             torch.zeros((R, b - a), dtype=torch.float64),
                                             torch.zeros(R, dtype=torch.bool), torch.ones(R, dtype=torch.bool),
                                             a, min_p)
        rows.append(torch.cat([p, torch.zeros(1)]))
    ylo, yhi, _, outside, finite, _ = sharded_rows._combine(torch.stack(rows), R, V)
    assert finite.all()
    return ylo, yhi, outside


def _nucleus_case(seed, R=24, V=6000):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(R, V, generator=g) * torch.tensor([0.5, 1.0, 2.0])[torch.arange(R) % 3][:, None]
    lead = torch.randint(0, V, (R, 6), generator=g)
    y.scatter_(1, lead, torch.rand(R, 6, generator=g) * 6 + 2)
    width = torch.where(torch.rand(y.shape, generator=g) < 0.5, 0.0, 0.05)  # half scored (exact)
    lo = y - torch.rand(y.shape, generator=g) * width
    hi = y + torch.rand(y.shape, generator=g) * width
    mp = torch.where(torch.arange(R) % 2 == 0, 0.0, 0.02)
    tp = torch.rand(R, generator=g) * 0.5 + 0.45
    return y, lo, hi, mp, tp


def vllm_min_p_mask(y, min_p):
    probs = torch.softmax(y, dim=-1)
    return ~(probs < probs.amax(-1, keepdim=True) * min_p[:, None])


def _blocks_case(size):
    """min-p then top-p on the gathered numbers of :func:`_gathered`: ``(wrong decisions,
    explicit tokens decided, the same tokens decided from every token's own bounds)``."""
    y, lo, hi, mp, tp = _nucleus_case(size)
    R, V = y.shape
    after_min_p = torch.where(vllm_min_p_mask(y, mp), y, -math.inf)
    kept = torch.isfinite(apply_top_k_top_p_pytorch(after_min_p.clone(), None, tp))
    ylo, yhi, outside = _gathered(lo, hi, size, mp)
    explicit = yhi > -math.inf
    mlo, mhi, outside = min_p_bounds(ylo, yhi, mp, outside)
    tlo, thi, outside = top_p_bounds(mlo, mhi, tp, outside)
    wrong = int((torch.isfinite(tlo) & ~kept).sum()) + int((explicit & ~torch.isfinite(thi) & kept).sum())
    L = outside.hi.shape[1] // size
    for r in range(size):
        a, b = r * V // size, (r + 1) * V // size
        inside = kept[:, a:b] & ~explicit[:, a:b]  # kept tokens of rank r known only through its blocks
        top = hi[:, a:b].masked_fill(~inside, -math.inf).amax(1)
        wrong += int((top > outside.hi[:, r * L:(r + 1) * L].amax(1)).sum())
    one_lo, one_hi = top_p_bounds(*min_p_bounds(lo, hi, mp), tp)  # TP = 1: every token's own bounds
    decided = explicit & (torch.isfinite(tlo) | ~torch.isfinite(thi))
    decided_one = explicit & (torch.isfinite(one_lo) | ~torch.isfinite(one_hi))
    return wrong, int(decided.sum()), int(decided_one.sum())


@pytest.mark.parametrize("size", (2, 4))
def test_blocks_decide_min_p_and_top_p_soundly(size):
    """Explicit tokens and blocks from every rank: min-p then top-p on the gathered numbers never
    contradict vLLM's masks on the whole row (an explicit token kept / dropped for sure; a
    dropped block holds no kept token), and decide nearly every explicit token that the whole
    row's bounds decide (TP = 1: 99.1% and 99.8% here; blocks by level alone, MASS_BLOCKS = 1,
    97.3% and 98.0%)."""
    wrong, decided, decided_one = _blocks_case(size)
    assert wrong == 0
    assert decided >= 0.985 * decided_one > 0, (decided, decided_one)


def test_blocks_are_ranges_of_yhi():
    """Every live token is in a block; blocks are ranges of ``yhi`` (block ids do not decrease
    down the ``yhi`` order), and no block holds more than a share of the upper mass and a bin."""
    g = torch.Generator().manual_seed(0)
    phi = torch.randn(4, 3000, generator=g) * 3
    live = torch.rand(phi.shape, generator=g) > 0.1
    gap = phi.masked_fill(~live, -math.inf).amax(1, keepdim=True) - phi
    idx = sharded_rows._block_of(gap, phi, live)
    L = len(sharded_rows.LEVELS) + sharded_rows.MASS_BLOCKS
    assert ((idx >= 0) & (idx < L))[live].all()
    for r in range(4):
        b, v = idx[r][live[r]], phi[r][live[r]]
        order = v.argsort(descending=True)
        assert (b[order].diff() >= 0).all()
        w = torch.exp(v.double() - v.max())
        mass = torch.zeros(L, dtype=torch.float64).index_add_(0, b, w) / w.sum()
        fine = (gap[r][live[r]] * sharded_rows.FINE).floor().long()
        binmass = torch.zeros(int(fine.max()) + 1, dtype=torch.float64).index_add_(0, fine, w) / w.sum()
        assert mass.max() <= 1 / sharded_rows.MASS_BLOCKS + binmass.max() + 1e-12


@pytest.mark.parametrize("field,change", (("lo", lambda t: t + 1.0), ("leh", lambda t: t - 0.5),
                                          ("lel", lambda t: t + 0.5)))
def test_blocks_with_a_broken_summary_are_caught(field, change, monkeypatch):
    """Mutation of :func:`test_blocks_decide_min_p_and_top_p_soundly`: the blocks' smallest lower
    bound raised, upper mass lowered or lower mass raised: top-p decides against vLLM's mask."""
    real = sharded_rows._combine

    def weak(G, R, V):
        out = list(real(G, R, V))
        setattr(out[3], field, change(getattr(out[3], field)))
        return tuple(out)

    monkeypatch.setattr(sharded_rows, "_combine", weak)
    assert _blocks_case(2)[0] > 0


def test_a_block_min_p_may_thin_keeping_its_lower_side_is_caught(monkeypatch):
    """Broken bound: a block that min-p may thin (not kept as a whole) keeps its lower mass and
    smallest lower bound for top-p (as before this check existed): tokens vLLM drops are kept
    for sure (a row with min-p 0.02 and top-p about 0.8 at TP = 4)."""
    from vllm_csv.sampling.outside import Outside

    monkeypatch.setattr(Outside, "forget_lower", lambda self, blocks: self)
    assert _blocks_case(4)[0] > 0


def _sample_end_to_end(W, h, md, size, monkeypatch, seed=5):
    """Rank 0 in this thread draws through the plugin-wrapped ``Sampler`` (the hook's
    ``resolve(draw=True)``: where every row certifies, its tokens are the draw and the random
    streams are advanced without vLLM's pass); the other ranks resolve in threads. Returns
    ``(tokens, streams after, dense tokens, dense streams after, certified rows)``."""
    from test_tp import ThreadGroup

    from vllm_csv.testing.fakes import hand_off
    from vllm_csv.vllm_plugin import patches

    patches.install_samplers()
    V, B = W.shape[0], h.shape[0]

    def reset():
        torch.manual_seed(seed)
        for i, gen in md.generators.items():
            gen.manual_seed(1000 + i)

    def streams():
        return torch.get_rng_state(), [gen.get_state() for gen in md.generators.values()]

    reset()
    seeds = PEEK(B, md.generators)
    main = threading.current_thread()
    monkeypatch.setattr(v1_sampler, "peek_seeds", lambda n, gens: PEEK(n, gens) if threading.current_thread() is main
                        else seeds.clone())
    group, out, errors, tally = ThreadGroup(size), [None] * size, [], Tally()
    rows = torch.arange(B)

    def body(r):
        try:
            comm = group.member(r)
            shard = Shard.vllm_layout(V, r, size)
            w, _ = shard_of(W, None, shard)
            head = ShardedHead(w, None, shard, comm, config=HeadConfig(screen="int8", budget=0.5, off_switch=False))
            dense = dense_tp(comm, w, None, V, head.engine)
            ref = dense(h)
            logits = ref.clone()
            logits[rows] = csv_step.PLACEHOLDER
            d = csv_step.Deferred(logits, h.clone(), rows, ["sampling"] * B, ShardedAdapter(head),
                                  lambda: dense(h), (tally if r == 0 else Tally()).account())
            if r == 0:
                sampler = Sampler()
                hand_off(sampler, d)
                out[0] = (sampler(logits=logits, sampling_metadata=md).sampled_token_ids[:, 0].clone(), streams(), ref)
            else:
                v1_sampler.resolve(Sampler(), d, logits, md, draw=True)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(1, size)]
    for t in threads:
        t.start()
    body(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    tokens, got_streams, ref = out[0]
    reset()
    want = Sampler()(logits=ref.clone(), sampling_metadata=md).sampled_token_ids[:, 0]
    return tokens, got_streams, want, streams(), sum(tally.seen[0].certified.values())


@pytest.mark.parametrize("size", (2, 3))
def test_tp_drawn_batch_through_the_wrapped_sampler(size, monkeypatch):
    """End to end under TP: every row deferred, drawn through the wrapped ``Sampler`` on rank 0.
    Without top-k every row certifies and the hook's tokens are the draw (no second pass): the
    tokens and the random streams after the step are vLLM's dense draw's. With ``top_k = 1`` on
    half the rows at a high temperature (not decided on the gathered summaries: demoted to dense
    after the certificate) the batch is drawn by vLLM: a hook that took the certificate's
    winners as the draw before that demotion would draw past the top-k."""
    from vllm_csv.testing.heads import hidden_near_rows, peaked_head

    V, D, B = 1000 if size == 2 else 1100, 48, 12  # (1100: padded 1152, three shards of 384)
    g = torch.Generator().manual_seed(7)
    W, _ = peaked_head(V, D, seed=17, dtype=torch.bfloat16)
    h = hidden_near_rows(W, B, g, scale=1.5)
    md = metadata(g, [0.8] * B, seeded=range(0, B, 2), V=V, **CASES["temperature"])
    tokens, got, want, expected, certified = _sample_end_to_end(W, h, md, size, monkeypatch)
    assert certified == B  # (the drawn path)
    assert torch.equal(tokens, want)
    assert torch.equal(got[0], expected[0]) and all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
    md = metadata(g, [4.0] * B, seeded=range(0, B, 2), V=V, **CASES["temperature"])
    md.top_k = torch.tensor([1 if i % 2 else V for i in range(B)])
    h = hidden_near_rows(W, B, g, scale=0.3)  # flat rows: at T = 4 the draw is rarely the argmax
    tokens, got, want, expected, certified = _sample_end_to_end(W, h, md, size, monkeypatch)
    assert certified <= B // 2
    assert torch.equal(tokens, want), (tokens, want)
    assert torch.equal(got[0], expected[0]) and all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
