"""Speculative decoding on the V2 runner (vllm_plugin/v2/spec.py): the plan of a step with draft
tokens (greedy requests' rows in the head, every other row dense) and the refusals, and vLLM's
own V2 ``RejectionSampler`` (its Triton kernels under Triton's interpreter, in a subprocess:
``v2_rejection_interpreted.py``) on the CSV layer's logits against the dense head's, over hostile
head families, random draft counts and drafts (accepted and rejected), greedy and sampled
requests mixed."""

from __future__ import annotations

import dataclasses
import math
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("triton")
pytest.importorskip("vllm.v1.worker.gpu.spec_decode.rejection_sampler")

from vllm.model_executor.layers.logits_processor import LogitsProcessor  # noqa: E402

from test_sampler_hook_v2 import SLOTS, fake_sampler, interpreted  # noqa: E402
from vllm_csv.errors import CSVError  # noqa: E402
from vllm_csv.testing import audit  # noqa: E402
from vllm_csv.testing.fakes import csv_layer  # noqa: E402
from vllm_csv.vllm_plugin import step as csv_step  # noqa: E402
from vllm_csv.vllm_plugin.plan import DEFER, SPEC_SAMPLED_MODE, TARGET_MODE, Plan, target_plan  # noqa: E402
from vllm_csv.vllm_plugin.v2 import plan as v2_plan, spec as v2_spec  # noqa: E402


def _rejection(sampler=None, **kw):
    """What the plan reads of a V2 ``RejectionSampler``: standard verification unless ``kw`` says."""
    rs = SimpleNamespace(sampler=sampler if sampler is not None else
                         fake_sampler(np.ones(SLOTS, np.float32), np.zeros(SLOTS, np.int64)),
                         synthetic_conditional_rates=None, use_block_verification=False, fly_window_size=0,
                         enable_adaptive_verification=False, watermark_key=None)
    for k, v in kw.items():
        setattr(rs, k, v)
    return rs


def _runner(speculative=True, **rs):
    from vllm import SamplingParams

    params = {"g": SamplingParams(temperature=0.0), "s": SamplingParams(temperature=0.8),
              "k": SamplingParams(temperature=0.7, top_k=5), "lp": SamplingParams(temperature=0.0, logprobs=2),
              "m": SamplingParams(temperature=0.9, min_p=0.1), "b": SamplingParams(temperature=1.1, logit_bias={3: 1.0}),
              "gb": SamplingParams(temperature=0.0, logit_bias={3: 1.0}), "p": SamplingParams(temperature=0.7, top_p=0.9)}
    runner = SimpleNamespace(_csv_sampling_params=params, speculative_config=object() if speculative else None)
    runner.rejection_sampler = _rejection(**rs)
    runner.sampler = runner.rejection_sampler.sampler
    return runner


def _batch(counts, req_ids=("g", "s", "k", "lp")):
    cu = np.concatenate([[0], np.cumsum(np.asarray(counts) + 1)]).astype(np.int32)
    return SimpleNamespace(req_ids=list(req_ids), num_reqs=len(req_ids), cu_num_logits_np=cu,
                           num_draft_tokens=int(sum(counts)))


