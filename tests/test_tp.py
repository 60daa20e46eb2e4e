"""Tensor parallelism (issue 11): the sharded certificate, simulated in one process.

Each rank runs in its own thread with a :class:`ThreadGroup` member as its collective (an
all-gather through a barrier), its own shard of the head in vLLM's layout (vocabulary padded
to 64, zero rows at the end) and vLLM's dense TP path (all-gather of shard logits, slice,
soft-cap, scale). Every rank must return the same ``[B, V]``; certified rows must hold the
dense top-k (ids always, value bits where values are read) and ``-inf`` elsewhere.
One test runs the same over real ``torch.distributed`` gloo processes.
"""

from __future__ import annotations

import math
import pickle
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from vllm_csv.errors import CSVError
from vllm_csv.head import CertifiedHead, HeadConfig
from vllm_csv.index import build_index
from vllm_csv.sharded import Shard, ShardedHead, TorchGroup
from vllm_csv.testing import audit
from vllm_csv.testing.fakes import csv_layer
from vllm_csv.testing.heads import hidden_near_rows


class ThreadGroup:
    """``size`` ranks in threads of one process; :meth:`member` is one rank's collective."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.gathers = 0

    def member(self, rank: int):
        group = self

        class Member:
            def __init__(self):
                self.rank, self.size = rank, group.size

            def all_gather(self, x):
                group.slots[rank] = x.clone()
                group.barrier.wait()
                out = torch.stack(group.slots)
                if rank == 0:
                    group.gathers += 1
                group.barrier.wait()  # nobody overwrites a slot before every rank has read it
                return out

        return Member()


def run_ranks(size: int, fn):
    """``[fn(rank, comm) for rank]``, each rank in its own thread."""
    group = ThreadGroup(size)
    results, errors = [None] * size, []

    def body(r):
        try:
            results[r] = fn(r, group.member(r))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, group


def shard_of(weight, bias, shard: Shard):
    """The rows vLLM loads on this rank: the real rows, then zero padding."""
    V, d = weight.shape
    padded = shard.size * shard.rows
    w = torch.zeros(padded, d, dtype=weight.dtype)
    w[:V] = weight
    b = None
    if bias is not None:
        b = torch.zeros(padded, dtype=bias.dtype)
        b[:V] = bias
    sl = slice(shard.start, shard.start + shard.rows)
    return w[sl], None if b is None else b[sl]


def dense_tp(comm, w, b, V, engine):
    """vLLM's dense TP head: shard GEMM, all-gather, slice the padding off, soft-cap, scale."""
    def fn(hidden):
        g = comm.all_gather(F.linear(hidden, w, b))  # [size, B, P]
        return engine.transform(g.permute(1, 0, 2).reshape(hidden.shape[0], -1)[:, :V])
    return fn