def test_a_v2_step_with_drafts_certifies_greedy_requests_rows_in_the_head():
    """Greedy requests' rows in the head (``k = 1``), a plain temperature-sampling request's rows
    deferred to the verification hook (mode ``spec_sampling``), a top-k or logprobs request's
    dense."""
    runner = _runner()
    p = v2_plan.build_plan(runner, 64, input_batch=_batch((2, 0, 1, 1)))
    assert p.topk == [1, 1, 1, DEFER, 0, 0, 0, 0] and p.row_modes[:4] == [TARGET_MODE] * 3 + [SPEC_SAMPLED_MODE]
    assert p.req_ids == ["g"] * 3 + ["s"] + ["k"] * 2 + ["lp"] * 2 and p.deferred == [3]
    assert p.row_temps[3] == pytest.approx(0.8)
    # a step without drafts under speculation: the greedy request's row, the sampled one deferred
    # (the top-k one dense: the verification hook models no mask)
    assert v2_plan.build_plan(runner, 64, input_batch=_batch((0, 0, 0, 0))).topk == [1, DEFER, 0, 0]
    assert v2_spec.draft_counts(_batch((3, 0, 2, 1))) == (3, 0, 2, 1)
    # sampled requests with min-p or processors deferred too; a greedy one with processors, a
    # top-p one: dense
    q = v2_plan.build_plan(runner, 64, input_batch=_batch((1, 1, 1, 1), req_ids=("m", "b", "gb", "p")))
    assert q.topk == [DEFER] * 4 + [0] * 4 and q.row_modes[:4] == [SPEC_SAMPLED_MODE] * 4
    # without speculation: the plain plan (the sampled rows, top-k too, deferred to the sampler hook)
    plain = _runner(speculative=False)
    assert v2_plan.build_plan(plain, 64, input_batch=_batch((0, 0, 0, 0))).topk == [1, DEFER, DEFER, 0]
    assert v2_plan.build_plan(plain, 64, input_batch=_batch((1, 0, 0, 0))) is None  # (drafts without a config)


def test_the_v2_speculative_plan_is_kept_while_the_batch_and_its_draft_counts_hold():
    """As V1's: the same plan object while the batch's plan and each request's draft count hold;
    counts moved between requests (the same row total) re-route the rows."""
    runner = _runner()
    p = v2_plan.build_plan(runner, 64, input_batch=_batch((2, 0, 1, 1)))
    assert v2_plan.build_plan(runner, 64, input_batch=_batch((2, 0, 1, 1))) is p
    q = v2_plan.build_plan(runner, 64, input_batch=_batch((1, 0, 1, 2)))
    assert q is not p and q.topk == [1, 1, DEFER, 0, 0, 0, 0, 0]
    r = v2_plan.build_plan(runner, 64, input_batch=_batch((1, 1, 1, 1), req_ids=("s", "g", "k", "lp")))
    assert r.topk == [DEFER, DEFER, 1, 1, 0, 0, 0, 0]  # (a reordered batch: a new base plan)


@pytest.mark.parametrize("what", ["synthetic", "block", "fly", "adaptive", "watermark", "sampler", "sharder",
                                  "broadcast", "layout"])
def test_v2_steps_stay_dense_where_verification_reads_more_than_the_argmax(what):
    rs = {"synthetic": dict(synthetic_conditional_rates=torch.ones(2)), "block": dict(use_block_verification=True),
          "fly": dict(fly_window_size=4), "adaptive": dict(enable_adaptive_verification=True),
          "watermark": dict(watermark_key=7), "sampler": dict(sampler=object())}.get(what, {})
    runner = _runner(**rs)
    batch = _batch((2, 0, 1, 1))
    if what == "sharder":
        runner.batch_sharder = object()
    if what == "broadcast":
        runner.broadcast_pp_output = True
    if what == "layout":  # rows that are not one request's after another's
        batch.cu_num_logits_np = np.array([0, 3, 3, 5, 7], np.int32)
    assert v2_plan.build_plan(runner, 64, input_batch=batch) is None
    assert v2_plan.build_plan(_runner(), 64, input_batch=_batch((2, 0, 1, 1))) is not None


FAMILIES = ("peaked", "ties", "near_tie", "norms", "overflow", "nonfinite", "outliers")


def _verifier(temps, seeds):
    """What :mod:`~vllm_csv.vllm_plugin.v2.verify` reads of a V2 ``RejectionSampler``: standard
    verification around a V2 ``Sampler`` with these states, no logprobs, every prefill of one token."""
    sampler = fake_sampler(temps, seeds)
    sampler.sampling_states.max_num_logprobs = lambda idx: -1
    sampler.req_states = SimpleNamespace(prefill_len=SimpleNamespace(gpu=torch.ones(SLOTS, dtype=torch.int32)))
    return _rejection(sampler)


def _input_batch(slots, cu, input_ids, positions, local):
    N = int(cu[-1])
    return SimpleNamespace(num_reqs=slots.numel(), idx_mapping_np=slots.numpy().astype(np.int64),
                           cu_num_logits_np=cu.numpy(), logits_indices=torch.arange(N), input_ids=input_ids,
                           positions=positions, expanded_local_pos=local,
                           expanded_idx_mapping=torch.repeat_interleave(slots, torch.diff(cu)))


def test_v2_rejection_sampler_on_certified_rows_equals_dense(tmp_path, monkeypatch):
    """vLLM's V2 ``RejectionSampler`` (``apply_sampling_params``, ``rejection_sample``) on the CSV
    layer's logits of a speculative step gives the tokens and accepted counts it gives on the
    dense head's, over hostile families, screens, random batches, draft counts and drafts (the
    dense argmax, accepted, or a random token), under two plans: ``csv``, greedy requests' rows
    certified ``k = 1`` and sampled requests' rows dense; ``verified``, as
    :func:`~vllm_csv.vllm_plugin.v2.spec.spec_plan` plans them, the sampled requests' rows also
    deferred and resolved by the verification hook (:func:`~vllm_csv.vllm_plugin.v2.verify.resolve`:
    their acceptances and next token certified, or dense); and ``fused``, the same with the head's
    backend CUDA's on int8 heads (one-hot and probabilistic drafts), where the hook takes the device path
    (:func:`~vllm_csv.sampling.verify_v2_fused.verify_fused`, the kernels' torch references on the
    CPU). Also: the hook's drafts are V2's own ``gather_draft_sampled``'s."""
    from vllm_csv.gpu.step import FusedStep
    from vllm_csv.head.backend import Cuda
    from vllm_csv.vllm_plugin.v2 import verify as v2_verify

    fused_calls = []
    real_fused = v2_verify.verify_fused
    monkeypatch.setattr(v2_verify, "verify_fused", lambda *a: fused_calls.append(1) or real_fused(*a))

    S, num_spec = SLOTS, 3
    temps = np.zeros(S, np.float32)
    g0 = torch.Generator().manual_seed(11)
    temps[::2] = torch.tensor([0.8, 1.0, 0.5])[torch.randint(0, 3, (S // 2,), generator=g0)].numpy()
    seeds = torch.randint(0, 2**62, (S,), generator=g0).numpy()
    rs = _verifier(temps, seeds)
    batches, certified, greedy_rows, cases, verified_reqs, fused_reqs, fused_prob = [], 0, 0, [], 0, 0, 0
    for family in FAMILIES:
        for screen in ("int8", "fp16"):
            g = torch.Generator().manual_seed(zlib.crc32(f"{family}-{screen}-v2".encode()))
            case = audit.FAMILIES[family](g, torch.bfloat16)
            try:
                head = audit.make_head(case, screen, budget=0.5)
            except CSVError:  # (the fp16 screen refuses heads whose rows overflow fp16)
                continue
            cases.append((family, screen))

            def dense(x, case=case):
                return audit.dense_reference(dataclasses.replace(case, hidden=x))

            monkeypatch.setattr(LogitsProcessor, "forward",
                                lambda self, lm, x, bias=None, skip_gather=False, dense=dense: dense(x))
            layer = csv_layer(head)
            channel = csv_step.StepChannel()
            layer.csv_channel = channel
            rs.sampler.csv_channel = channel
            for _ in range(3):
                R = int(torch.randint(1, 6, (1,), generator=g))
                slots = torch.randperm(S, generator=g)[:R].to(torch.int32)
                counts = tuple(int(torch.randint(0, num_spec + 1, (1,), generator=g)) for _ in range(R))
                N = sum(1 + c for c in counts)
                hidden = case.hidden[torch.randint(0, case.hidden.shape[0], (N,), generator=g)]
                want = dense(hidden)
                top = want.float().argmax(-1)
                rt = [float(temps[s]) for s in slots.tolist()]
                base = Plan([str(i) for i in range(R)], [1 if t == 0 else DEFER for t in rt],
                            ["greedy" if t == 0 else "sampling" for t in rt], rt)
                input_ids = torch.randint(0, case.weight.shape[0], (N,), generator=g)
                local, positions, row = [], [], 0
                for c in counts:  # the row after a target row holds its draft: the argmax, or not
                    for j in range(c):
                        if float(torch.rand(1, generator=g)) < 0.7:
                            input_ids[row + j + 1] = top[row + j]
                    start = int(torch.randint(8, 2**16, (1,), generator=g))
                    local += list(range(c + 1))
                    positions += list(range(start, start + c + 1))
                    row += c + 1
                cu = torch.tensor([0] + list(np.cumsum([c + 1 for c in counts])), dtype=torch.int32)
                batch = _input_batch(slots, cu, input_ids, torch.tensor(positions), torch.tensor(local))
                draft_logits = None
                if len(batches) % 2:  # probabilistic drafts: the drafter's logits near the target's,
                    # half of the drafts a token it overrates (rejections, residual draws)
                    V = case.weight.shape[0]
                    draft_logits = torch.full((S, num_spec, V), -math.inf)
                    row = 0
                    for s_, c in zip(slots.tolist(), counts):
                        for j in range(c):
                            noisy = want[row + j].float().nan_to_num(nan=0.0, posinf=1e4, neginf=-1e4)
                            draft_logits[s_, j] = noisy + 0.3 * torch.randn(V, generator=g)
                            if float(torch.rand(1, generator=g)) < 0.5:
                                z = int(torch.randint(0, V, (1,), generator=g))
                                draft_logits[s_, j, z] += 8.0
                                input_ids[row + j + 1] = z
                        row += c + 1
                logits = {"dense": want}
                on_device = screen == "int8"
                for name, sampled in (("csv", False), ("verified", True), ("fused", True))[:3 if on_device else 2]:
                    plan = target_plan(base, counts, sampled=sampled)
                    channel.open(plan)
                    got = layer.forward(None, hidden)
                    channel.close_plan()
                    if sampled and plan.deferred:
                        d = channel.step.take_handoff(got)
                        if name == "fused":  # (CUDA's backend and the fused step it builds, for the hook)
                            backend, head.backend, head._fused = head.backend, Cuda(), FusedStep(head)
                        try:
                            st = v2_verify.resolve(rs, d, got, batch, draft_logits)
                        finally:
                            if name == "fused":
                                head.backend, head._fused = backend, None
                        if name == "fused":
                            fused_reqs += st.certified.get("spec_sampling", 0)
                            fused_prob += st.certified.get("spec_sampling", 0) if draft_logits is not None else 0
                        else:
                            verified_reqs += st.certified.get("spec_sampling", 0)
                    elif any(plan.topk):
                        certified += int(head.last_certified.sum())
                    logits[name] = got
                greedy_rows += sum(k == 1 for k in target_plan(base, counts).topk)
                batches.append({"V": case.weight.shape[0], "slots": slots, "cu_num_logits": cu, "input_ids": input_ids,
                                "positions": torch.tensor(positions), "local_pos": torch.tensor(local),
                                "logits": logits, "case": (family, screen, counts, rt), "draft_logits": draft_logits,
                                "drafts": v2_verify.drafts_of(batch, rs.sampler.req_states.prefill_len.gpu)})
    assert len(cases) >= 6, cases
    out = interpreted("v2_rejection_interpreted.py", {"SLOTS": S, "temp": temps, "seeds": seeds, "num_spec": num_spec,
                         "batches": [{k: v for k, v in b.items() if k not in ("case", "drafts")} for b in batches]},
                      tmp_path)
    accepted = sampled_accepted = 0
    for b, res in zip(batches, out):
        assert torch.equal(res["gather_draft_sampled"], b["drafts"]), b["case"]
        sd, nd = res["dense"]
        for name in [k for k in ("csv", "verified", "fused") if k in res]:
            sc, nc = res[name]
            assert torch.equal(nd, nc), (name, b["case"])
            for i, n in enumerate(nd.tolist()):  # (past num_sampled the buffer holds nothing)
                assert torch.equal(sd[i, :n], sc[i, :n]), (name, b["case"], i)
        accepted += int(nd.sum()) - len(b["slots"])
        sampled_accepted += sum(int(n) - 1 for n, t in zip(nd.tolist(), b["case"][3]) if t > 0)
    assert certified > 0 and greedy_rows > 0 and accepted > 0, (certified, greedy_rows, accepted)
    assert verified_reqs > 0 and sampled_accepted > 0, (verified_reqs, sampled_accepted)
    assert fused_calls and fused_reqs > fused_prob > 0, (len(fused_calls), fused_reqs, fused_prob)


@pytest.mark.parametrize("why", [None, "draft_logits", "invalid_drafts", "top_p", "logprobs", "fp64",
                                 "sharded", "not_whole", "placeholder", "past_vocab"])
def test_the_verification_hook_sends_what_it_cannot_certify_dense(why):
    """:func:`~vllm_csv.vllm_plugin.v2.verify.resolve` on three sampled requests (2, 1 and 0 drafts):
    with nothing in the way, requests certified (their rows partial); with a drafter vocabulary
    of another size, drafts a grammar checks, a top-p or logprobs elsewhere in the batch, min-p on a request, fp64
    noise, a sharded head or rows that are not whole requests, every deferred row is the dense
    head's, counted ``unsupported``; a request with a placeholder draft (within its prefill) or a
    draft past the vocabulary alone."""
    from test_sampler_hook_v2 import case, defer
    from vllm_csv.sampling.sharded_rows import ShardedAdapter
    from vllm_csv.vllm_plugin.v2 import verify as v2_verify

    head, h, temps, seeds, batch0 = case(seed=4, B=6)
    slots = torch.as_tensor(batch0.idx_mapping_np[:3], dtype=torch.int32)
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    dense = head.dense_logits(h)
    ids = dense.float().argmax(-1)
    input_ids = torch.zeros(6, dtype=torch.long)
    input_ids[1:3], input_ids[4] = ids[0:2], ids[3]  # (drafts: each target row's argmax)
    positions, local = torch.tensor([40, 41, 42, 70, 71, 90]), torch.tensor([0, 1, 2, 0, 1, 0])
    batch = _input_batch(slots, cu, input_ids, positions, local)
    rows = torch.arange(6)
    rs = _verifier(temps, seeds)
    kw = {}
    if why == "draft_logits":  # (a drafter vocabulary of another size)
        kw["draft_logits"] = torch.zeros(SLOTS, 3, dense.shape[1] - 64)
    if why == "invalid_drafts":
        kw["invalid_drafts"] = torch.zeros(6, dtype=torch.bool)
    if why in ("top_p", "logprobs"):
        other = np.setdiff1d(np.arange(SLOTS), batch.idx_mapping_np)[0]
        batch.idx_mapping_np = np.append(batch.idx_mapping_np, other)  # (a fourth request, not deferred)
        ss = rs.sampler.sampling_states
        if why == "top_p":
            ss.top_p.np[other] = 0.9
        if why == "logprobs":
            ss.max_num_logprobs = lambda idx: 2 if other in idx else -1
    if why == "fp64":
        rs.sampler.use_fp64_gumbel = True
    if why == "not_whole":
        rows = torch.tensor([0, 1, 3, 4, 5])
    if why == "placeholder":  # request 1's draft slot within its prefill: gather_draft_sampled gives -1
        rs.sampler.req_states.prefill_len.gpu[int(slots[1])] = 80
    if why == "past_vocab":  # request 1's draft a token past the vocabulary
        batch.input_ids[4] = dense.shape[1]
    d, logits = defer(head, h, rows, [])
    if why == "sharded":
        d.adapter = object.__new__(ShardedAdapter)
    st = v2_verify.resolve(rs, d, logits, batch, **kw)
    if why is None:
        assert st.certified.get("sampling", 0) >= 3 and not torch.equal(logits, dense), st
    elif why in ("placeholder", "past_vocab"):
        assert torch.equal(logits[3:5], dense[3:5]) and st.fallbacks.get("unsupported") == 2, st
        assert st.certified.get("sampling", 0) >= 3, st
    else:
        assert torch.equal(logits, dense) and st.fallbacks == {"unsupported": rows.numel()} and not st.certified, st


def test_the_v2_rejection_sampler_is_wrapped_and_its_calls_pass_through():
    """install_samplers() wraps V2's ``RejectionSampler.__call__``; without a step's hand-off the
    call is vLLM's own, every argument passed on."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

    from vllm_csv.vllm_plugin import patches
    from vllm_csv.vllm_plugin.v2.verify import verify

    patches.install_samplers()
    assert getattr(RejectionSampler, "_csv_wrapped", False) and RejectionSampler.__call__.__module__ == patches.__name__
    seen = []
    rs = _rejection()
    logits, batch, dl, inv = torch.zeros(2, 3), object(), torch.ones(1), torch.zeros(2, dtype=torch.bool)
    out = verify(lambda *a: seen.append(a) or "out", rs, logits, batch, dl, inv)
    assert out == "out" and seen == [(rs, logits, batch, dl, inv)]


@pytest.mark.parametrize("seed,screen,fused", [(0, "int8", False), (1, "fp16", False), (0, "int8", True),
                                               (2, "int8", True)])
def test_the_verification_hook_with_vllms_processors_equals_dense(tmp_path, seed, screen, fused):
    """Sampled requests with vLLM's V2 processors (a bias of -4 and +2 on their top tokens,
    allowed ids, min_tokens' stop tokens and bad words on them, repetition / frequency /
    presence penalties on outputs holding them; the penalties also count the request's earlier
    drafts), with min-p (0.05 to 0.5) and with neither, drafts accepted and rejected: the hook in front of vLLM's V2
    ``RejectionSampler``, all under Triton's interpreter (``v2_verify_hook_interpreted.py``),
    gives the dense head's tokens and accepted counts; a hook told no processors does not.
    ``fused``: the head's backend CUDA's: the hook takes the device path
    (:func:`~vllm_csv.sampling.verify_v2_fused.verify_fused`, its kernels interpreted) with the
    processors and min-p on its bounds; with seed 2, probabilistic drafts (the drafter's logits
    near the target's, the draft overrated), whose rejected rows it draws from their residual."""
    from test_sampler_hook_v2 import D, V

    from vllm_csv.testing.heads import hidden_near_rows, peaked_head

    g = torch.Generator().manual_seed(100 + seed)
    W, gw = peaked_head(V, D, seed=seed, dtype=torch.bfloat16)
    R, S, num_spec = 12, SLOTS, 3
    counts = [int(torch.randint(0, num_spec + 1, (1,), generator=g)) for _ in range(R)]
    cu = [0] + np.cumsum([n + 1 for n in counts]).tolist()
    N = cu[-1]
    h = hidden_near_rows(W, N, gw, scale=1.2)
    top = torch.nn.functional.linear(h.float(), W.float()).topk(4, dim=1).indices
    slots = torch.randperm(S, generator=g)[:R]
    c = {"W": W, "h": h, "screen": screen, "SLOTS": S, "slots": slots, "num_spec": num_spec,
         "cu_num_logits": torch.tensor(cu), "rows": torch.arange(N), "no_process": seed == 0, "fused": fused,
         "temp": [1.0] * S, "min_p": [0.0] * S, "seeds": torch.randint(-2**62, 2**62, (S,), generator=g).tolist(),
         "rep": [1.0] * S, "freq": [0.0] * S, "pres": [0.0] * S, "min_tokens": [0] * S,
         "bias": [{} for _ in range(S)], "allowed": [[] for _ in range(S)], "stop": [[] for _ in range(S)],
         "bad": [[] for _ in range(S)], "prompt": [[1, 2, 3] for _ in range(S)], "output": [[] for _ in range(S)]}
    input_ids = torch.randint(0, V, (N,), generator=g)
    positions, local = [], []
    for i, (s, n) in enumerate(zip(slots.tolist(), counts)):
        r0, t = cu[i], top[cu[i]].tolist()
        c["temp"][s] = (0.5, 0.8, 1.0, 1.3)[i % 4]
        kind = i % 4
        if kind in (0, 3) and i % 8 < 4:
            c["min_p"][s] = (0.05, 0.2, 0.5)[i % 3]
        if kind == 1:
            c["bias"][s] = {t[0]: -4.0, t[1]: 2.0}
            c["allowed"][s] = [x for x in range(0, V, 3) if x != t[2]][:400] if i % 8 == 1 else []
        if kind == 2:
            c["min_tokens"][s], c["stop"][s], c["bad"][s] = 5, [t[0]], [t[1]]
        if kind == 3:
            c["rep"][s], c["freq"][s], c["pres"][s] = 1.8, 0.7, 0.5
            c["output"][s] = [t[0], t[0], t[1]]
        for j in range(n):  # the draft each target row verifies: its best token, its second, or any
            u = float(torch.rand(1, generator=g))
            input_ids[r0 + j + 1] = int(top[r0 + j, 0 if u < 0.5 else 1]) if u < 0.8 else int(input_ids[r0 + j + 1])
        start = int(torch.randint(8, 2**16, (1,), generator=g))
        positions += list(range(start, start + n + 1))
        local += list(range(n + 1))
    c.update(input_ids=input_ids, positions=torch.tensor(positions), local_pos=torch.tensor(local))
    if seed == 2:  # (probabilistic drafts: [slot, draft step, V], the target's row plus noise, the draft overrated)
        x = torch.nn.functional.linear(h.float(), W.float())
        dl = torch.full((S, num_spec, V), -math.inf)
        for i, (s, n) in enumerate(zip(slots.tolist(), counts)):
            for j in range(n):
                dl[s, j] = x[cu[i] + j] + 0.3 * torch.randn(V, generator=g)
                dl[s, j, int(input_ids[cu[i] + j + 1])] += 1.0
        c["draft_logits"] = dl
    out = interpreted("v2_verify_hook_interpreted.py", c, tmp_path)
    (sd, nd), (sh, nh) = out["dense"], out["hooked"]
    assert torch.equal(nd, nh), (nd, nh)
    for i, n in enumerate(nd.tolist()):
        assert torch.equal(sd[i, :n], sh[i, :n]), i
    certified, fallbacks = out["hooked_stats"]
    # (probabilistic drafts on the device path: its lse, from the acceptance's blocks, is too wide for
    # most residual draws of this flat head; tests/test_verify_v2_fused.py measures it where it is not)
    assert certified.get("spec_sampling", 0) >= (N // 6 if seed == 2 else N // 2), (certified, fallbacks)
    assert out["device_path"] == fused
    assert int(nd.sum()) > R  # (drafts accepted)
    if seed == 0:
        (sn, nn) = out["no_process"]
        assert not (torch.equal(nn, nd) and all(torch.equal(sn[i, :n], sd[i, :n]) for i, n in enumerate(nd.tolist())))