def shard_index(w, b, shard: Shard):
    """The ball's index of a shard's real rows (as the plugin builds it on each rank)."""
    n = shard.real
    if not n:
        return None
    return build_index(w[:n].float(), None if b is None else b[:n].float(), max(1, n // 16), progress=False)


def run_case(case: audit.Case, size: int, screen: str, k_rows=None, hidden_of=None, patch=None, temp=None):
    """Every rank's ``(out, certified, stats)`` and the dense TP logits of rank 0."""
    V = case.weight.shape[0]
    B = case.hidden.shape[0]
    topk = torch.full((B,), case.k) if k_rows is None else k_rows

    def rank(r, comm):
        shard = Shard.vllm_layout(V, r, size)
        w, b = shard_of(case.weight, case.bias, shard)
        cfg = HeadConfig(screen=screen, budget=1.0, off_switch=False)
        index = shard_index(w, b, shard) if screen == "ball" else None
        head = ShardedHead(w, b, shard, comm, config=cfg, softcap=case.softcap, scale=case.scale, index=index)
        if patch is not None:
            patch(r, head)
        dense = dense_tp(comm, w, b, V, head.engine)
        hidden = case.hidden if hidden_of is None else hidden_of(r)
        t = None if temp is None else torch.full((B,), temp)
        out, stats = head.sampler_logits(hidden, topk, dense, temperature=t)
        ref = dense(hidden)
        return out, head.last_certified, stats, ref

    return run_ranks(size, rank)[0]


def bits(x):
    return x.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def check_rows(out, certified, dense, k, full_dense=None):
    """Wrong rows: certified rows must be the dense top-k (values bit for bit when ``k >= 2``)
    with ``-inf`` elsewhere; the others the dense rows. Also against ``full_dense`` (the
    unsharded head): the certified ids are those of any accumulation order."""
    wrong = 0
    for i in range(out.shape[0]):
        if not certified[i]:
            wrong += int(not torch.equal(bits(out[i]), bits(dense[i])))
            continue
        for ref in (dense,) if full_dense is None else (dense, full_dense):
            dv, di = torch.sort(ref[i], descending=True, stable=True)
            ov, oi = torch.sort(out[i], descending=True, stable=True)
            if not torch.equal(oi[:k], di[:k]) or bool((ov[k:] != -math.inf).any()):
                wrong += 1
                break
            if k >= 2 and not torch.equal(bits(ov[:k]), bits(dv[:k])):
                wrong += 1
                break
    return wrong


def audit_run(family, seed, dtype, screen, size):
    case = audit.FAMILIES[family](torch.Generator().manual_seed(seed), dtype)
    try:
        res = run_case(case, size, screen)
    except CSVError:  # a screen may refuse a head (fp16 overflow) on some rank
        return 0, 0, 0
    outs = [r[0] for r in res]
    for r in res[1:]:  # the same logits, the same decision and statistics on every rank
        assert torch.equal(bits(r[0]), bits(outs[0])), (family, seed, dtype, screen, size)
        assert torch.equal(r[1], res[0][1]) and r[2].certified == res[0][2].certified
        assert r[2].fallbacks == res[0][2].fallbacks and r[2].scored == res[0][2].scored
    out, cert, _, dense = res[0]
    wrong = check_rows(out, cert, dense, case.k, audit.dense_reference(case))
    return case.hidden.shape[0], int(cert.sum()), wrong


@pytest.mark.parametrize("size", (2, 4))
def test_sharded_sampled_rows_keep_what_dense_keeps(size):
    """Sampled top-k rows under TP: vLLM's kept set after the temperature (ties kept) and its
    bits, as on the dense TP logits, the same on every rank."""
    rows = cert = 0
    for family in sorted(audit.FAMILIES):
        for seed in range(6):
            g = torch.Generator().manual_seed(seed)
            case = audit.FAMILIES[family](g, audit.DTYPES[seed % 2])
            temp = audit.TEMPERATURES[seed % len(audit.TEMPERATURES)]
            try:
                res = run_case(case, size, "int8", temp=temp)
            except CSVError:
                continue
            for r in res[1:]:
                assert torch.equal(bits(r[0]), bits(res[0][0])) and torch.equal(r[1], res[0][1])
            out, c, _, dense = res[0]
            B = out.shape[0]
            k, t = torch.full((B,), case.k), torch.full((B,), temp)
            wrong_set, wrong_bits = audit.sampled_mismatch(out, dense, k, t, c)
            assert not bool(wrong_set.any()) and not bool(wrong_bits.any()), (family, seed)
            rows, cert = rows + B, cert + int(c.sum())
    assert cert > 0.2 * rows, (cert, rows)


@pytest.mark.parametrize("size", (2, 4))
@pytest.mark.parametrize("screen", ("int8", "int4", "fp16", "ball"))
def test_sharded_matches_dense_on_audit_families(screen, size):
    rows = cert = 0
    for family in sorted(audit.FAMILIES):
        for seed in range(9 if screen != "ball" else 4):
            dtype = audit.DTYPES[seed % 3]
            n, c, wrong = audit_run(family, seed, dtype, screen, size)
            assert wrong == 0, (family, seed, dtype)
            if family not in audit.MOSTLY_REFUSED:
                rows, cert = rows + n, cert + c
    assert cert > (0.3 if screen != "ball" else 0.1) * rows, (cert, rows)  # the certificate is not simply off


def test_regressions_sharded():
    for case in audit.regressions():
        for size in (2, 4):
            res = run_case(case, size, "int8")
            out, cert, _, dense = res[0]
            assert all(torch.equal(bits(r[0]), bits(out)) for r in res)
            assert check_rows(out, cert, dense, case.k, audit.dense_reference(case)) == 0, case.family


def learned_case(V=1000, d=48, B=24, k=1, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, d, generator=g) / d**0.5
    h = hidden_near_rows(W, B, g)
    return audit.Case("learned", W.to(dtype), None, h.to(dtype), k)


@pytest.mark.parametrize("V", (1000, 64 * 7, 65, 3))  # not a multiple of 64; exact; a near-empty and empty shards
def test_shard_layout_and_padding(V):
    """Padding rows (logit 0 in vLLM's shard GEMM) never win: here every real logit is negative."""
    for size in (2, 4):
        shards = [Shard.vllm_layout(V, r, size) for r in range(size)]
        assert sum(s.real for s in shards) == V and shards[0].start == 0
        assert all(a.start + a.rows == b.start for a, b in zip(shards, shards[1:]))
        case = learned_case(V=V, k=min(3, V))
        case.bias = torch.full((V,), -50.0, dtype=case.weight.dtype)  # every logit < 0 = a padding row's
        res = run_case(case, size, "int8")
        out, cert, _, dense = res[0]
        assert all(torch.equal(bits(r[0]), bits(out)) for r in res)
        assert check_rows(out, cert, dense, case.k, audit.dense_reference(case)) == 0
        single = audit.make_head(case, "int8").topk(case.hidden, case.k).certified
        assert int(cert.sum()) >= int(single.sum()) > 0  # as many certified rows as one rank
        assert out.shape == (case.hidden.shape[0], V)


def test_mixed_plan_and_two_collectives_per_step():
    """Rows with k in {0, 1, 5}; a CSV step adds exactly two all-gathers (the dense rows' own
    is vLLM's)."""
    case = learned_case(V=777, k=5)
    B = case.hidden.shape[0]
    topk = torch.tensor([0, 1, 5] * (B // 3))

    def rank(r, comm):
        shard = Shard.vllm_layout(777, r, 2)
        w, b = shard_of(case.weight, None, shard)
        head = ShardedHead(w, b, shard, comm, config=HeadConfig(screen="fp16", off_switch=False))
        calls = []
        dense = dense_tp(comm, w, b, 777, head.engine)
        out, stats = head.sampler_logits(case.hidden, topk, lambda h: calls.append(1) or dense(h))
        return out, head.last_certified, stats, dense(case.hidden), len(calls)

    res, group = run_ranks(2, rank)
    out, cert, stats, dense, ncalls = res[0]
    assert torch.equal(bits(res[1][0]), bits(out))
    assert not cert[topk == 0].any() and cert[topk > 0].sum() >= 10
    assert stats.csv_rows == int((topk > 0).sum())
    for i in range(B):
        if not cert[i]:
            assert torch.equal(bits(out[i]), bits(dense[i]))
        else:
            assert check_rows(out[i : i + 1], cert[i : i + 1], dense[i : i + 1], int(topk[i])) == 0
    # CSV's two, the dense rows' one, the reference's one, and the head's one at construction (the
    # ranks agree on the engine's probe)
    assert group.gathers == 2 + ncalls + 1 + 1


def test_disagreeing_ranks_never_split():
    """Rank 1 alone refuses row 0 (its row check fails there: a rank-local reason, as a NaN in
    its copy of the row would be, but one that leaves the other rows usable; a NaN itself sends
    the whole batch dense, ``CertifiedHead.prepare``), and rank 1's exact scores of row 1 come
    with a useless upper bound: rows 0 and 1 go dense on *every* rank, the others stay certified,
    and all ranks return the same logits."""
    case = learned_case(V=900, k=1, B=8)
    hidden_of = None

    def patch(r, head):
        if r != 1:
            return
        prepare, score = head.local.prepare, head.local.score

        def refuse_row_0(hidden):
            h, hnorm, ok = prepare(hidden)
            ok = ok.clone()
            ok[0] = False
            return h, hnorm, ok

        def broken(hidden, ids, hnorm):
            z, lower, upper = score(hidden, ids, hnorm)
            upper = upper.clone()
            upper[1] = math.inf  # this rank cannot bound row 1 from above
            return z, lower, upper

        head.local.prepare, head.local.score = refuse_row_0, broken

    res = run_case(case, 2, "int8", hidden_of=hidden_of, patch=patch)
    (o0, c0, s0, d0), (o1, c1, s1, d1) = res
    assert torch.equal(c0, c1) and not c0[0] and not c0[1] and c0[2:].all()
    assert s0.fallbacks == s1.fallbacks and s0.fallbacks["nonfinite"] == 1
    assert torch.equal(bits(o0), bits(o1))
    # the dense rows are vLLM's dense TP rows
    assert torch.equal(bits(o0[0]), bits(d0[0])) and torch.equal(bits(o0[1]), bits(d0[1]))


def threshold_violations(threshold) -> int:
    """Tokens left unscored by ``threshold`` whose dense-value upper bound
    ``hi_i = y_i + delta |y_i| + spread`` (the half-width bound of
    :func:`vllm_csv.head.selection.select_two_sided`), in float64, reaches ``tau``; over shards of audit
    cases, with ``tau`` just above a token's screen value (the hardest place)."""
    bad = 0
    for family in ("peaked", "bias_cancel", "norms", "transform"):
        for seed in range(6):
            case = audit.FAMILIES[family](torch.Generator().manual_seed(seed), audit.DTYPES[seed % 3])
            V = case.weight.shape[0]
            shard = Shard.vllm_layout(V, 0, 2)
            w, b = shard_of(case.weight, case.bias, shard)

            class Solo:
                rank, size = 0, 2

                def all_gather(self, x):  # (the head's one collective at construction: its probe)
                    return torch.stack([x, x])

            try:
                head = ShardedHead(w, b, shard, Solo(), config=HeadConfig(screen="int4"),
                                   softcap=case.softcap, scale=case.scale)
            except CSVError:
                continue
            sc = head._screen(case.hidden, 1)
            y, rows = sc["y"], sc["ok"]
            hi = y.double() + sc["delta"] * y.double().abs() + sc["spread"].double()[:, None]
            for j in (0, y.shape[1] // 2):
                tau = y[:, j] + y[:, j].abs() * 1e-6
                thr = threshold(head, tau, sc["spread"], sc["delta"])
                out = (y < thr[:, None]) & (hi >= tau.double()[:, None]) & rows[:, None]
                bad += int(out.sum())
    return bad


def test_threshold_bounds_every_unscored_token():
    assert threshold_violations(ShardedHead._threshold) == 0


def test_broken_threshold_is_caught():
    """Mutation: a shard threshold that forgets the screen's spread (``g^-1(tau)`` instead of
    ``g^-1(tau - spread)``) leaves tokens unscored whose bound reaches ``tau``."""
    def weak(self, tau, spread, delta):
        return ShardedHead._threshold(self, tau, torch.zeros_like(spread), delta)

    assert threshold_violations(weak) > 0


def test_broken_outside_bound_is_caught(monkeypatch):
    """Mutation: the other ranks' scored tokens left out of ``U`` (only ``tau``)."""
    monkeypatch.setattr(ShardedHead, "_outside", staticmethod(lambda tau, rest: tau))
    wrong = 0
    for seed in range(40):
        _, _, w = audit_run("near_tie", seed, torch.bfloat16, "int4", 2)
        wrong += w
        if wrong:
            break
    assert wrong > 0


def test_ball_needs_the_shards_index_and_bad_shard():
    case = learned_case(V=128)
    shard = Shard.vllm_layout(128, 0, 2)
    w, b = shard_of(case.weight, None, shard)

    class Solo:
        rank, size = 0, 2

        def all_gather(self, x):
            return torch.stack([x, x])

    with pytest.raises(CSVError, match="ball.*index of this rank's shard"):
        ShardedHead(w, b, shard, Solo(), config=HeadConfig(screen="ball"))
    whole = build_index(case.weight.float(), None, 8, progress=False)  # the whole head's: not this shard's
    with pytest.raises(CSVError, match="CSV index is for a 128x48 head"):
        ShardedHead(w, b, shard, Solo(), config=HeadConfig(screen="ball"), index=whole)
    with pytest.raises(CSVError, match="shard"):
        ShardedHead(w[:10], b, shard, Solo())


@pytest.mark.parametrize("why", ["failed", "no_index"])
def test_a_rank_that_cannot_build_its_head_stops_every_rank(why):
    """A rank whose shard's head cannot be built (``failed``: its index file refused, as after a
    weight update that changed its shard alone; ``no_index``: screen ``ball`` without one) says so
    in the head's first collective, and every rank raises there, after the same collectives:
    the layer then switches every rank to vLLM's dense path together (before, the failing rank
    went dense alone and the ranks' collectives split: a hang under NCCL or gloo)."""
    case = learned_case(V=256)
    index = {r: build_index(case.weight[Shard.vllm_layout(256, r, 2).real_rows].float(), None, 4, progress=False)
             for r in range(2)}

    def rank(r, comm):
        shard = Shard.vllm_layout(256, r, 2)
        w, b = shard_of(case.weight, None, shard)
        calls = []
        gather = comm.all_gather
        comm.all_gather = lambda x: (calls.append(tuple(x.shape)), gather(x))[1]
        bad = r == 1
        try:
            ShardedHead(w, b, shard, comm, config=HeadConfig(screen="ball", off_switch=False),
                        index=None if bad and why == "no_index" else index[r],
                        failed=CSVError("index refused") if bad and why == "failed" else None)
        except CSVError as e:
            return str(e), calls
        return None, calls

    res, _ = run_ranks(2, rank)
    assert res[0][0] is not None and "rank(s) [1] of 2 could not build" in res[0][0]
    assert res[1][0] == "index refused" if why == "failed" else "index of this rank's shard" in res[1][0]
    assert res[0][1] == res[1][1] == [(2,)]
    ok, _ = run_ranks(2, lambda r, comm: ShardedHead(*shard_of(case.weight, None, Shard.vllm_layout(256, r, 2)),
                                                      Shard.vllm_layout(256, r, 2), comm, index=index[r],
                                                      config=HeadConfig(screen="ball", off_switch=False)))
    assert all(h.local is not None for h in ok)


def ball_bound_violations(offset_of=None) -> int:
    """Tokens whose exact logit (float64) leaves the two-sided ball's ``[lo, hi]`` (the head's
    intervals over the screen), over heads with a per-token bias (near-equal and spread) and
    hidden states near rows, far from every row, and large. ``offset_of(screen)`` replaces the
    per-token offset of the center (a mutation)."""
    bad = 0
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        V, d = 300, 24
        W = torch.randn(V, d, generator=g) / d**0.5
        bias = torch.randn(V, generator=g) * (0.01 if seed % 2 else 3.0)
        idx = build_index(W, bias, 12, progress=False)
        head = CertifiedHead(W, bias, config=HeadConfig(screen="ball", off_switch=False), index=idx, two_sided=True)
        assert head.screen.two_sided
        if offset_of is not None:
            head.screen.offset = offset_of(head.screen)
        h = torch.cat([hidden_near_rows(W, 16, g), torch.randn(8, d, generator=g), 40 * torch.randn(4, d, generator=g)])
        lo, hi, _, ok = head.intervals(h)
        z = h.double() @ W.double().T + bias.double()
        bad += int(((z < lo.double()) | (z > hi.double()))[ok].sum())
    return bad


def test_two_sided_ball_bounds_every_logit():
    assert ball_bound_violations() == 0


def test_broken_two_sided_ball_is_caught():
    """Mutation: the paper's offset ``bmax_c`` as the center's offset, with the two-sided
    radius: every token whose bias is below its cluster's maximum gets a lower bound above its
    logit."""
    assert ball_bound_violations(lambda sc: sc.bmax[sc.cluster_of]) > 0


def test_shard_index_file_per_rank_and_clear_mismatch(tmp_path):
    """``--csv-index PATH`` under TP: rank r reads PATH's ``.tpN-rankR`` file, fingerprinted on its
    shard; ``vllm-csv build-index --tensor-parallel-size N`` writes them. The whole head's file,
    or another rank's, is refused with the path, the rows and the command to run."""
    pytest.importorskip("vllm")
    from vllm_csv.cache import shard_index_path
    from vllm_csv.vllm_plugin.config import CSVDecodeConfig
    from vllm_csv.vllm_plugin.index_loader import load_or_build_index

    case = learned_case(V=200)
    W = case.weight.float()
    path = tmp_path / "head.safetensors"
    assert shard_index_path(path, 1, 2) == tmp_path / "head.tp2-rank1.safetensors"
    shards = [Shard.vllm_layout(200, r, 2) for r in range(2)]
    for sh in shards:  # what build-index --tensor-parallel-size 2 --output PATH writes
        build_index(W[sh.start : sh.start + sh.real], None, 4, progress=False).save(shard_index_path(path, sh.rank, 2))
    cfg = CSVDecodeConfig(enabled=True, screen="ball", index=str(path))
    for sh in shards:
        idx = load_or_build_index(W[sh.start : sh.start + sh.real], None, cfg, sh)
        assert idx.vocab_size == sh.real
    build_index(W, None, 4, progress=False).save(shard_index_path(path, 0, 2))  # the whole head's, as rank 0's
    with pytest.raises(CSVError, match=r"rank 0 reads the index of its shard \(vocabulary rows 0...128\).*"
                                       r"--tensor-parallel-size 2"):
        load_or_build_index(W[:128], None, cfg, shards[0])


def test_shared_off_switch_is_common(monkeypatch):
    """Rank 1's CSV steps take 50 ms more than rank 0's; the dense head is set to 10 ms. Alone,
    rank 0 would always try CSV and rank 1 would turn it off: shared, both take the same
    CSV/dense decision every step (off, then retried). Driven through the plugin's layer, which
    runs the off-switch (the head carries it and folds its pending time into the collectives)."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from vllm_csv import head as csv_head
    from vllm_csv.vllm_plugin.plan import Plan
    from vllm_csv.vllm_plugin.step import StepChannel

    real_time = csv_head.time_call
    monkeypatch.setattr(csv_head, "time_call", lambda fn, like: (real_time(fn, like), 0.01)[1])
    monkeypatch.setattr(LogitsProcessor, "forward", lambda self, lm_head, h, bias=None, skip_gather=False:
                        self.dense_tp(h))  # each rank's layer: its collective dense path
    case = learned_case(V=500, B=4)

    def rank(r, comm):
        shard = Shard.vllm_layout(500, r, 2)
        w, b = shard_of(case.weight, None, shard)
        head = ShardedHead(w, b, shard, comm, config=HeadConfig(screen="int8"))
        layer = csv_layer(head)
        layer.dense_tp = dense_tp(comm, w, b, 500, head.engine)
        select, tried = head.select, []

        def slow_select(*a, **k):  # (after the collectives: rank 0 does not wait for it)
            tried[-1] = True
            out = select(*a, **k)
            if r == 1:
                time.sleep(0.05)
            return out

        head.select = slow_select
        plan = Plan([str(i) for i in range(4)], [1] * 4)
        layer.csv_channel = channel = StepChannel()  # (the runner's, as patches.py binds it)
        for _ in range(40):
            tried.append(False)
            channel.open(plan)
            layer.forward(None, case.hidden)
            channel.close_plan()
        return tried

    res, _ = run_ranks(2, rank)
    assert res[0] == res[1]
    assert not all(res[0]) and sum(res[0]) >= 3  # off most of the time, retried now and then


def test_shared_off_switch_gathers_on_the_heads_device():
    """vLLM's NCCL group (``PyNcclCommunicator.all_gather``) asserts that a tensor it gathers is on
    its own GPU: the off-switch's one-off gather of a batch size's dense time is made on the
    head's device, as every other collective of the sharded head (a CPU tensor crashed the
    worker on the first CSV step under TP on CUDA). Checked with a device no CPU tensor is on."""
    from vllm_csv.sharded import SharedOffSwitch

    class Comm:
        rank, size, seen = 0, 2, []

        def all_gather(self, x):
            self.seen.append(x.device)
            return torch.ones((2, *x.shape))  # (every rank: built, its time 1 s)

    comm = Comm()
    sw = SharedOffSwitch(comm, device="meta")
    sw.allow(4, lambda: 0.02)
    assert comm.seen == [torch.device("meta")]
    assert sw.explains  # (rank 0 logs the common ledger's trips; the others do not:)
    comm.rank = 1
    assert not SharedOffSwitch(comm, device="meta").explains
    case = learned_case(V=200, B=2)
    shard = Shard.vllm_layout(200, 0, 2)
    head = ShardedHead(*shard_of(case.weight, None, shard), shard, Comm(), config=HeadConfig(screen="int8"))
    assert head.off_switch.device == case.weight.device


def _gloo_worker(rank, size, path, case, q):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=size)
    try:
        V = case.weight.shape[0]
        shard = Shard.vllm_layout(V, rank, size)
        w, b = shard_of(case.weight, case.bias, shard)
        comm = TorchGroup()
        head = ShardedHead(w, b, shard, comm, config=HeadConfig(screen="int8", off_switch=False))
        dense = dense_tp(comm, w, b, V, head.engine)
        out, stats = head.sampler_logits(case.hidden, torch.full((case.hidden.shape[0],), case.k), dense)
        # bytes, not tensors: a tensor in a queue is shared memory that vanishes with this process
        q.put((rank, *(pickle.dumps(t.clone()) for t in (out, head.last_certified, dense(case.hidden)))))
    finally:
        dist.destroy_process_group()


def test_gloo_processes(tmp_path):
    import torch.multiprocessing as mp

    case = learned_case(V=1001, k=2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = tmp_path / "store"
    procs = [ctx.Process(target=_gloo_worker, args=(r, 2, str(path), case, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            r, *ts = q.get(timeout=60)
            got[r] = tuple(pickle.loads(t) for t in ts)
    finally:
        for p in procs:
            p.join(30)
            if p.exitcode is None:
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    (o0, c0, d0), (o1, c1, _) = got[0], got[1]
    assert torch.equal(bits(o0), bits(o1)) and torch.equal(c0, c1) and int(c0.sum()) > 0
    assert check_rows(o0, c0, d0, case.k, audit.dense_reference(case)) == 0


@pytest.mark.parametrize("V", (3, 65, 1000, 32000, 32768, 151936))
@pytest.mark.parametrize("size", (2, 4, 8))
def test_layout_is_vllms(V, size):
    """:meth:`Shard.vllm_layout` (used by the tests and the benchmark) and
    :meth:`Shard.of_lm_head` (used in serving) agree with vLLM's own shard indices."""
    vpe = pytest.importorskip("vllm.model_executor.layers.vocab_parallel_embedding")
    padded = vpe.pad_vocab_size(V, vpe.DEFAULT_VOCAB_PADDING_SIZE)
    for rank in range(size):
        si = vpe.VocabParallelEmbedding._get_indices(padded, padded, V, V, rank, size)
        mine = Shard.vllm_layout(V, rank, size)
        assert (mine.start, mine.start + mine.rows) == (si.padded_org_vocab_start_index,
                                                        si.padded_org_vocab_end_index)
        assert mine.real == si.num_org_elements and mine.rows - mine.real == si.num_org_vocab_padding

        class LMHead:
            tp_rank, tp_size, shard_indices, num_added_embeddings = rank, size, si, 0

        assert Shard.of_lm_head(LMHead(), V) == mine
