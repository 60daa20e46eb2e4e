"""The V2 runner's sampler hook (vllm_plugin.v2.sampler.resolve): rows filled by the hook, then drawn by
vLLM's own V2 ``gumbel_sample`` (Triton's interpreter on the CPU), give the tokens the dense
logits give, with the seeds, positions and temperatures read through ``expanded_idx_mapping``
as the kernel reads them; batches vLLM may draw otherwise stay dense. (On a GPU:
test_sampling_gumbel_v2_cuda.py, compiled kernels.)"""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_csv.testing.heads import hidden_near_rows, peaked_head

pytest.importorskip("vllm")
pytest.importorskip("triton")
from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler  # noqa: E402

from test_sampling_gumbel_v2 import vllm_v2_run  # noqa: E402
from vllm_csv import CertifiedHead, HeadConfig  # noqa: E402
from vllm_csv.sampling.head_adapter import HeadAdapter  # noqa: E402
from vllm_csv.sampling.rows_v2 import certify_rows_v2  # noqa: E402
from vllm_csv.sampling.sharded_rows import ShardedAdapter  # noqa: E402
from vllm_csv.testing.fakes import Tally  # noqa: E402
from vllm_csv.vllm_plugin import patches, step as csv_step  # noqa: E402
from vllm_csv.vllm_plugin.plan import DEFER  # noqa: E402
from vllm_csv.vllm_plugin.v2 import plan as v2_plan, sampler as v2_sampler  # noqa: E402

V, D, SLOTS = 2048, 48, 40


def fake_sampler(temps, seeds, top_p=None):
    """A V2 ``Sampler`` (its own class: the hook accepts no subclass) holding only what the hook
    reads: the per-request states (host mirrors and device tensors, as UvaBackedTensor)."""
    s = V2Sampler.__new__(V2Sampler)
    s.use_fp64_gumbel, s.trace_replay_state, s.return_sampling_mask, s.logits_processors = False, None, False, []
    s.thinking_budget_state, s.needs_logits_processing = SimpleNamespace(enabled=False), np.zeros(SLOTS, dtype=bool)

    def uva(a):
        return SimpleNamespace(np=a, gpu=torch.from_numpy(a))

    tp = np.ones(SLOTS, dtype=np.float32) if top_p is None else top_p
    s.sampling_states = SimpleNamespace(
        vocab_size=V, temperature=uva(temps), seeds=uva(seeds), top_k=uva(np.full(SLOTS, V, dtype=np.int32)),
        top_p=uva(tp), min_p=uva(np.zeros(SLOTS, dtype=np.float32)),
        any_greedy=lambda b: bool(np.any(temps[b] == 0)), any_explicit_seed=lambda b: False)
    s.use_flashinfer, s.use_xpu_sampler, s.logprobs_mode = False, False, "raw_logprobs"
    return s


def case(seed=0, B=24):
    g = torch.Generator().manual_seed(seed)
    W, gw = peaked_head(V, D, seed=seed, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", off_switch=False))
    h = torch.cat([hidden_near_rows(W, B - 4, gw, scale=2.0), torch.randn(4, D, generator=g).bfloat16()])
    slots = torch.randperm(SLOTS, generator=g)[:B].to(torch.int32)  # row -> request slot
    temps = np.zeros(SLOTS, dtype=np.float32)
    temps[slots.numpy()] = np.array([(0.7, 1.0, 1.3, 0.25, 2.0)[i % 5] for i in range(B)], dtype=np.float32)
    seeds = torch.randint(-2**62, 2**62, (SLOTS,), generator=g).numpy()
    positions = torch.randint(0, 2**20, (3 * B,), generator=g)
    logits_indices = torch.sort(torch.randperm(3 * B, generator=g)[:B]).values
    batch = SimpleNamespace(num_reqs=B, idx_mapping_np=slots.numpy().astype(np.int64), expanded_idx_mapping=slots,
                            positions=positions, logits_indices=logits_indices)
    return head, h, temps, seeds, batch


def defer(head, h, rows, seen):
    logits = head.dense_logits(h).clone()
    logits[rows] = csv_step.PLACEHOLDER
    d = csv_step.Deferred(logits, h[rows].clone(), rows, ["sampling"] * rows.numel(), HeadAdapter(head),
                          lambda: head.dense_logits(h), Tally(seen.append).account())
    return d, logits


def draws(tmp_path, batch, temps, seeds, *logits):
    """vLLM's V2 draw of each ``logits`` ([B, V]), the kernel reading seeds and temperatures by
    request slot and positions by row, dividing by the temperature itself."""
    x = torch.cat([z.float() for z in logits])
    n = len(logits)
    out = vllm_v2_run({"noise": False, "logits": x, "idx_mapping": batch.expanded_idx_mapping.repeat(n),
                       "temp": torch.from_numpy(temps), "seeds": torch.from_numpy(seeds),
                       "pos": batch.positions[batch.logits_indices].repeat(n), "apply_temperature": True}, tmp_path)
    return out["draw"].view(n, -1)


def test_resolve_v2_draws_the_dense_tokens(tmp_path):
    head, h, temps, seeds, batch = case()
    rows = torch.tensor([0, 1, 2, 3, 5, 6, 8, 9, 10, 11, 13, 14, 15, 16, 17, 19, 20, 21, 22, 23])
    seen = []
    d, logits = defer(head, h, rows, seen)
    sampler = fake_sampler(temps, seeds)
    st = v2_sampler.resolve(sampler, d, logits, batch)
    dense = head.dense_logits(h)
    # a broken wiring: the seeds of the rows' own indices instead of their request slots
    wrong = certify_rows_v2(HeadAdapter(head), h[rows], torch.from_numpy(seeds)[rows],
                            batch.positions[batch.logits_indices][rows], torch.from_numpy(temps)[batch.expanded_idx_mapping[rows].long()])
    broken = dense.clone()
    broken[rows[wrong.certified]] = wrong.values[wrong.certified]
    got, want, bad = draws(tmp_path, batch, temps, seeds, logits, dense, broken)
    assert torch.equal(got, want)
    assert st.certified.get("sampling", 0) >= 0.8 * rows.numel(), st
    assert not torch.equal(logits[rows], dense[rows])  # the certified rows are partial (-inf outside S)
    assert bool((bad != want).any())  # the test sees a wrong seed mapping


@pytest.mark.parametrize("why", ["flashinfer", "masks_unknown", "fp64", "subclass", "sharded"])
def test_resolve_v2_leaves_batches_vllm_draws_otherwise_dense(why, monkeypatch):
    head, h, temps, seeds, batch = case(seed=1, B=8)
    rows = torch.tensor([0, 2, 3, 7])
    seen = []
    d, logits = defer(head, h, rows, seen)
    top_p = None
    if why in ("flashinfer", "masks_unknown"):  # another row of the batch has a top-p
        top_p = np.ones(SLOTS, dtype=np.float32)
        top_p[batch.idx_mapping_np[5]] = 0.9
    sampler = fake_sampler(temps, seeds, top_p)
    if why == "flashinfer":  # no greedy row, no explicit seed: V2 draws the batch with FlashInfer
        sampler.use_flashinfer = True
    if why == "masks_unknown":  # top-k / top-p kernels of no release checked
        monkeypatch.setattr(v2_sampler, "v2_masks_known", lambda: False)
    if why == "fp64":
        sampler.use_fp64_gumbel = True
    if why == "subclass":
        sampler.__class__ = type("Watermarked", (V2Sampler,), {})
    if why == "sharded":
        d.adapter = object.__new__(ShardedAdapter)
    st = v2_sampler.resolve(sampler, d, logits, batch)
    assert torch.equal(logits, head.dense_logits(h)) and st.fallbacks == {"unsupported": 4} and not st.certified


def test_v2_plan_defers_sampled_rows_with_min_p_or_processors_to_a_certified_sampler():
    """Temperature rows, with min-p, processors, structured output, a top-k (at any ``k``: the
    head's kept set is V1's draw, not V2's), a top-p or none of these, and greedy rows with
    processors or structured output are deferred where the V2 sampler is certified (and no
    tensor parallelism); a structured row with min_tokens is dense, plain greedy rows are
    certified in the head."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    json = StructuredOutputsParams(json={"type": "object"})
    params = {"a": SamplingParams(temperature=0), "b": SamplingParams(temperature=0.7, seed=3),
              "c": SamplingParams(temperature=0.8, top_p=0.9), "d": SamplingParams(temperature=1.0, presence_penalty=1),
              "e": SamplingParams(temperature=0.9, top_k=5), "f": SamplingParams(temperature=0.8, min_p=0.1),
              "g": SamplingParams(temperature=0, logit_bias={3: 2.0}),
              "h": SamplingParams(temperature=0, structured_outputs=json),
              "i": SamplingParams(temperature=0.7, structured_outputs=json),
              "j": SamplingParams(temperature=0.7, top_p=0.9, structured_outputs=json),
              "k": SamplingParams(temperature=0, min_tokens=2, structured_outputs=json)}
    ids = list(params)
    D = DEFER
    ok = SimpleNamespace(_csv_sampling_params=params, sampler=fake_sampler(np.ones(SLOTS, np.float32), np.zeros(SLOTS, np.int64)))
    p = v2_plan.build_plan(ok, 64, ids)
    assert p.topk == [1, D, D, D, D, D, D, D, D, D, 0]
    assert p.modes == ["greedy", "sampling", "top_p", "processed", "top_k", "min_p", "processed", "structured",
                       "structured", "structured", ""]
    assert p.deferred == [1, 2, 3, 4, 5, 6, 7, 8, 9] and p.row_temps[1] == pytest.approx(0.7) and p.row_temps[6] == 0.0
    tp = SimpleNamespace(_csv_sampling_params=params, sampler=ok.sampler,
                         vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2)))
    other = SimpleNamespace(_csv_sampling_params=params, sampler=object())
    for runner in (tp, other):
        assert v2_plan.build_plan(runner, 64, ids).topk == [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]


def test_the_v2_runner_and_sampler_are_wrapped():
    """install() wraps the classes vLLM 0.32's V2 worker builds (``vllm.v1.worker.gpu.model_runner
    .GPUModelRunner``, its ``Sampler``); with no hand-off the sampler call is vLLM's own."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    patches.install_runners(lambda runner: 64)
    patches.install_samplers()
    assert getattr(GPUModelRunner, "_csv_wrapped", False) and getattr(V2Sampler, "_csv_wrapped", False)
    assert GPUModelRunner.sample.__name__ == "sample" and V2Sampler.__call__.__name__ == "call"
    assert GPUModelRunner.sample.__module__ == patches.__name__
    assert csv_step.Step().take_handoff(torch.zeros(1, 1)) is None


def test_certify_rows_v2_rows_out_of_reach_and_greedy_rows():
    """A NaN hidden state leaves its batch uncertified (nonfinite); a row with a negative
    temperature is never certified; a greedy row (temperature 0) is certified with the dense
    logits' argmax."""
    head, h, temps, seeds, batch = case(seed=2, B=6)
    t = torch.tensor([0.0, 0.0, 0.7, 1.0, -1.0, 1.0])  # (rows 0 and 1 near a head row: a clear argmax)
    bad = h.clone()
    bad[1, 3] = math.nan
    res = certify_rows_v2(HeadAdapter(head), bad, torch.from_numpy(seeds[:6]), torch.arange(6), t)
    assert not bool(res.certified.any()) and res.reason[1] == "nonfinite"
    res = certify_rows_v2(HeadAdapter(head), h, torch.from_numpy(seeds[:6]), torch.arange(6), t)
    assert not bool(res.certified[4]) and bool(res.certified[[0, 1, 2]].all())
    assert torch.equal(res.winner[:2], head.dense_logits(h[:2]).float().argmax(1))


def interpreted(script: str, case: dict, d):
    """``tests/<script>`` (``python script CASE OUT``: vLLM's V2 code with its Triton kernels under
    the interpreter) on ``case``, in a subprocess; its output."""
    import subprocess
    import sys
    from pathlib import Path

    torch.save(case, d / "case.pt")
    path = Path(__file__).resolve().parent / script
    p = subprocess.run([sys.executable, str(path), str(d / "case.pt"), str(d / "out.pt")],
                       capture_output=True, text=True, timeout=1500)
    if p.returncode != 0:
        raise AssertionError(p.stderr[-3000:])
    return torch.load(d / "out.pt", weights_only=False)


def v2_pipeline(case: dict, d) -> dict:
    """``tests/v2_interpreted.py`` on ``case`` (vLLM's V2 ``Sampler.sample`` and processors in
    Triton's interpreter, the hook in front), in a subprocess."""
    return interpreted("v2_interpreted.py", case, d)


def processed_case(seed: int, B: int = 16, screen: str = "fp16") -> dict:
    """Rows with min-p (0.02 to 0.9), temperature 0.3 to 2 (two greedy rows with processors), and
    vLLM's V2 processors aimed at each row's likely winners: a bias of -8 or +3 on one of its top tokens, allowed ids without
    its top token, stop tokens (min_tokens) or bad words on its top tokens, repetition /
    frequency / presence penalties on outputs holding them; some rows plain."""
    g = torch.Generator().manual_seed(seed)
    W, gw = peaked_head(V, D, seed=seed, dtype=torch.bfloat16)
    h = torch.cat([hidden_near_rows(W, B - 4, gw, scale=1.2), torch.randn(4, D, generator=g).bfloat16()])
    top = torch.nn.functional.linear(h.float(), W.float()).topk(4, dim=1).indices.tolist()
    slots = torch.randperm(SLOTS, generator=g)[:B]
    S = SLOTS
    c = {"W": W, "h": h, "screen": screen, "SLOTS": S, "slots": slots,
         "positions": torch.randint(0, 2**20, (2 * B,), generator=g),
         "logits_indices": torch.sort(torch.randperm(2 * B, generator=g)[:B]).values,
         "input_ids": torch.randint(0, V, (2 * B,), generator=g, dtype=torch.int32),
         "temp": [1.0] * S, "min_p": [0.0] * S, "seeds": torch.randint(-2**62, 2**62, (S,), generator=g).tolist(),
         "rep": [1.0] * S, "freq": [0.0] * S, "pres": [0.0] * S, "min_tokens": [0] * S, "bias": [{} for _ in range(S)],
         "allowed": [[] for _ in range(S)], "stop": [[] for _ in range(S)], "bad": [[] for _ in range(S)],
         "prompt": [[1, 2, 3] for _ in range(S)], "output": [[] for _ in range(S)]}
    modes = []
    for r in range(B):
        s, t = int(slots[r]), top[r]
        u = torch.rand(8, generator=g).tolist()
        kind = r % 6
        c["temp"][s] = 0.0 if r % 5 == 4 and kind in (1, 2, 4) else (0.3, 0.7, 1.0, 1.3, 2.0)[r % 5]
        if kind in (0, 3):
            c["min_p"][s] = (0.02, 0.1, 0.3, 0.6, 0.9)[int(u[0] * 5)]
        if kind == 1:
            c["bias"][s] = {t[0]: -8.0, t[1 + int(u[1] * 3)]: 3.0}
            c["allowed"][s] = [x for x in range(0, V, 7) if x != t[0]][:300] if u[2] < 0.5 else []
        if kind == 2:
            c["min_tokens"][s] = 5
            c["stop"][s] = [t[0], t[2]]
            c["bad"][s] = [t[1]]
        if kind in (3, 4):
            c["rep"][s], c["freq"][s], c["pres"][s] = 1.0 + 2 * u[3], 2 * u[4], 2 * u[5]
            c["output"][s] = [t[0], t[0], t[1], int(u[6] * V)]
            c["prompt"][s] = [t[2], 5, 6]
        modes.append("min_p" if c["min_p"][s] else ("processed" if kind in (1, 2, 3, 4) else "sampling"))
    c["rows"] = torch.tensor([r for r in range(B) if r % 7 != 5])
    c["modes"] = [modes[r] for r in c["rows"].tolist()]
    return c


@pytest.mark.parametrize("seed,screen", [(0, "fp16"), (1, "int8")])
def test_resolve_v2_min_p_and_processors_draw_the_dense_tokens(tmp_path, seed, screen):
    """Rows with min-p and vLLM's V2 processors (bias, allowed ids, min_tokens stop tokens, bad
    words, penalties), certified by the hook and drawn by vLLM's own V2 pipeline (Triton's
    interpreter), give the tokens the dense logits give; a hook that ignores min-p or the
    processors is caught. (Min-p's dropped tokens left in the partial rows:
    test_sampling_gumbel_v2.py, on many more rows.)"""
    c = processed_case(seed, screen=screen)
    c["variants"] = ["ok", "no_min_p", "no_process"] if seed == 0 else ["ok"]
    out = v2_pipeline(c, tmp_path)
    dense, ok = out["dense"], out["ok"]
    assert torch.equal(ok["draw"], dense), (ok, dense)
    n = sum(ok["certified"].values())
    assert n >= 0.7 * len(c["rows"]) and {"min_p", "processed"} <= set(ok["certified"]), ok
    for bad in c["variants"][1:]:
        assert not torch.equal(out[bad]["draw"], dense), bad


def device_case(seed: int = 3) -> dict:
    """:func:`processed_case` without processors: temperature rows (hot ones too), min-p 0.3 to 0.9
    on three rows in four, a greedy row in six; for the device draw (int8 screen)."""
    c = processed_case(seed, B=24, screen="int8")
    S = c["SLOTS"]
    c.update({"rep": [1.0] * S, "freq": [0.0] * S, "pres": [0.0] * S, "min_tokens": [0] * S,
              "bias": [{} for _ in range(S)], "allowed": [[] for _ in range(S)], "stop": [[] for _ in range(S)],
              "bad": [[] for _ in range(S)], "output": [[] for _ in range(S)]})
    for r, s in enumerate(c["slots"].tolist()):
        c["temp"][s] = (1.0, 3.0, 6.0, 10.0, 0.0, 2.0)[r % 6]
        c["min_p"][s] = (0.3, 0.6, 0.9, 0.0)[r % 4]
    c["modes"] = ["min_p" if c["min_p"][s] else "sampling" for s in c["slots"][c["rows"]].tolist()]
    c["budget"] = 1.0  # (the device draw's candidate list within the budget: a block of 64 at 5% of this V)
    return c


def test_resolve_v2_draws_min_p_rows_on_the_device(tmp_path):
    """Temperature rows with min-p (0.3 to 0.9, hot temperatures) and no processor, the head's
    backend CUDA's: the hook draws them with the device draw (its Triton kernels interpreted), and
    vLLM's own V2 pipeline (temperature, ``min_p.py``, ``gumbel_sample``) then draws the dense
    tokens; the device draw told no min-p is caught (the row's Gumbel winner min-p drops)."""
    c = device_case()
    c["variants"] = ["fused", "fused_no_min_p"]
    out = v2_pipeline(c, tmp_path)
    dense, ok = out["dense"], out["fused"]
    assert torch.equal(ok["draw"], dense), (ok, dense)
    assert ok["device_rows"] == len(c["rows"]), ok
    assert sum(ok["certified"].values()) >= 0.6 * len(c["rows"]) and ok["certified"].get("min_p", 0) > 0, ok
    assert not torch.equal(out["fused_no_min_p"]["draw"], dense)


def structured_case(seed: int, screen: str, base: dict | None = None) -> dict:
    """:func:`processed_case` with a grammar on about half the deferred rows (V2's bitmask,
    ``v2_interpreted._grammar``): each forbids its row's two most likely tokens and a random half of the
    others (bit ``j`` of word ``w`` allows token ``32 w + j``), so a certificate that ignores
    it draws forbidden tokens; one row's grammar allows everything (a request in its reasoning
    phase, or whose grammar has terminated). ``base``: another case to put the grammars on."""
    c = processed_case(seed, screen=screen) if base is None else base
    g = torch.Generator().manual_seed(100 + seed)
    W, h = c["W"], c["h"]
    top = torch.nn.functional.linear(h.float(), W.float()).topk(2, dim=1).indices
    rows = c["rows"].tolist()
    masks, modes = {}, list(c["modes"])
    for i, r in enumerate(rows):
        if i % 2:
            continue
        allow = torch.rand(V, generator=g) < 0.5
        allow[top[r]] = False
        if i == 4:
            allow[:] = True
        bits = allow.view(-1, 32).long() << torch.arange(32)
        masks[r] = bits.sum(1).to(torch.int64).remainder(2**32).sub(2**32 * (bits.sum(1) >= 2**31).long()).to(torch.int32)
        modes[i] = "structured"
    c["bitmask"], c["modes"] = masks, modes
    return c


@pytest.mark.parametrize("seed,screen", [(0, "fp16"), (1, "int8")])
def test_resolve_v2_structured_rows_draw_the_dense_tokens(tmp_path, seed, screen):
    """Structured rows (V2's grammar bitmask on the head's output, the placeholders included,
    then vLLM's V2 ``Sampler.sample``), with min-p, processors and greedy
    rows among them: the hook's rows give the tokens the masked dense logits give, certified
    ones and dense ones alike (``none``: every row dense, the grammar's ``-inf`` written back);
    a certificate that ignores the grammar is caught."""
    c = structured_case(seed, screen)
    c["variants"] = ["ok", "no_mask", "none"] if seed == 0 else ["ok", "none"]
    out = v2_pipeline(c, tmp_path)
    dense, ok = out["dense"], out["ok"]
    assert torch.equal(ok["draw"], dense), (ok, dense)
    assert ok["certified"].get("structured", 0) >= 0.6 * c["modes"].count("structured"), ok
    assert torch.equal(out["none"]["draw"], dense) and not out["none"]["certified"], out["none"]
    if "no_mask" in out:
        assert not torch.equal(out["no_mask"]["draw"], dense)


def test_resolve_v2_draws_on_the_device_only_on_cuda(tmp_path, monkeypatch):
    """The device draw (:meth:`vllm_csv.gpu.step.FusedStep.draw_v2`) is taken only where the head's
    backend, bound when it was built, is CUDA's (with min-p, vLLM's processors and a grammar's mask
    as wide as the head's rows: it takes them): a CPU head keeps :func:`certify_rows_v2`; the same
    head with CUDA's backend (its fused step built here, the kernels' torch references running on
    the CPU) resolves through the device draw, and the rows it writes draw the dense tokens under
    vLLM's own kernel."""
    from vllm_csv.gpu.step import FusedStep
    from vllm_csv.head.backend import Cuda

    head, h, temps, seeds, batch = case(seed=2)
    rows = torch.tensor([0, 1, 2, 3, 4, 6, 7, 9, 10, 12, 14, 15, 17, 18, 19, 21])
    sampler = fake_sampler(temps, seeds)
    calls = []
    real = v2_sampler.draw_rows
    monkeypatch.setattr(v2_sampler, "draw_rows", lambda *a: calls.append(a[0]) or real(*a))
    assert head.fused_step() is None and v2_sampler.fused_draw_for(HeadAdapter(head), None) is None
    seen = []
    d, logits_cpu = defer(head, h, rows, seen)
    v2_sampler.resolve(sampler, d, logits_cpu, batch)
    assert not calls  # the CPU path, unchanged
    head.backend = Cuda()
    assert head.fused_step() is None and head._fused is False  # an fp16 screen: no int8 copy, not built
    head._fused = FusedStep(head)  # (what a CUDA head with the int8 screen builds on its first call)
    assert head.fused_step() is head._fused
    k = torch.ones(h.shape[0], dtype=torch.long)
    assert head._fused_for(h, k, None) is head._fused  # greedy rows: the fused greedy step
    assert head._fused_for(h, k, torch.full((h.shape[0],), 0.7)) is None  # temperature: not there
    head.config.gpu_fused = False
    assert head.fused_step() is None
    head.config.gpu_fused = True
    adapter = HeadAdapter(head)
    assert isinstance(v2_sampler.fused_draw_for(adapter, None), FusedStep)
    assert v2_sampler.fused_draw_for(adapter, torch.zeros(2, V, dtype=torch.bool)) is head._fused  # a grammar
    assert v2_sampler.fused_draw_for(adapter, torch.zeros(2, V + 1, dtype=torch.bool)) is None  # a mask wider than V
    d, logits = defer(head, h, rows, seen)
    st = v2_sampler.resolve(sampler, d, logits, batch)
    assert len(calls) == 1 and calls[0] is head._fused
    dense = head.dense_logits(h)
    got, want, cpu = draws(tmp_path, batch, temps, seeds, logits, dense, logits_cpu)
    assert torch.equal(got, want) and torch.equal(cpu, want)
    assert st.certified.get("sampling", 0) >= 0.5 * rows.numel(), st
    cert = (logits[rows] > -math.inf).sum(1) == 1  # a certified row: one finite value, its token
    assert int(cert.sum()) == st.certified.get("sampling", 0)


def test_resolve_v2_draws_structured_rows_on_the_device(tmp_path):
    """:func:`device_case` with grammars on half its deferred rows (each forbidding its row's two
    likeliest tokens and half the others), the head's backend CUDA's: every deferred row takes the
    device draw with the grammar's mask, and vLLM's V2 pipeline then draws the dense tokens of the
    masked rows; the device draw told no mask is caught (it draws forbidden tokens)."""
    c = structured_case(4, "int8", base=device_case(4))
    c["variants"] = ["fused", "fused_no_mask"]
    out = v2_pipeline(c, tmp_path)
    dense, ok = out["dense"], out["fused"]
    assert ok["device_rows"] == len(c["rows"]), ok
    assert torch.equal(ok["draw"], dense), (ok, dense)
    assert ok["certified"].get("structured", 0) >= 0.5 * c["modes"].count("structured"), ok
    assert not torch.equal(out["fused_no_mask"]["draw"], dense)


@pytest.mark.parametrize("screen", ["fp16", "int8"])
def test_resolve_v2_draws_processed_rows_on_the_device(tmp_path, screen):
    """:func:`processed_case`'s rows (min-p, vLLM's V2 processors aimed at each row's likely winners:
    a bias of -8 or +3, allowed ids without its top token, min_tokens stop tokens, bad words,
    repetition / frequency / presence penalties; greedy rows with processors), the head's backend
    CUDA's: every deferred row takes the device draw with vLLM's processors run on its bounds
    (:mod:`vllm_csv.gpu.processed`), and vLLM's V2 pipeline then draws the dense tokens; the
    device draw told no processors draws other tokens (teeth)."""
    c = processed_case(0, screen=screen)
    c["budget"] = 1.0
    c["variants"] = ["fused", "fused_no_process"]
    out = v2_pipeline(c, tmp_path)
    dense, ok = out["dense"], out["fused"]
    assert ok["device_rows"] == len(c["rows"]), ok
    assert torch.equal(ok["draw"], dense), (ok, dense)
    assert sum(ok["certified"].values()) >= 0.6 * len(c["rows"]) and ok["certified"].get("processed", 0) > 0, ok
    assert not torch.equal(out["fused_no_process"]["draw"], dense)


def test_processed_bounds_hold_every_processed_value():
    """:mod:`vllm_csv.gpu.processed` with a monotone per-token map (a bias raising a few tokens far
    above their block, a mask, a repetition-style penalty): each block's processed bound holds the
    processed value of every token of the block, and the candidates' processed intervals are the
    map of their intervals at their ids (empty slots ``-inf``)."""
    from vllm_csv.gpu.common import CAP, SUB, slot_ids
    from vllm_csv.gpu.processed import processed_block_hi, processed_candidates

    g = torch.Generator().manual_seed(9)
    B, V = 3, 1000
    nb = -(-V // SUB)
    bias = torch.zeros(B, V)
    bias[:, [7, 300, 999]] = torch.tensor([12.0, -5.0, 30.0])
    gone = torch.zeros(B, V, dtype=torch.bool)
    gone[:, 400:450] = True

    def f(x):
        y = torch.where(x > 0, x / 1.5, x * 1.5) + bias
        return y.masked_fill(gone, -math.inf)

    def process(lo, hi):
        return f(lo), f(hi)

    x = torch.randn(B, V, generator=g) * 3
    pad = torch.full((B, nb * SUB), -math.inf)
    pad[:, :V] = x
    block_hi = pad.view(B, nb, SUB).amax(2) + 0.01
    block_hi[1, 2] = math.nan
    bh = processed_block_hi(process, block_hi, V)
    pp = torch.full((B, nb * SUB), -math.inf)
    pp[:, :V] = f(x)
    fin = ~torch.isnan(bh)
    assert bool((pp.view(B, nb, SUB).amax(2) <= bh)[fin].all()) and bool(torch.isnan(bh[1, 2]))
    assert float(bh[0, 999 // SUB]) >= 30.0 - 10  # the raised token raised its block
    cand = torch.full((B, CAP), -1, dtype=torch.int32)
    cand[:, :3] = torch.tensor([0, 4, nb - 1], dtype=torch.int32)
    count = torch.full((B,), 3, dtype=torch.int32)
    ids = slot_ids(cand, count, V)
    vals = pad.gather(1, ids.clamp_min(0))
    lower, upper = vals - 0.001, vals + 0.001
    lo, hi = processed_candidates(process, cand, count, lower, upper, V)
    valid = ids >= 0
    full = torch.full((B, V), -math.inf)
    for b in range(B):
        full[b, ids[b, valid[b]]] = lower[b, valid[b]]
    want_lo = f(full)
    assert torch.equal(lo[valid], want_lo.gather(1, ids.clamp_min(0))[valid])
    assert bool((lo <= hi).all()) and bool((lo[~valid] == -math.inf).all()) and bool((hi[~valid] == -math.inf).all())


def top_case(base: dict, ks=(1, 3, 20)) -> dict:
    """``base`` with top-k ``ks`` or top-p 0.5 or 0.9 on three deferred rows in four (after
    their min-p and processors, where they have them), the greedy rows' requests untouched
    (vLLM resets top-k / top-p for greedy requests): V2 then masks the batch with vLLM's Triton
    kernels before its Gumbel draw (the batch has greedy rows and explicit seeds, so no fused
    sampler)."""
    c = dict(base)
    S = c["SLOTS"]
    Vh = c["W"].shape[0]
    c["top_k"], c["top_p"] = [Vh] * S, [1.0] * S
    modes = list(c["modes"])
    for i, r in enumerate(c["rows"].tolist()):
        s = int(c["slots"][r])
        if c["temp"][s] == 0.0 or i % 4 == 3:
            continue
        if i % 4 == 2:
            c["top_p"][s] = (0.5, 0.9)[i % 3 == 0]
            modes[i] = "top_p"
        else:
            c["top_k"][s] = ks[i % len(ks)]
            modes[i] = "top_k" if modes[i] == "sampling" else modes[i]
    c["modes"] = modes
    return c


def test_resolve_v2_top_k_top_p_rows_draw_the_dense_tokens(tmp_path):
    """Rows with a top-k or a top-p (with min-p and processors on some), certified by the hook
    where the winner is also the row's certain maximum, then masked by vLLM's Triton top-k /
    top-p kernels and drawn by its V2 pipeline (Triton's interpreter), give the dense tokens; a
    certificate told nothing of the masks is caught (it certifies a Gumbel winner the mask
    drops)."""
    c = top_case(processed_case(0, B=24))
    c["variants"] = ["ok", "no_top"]
    out = v2_pipeline(c, tmp_path)
    dense, ok = out["dense"], out["ok"]
    assert torch.equal(ok["draw"], dense), (ok, dense)
    assert ok["certified"].get("top_k", 0) + ok["certified"].get("top_p", 0) > 0, ok
    assert not torch.equal(out["no_top"]["draw"], dense)


def test_resolve_v2_certifies_top_k_rows_drawn_below_the_maximum(tmp_path):
    """Rows with a top-k alone (``k`` 6 to 50; with min-p and processors on some), whose draws
    rank 2 to 30 as well as 1 or far down: the hook certifies the draw among the tokens the mask
    surely keeps (:func:`~vllm_csv.sampling.gumbel_v2.top_k_bounds`; more rows than the
    maximum's rule alone, ``top_max_only``), and V2's pipeline with vLLM's Triton kernels
    (interpreted) draws the dense tokens from its rows."""
    c = top_case(processed_case(0, B=24), ks=(6, 20, 50))
    # hidden states along sums of 8 of the head's rows: several tokens near the top, so that
    # winners rank 2 to 30 as well as 1 or far down (where the mask drops them: not certified)
    W = c["W"].float()
    idx = torch.randint(0, W.shape[0], (c["h"].shape[0], 8), generator=torch.Generator().manual_seed(100))
    h = W[idx].sum(1)
    c["h"] = (h / h.norm(dim=1, keepdim=True) * c["h"].float().norm(dim=1, keepdim=True) * 1.2).bfloat16()
    c["variants"] = ["ok", "top_max_only"]
    out = v2_pipeline(c, tmp_path)
    dense, ok = out["dense"], out["ok"]
    assert torch.equal(ok["draw"], dense), (ok, dense)
    assert torch.equal(out["top_max_only"]["draw"], dense)
    assert sum(ok["certified"].values()) > sum(out["top_max_only"]["certified"].values()), out


def test_resolve_v2_draws_top_k_top_p_rows_on_the_device(tmp_path):
    """:func:`test_resolve_v2_top_k_top_p_rows_draw_the_dense_tokens` with the device draw (the
    head's backend CUDA's, its Triton kernels interpreted): the dense tokens; the draw told
    nothing of the masks is caught."""
    c = top_case(device_case())
    c["variants"] = ["fused", "fused_no_top"]
    out = v2_pipeline(c, tmp_path)
    dense, ok = out["fused"]["draw"], out["dense"]
    assert torch.equal(dense, ok), out["fused"]
    assert out["fused"]["device_rows"] == len(c["rows"])
    assert sum(out["fused"]["certified"].values()) > 0, out["fused"]
    assert not torch.equal(out["fused_no_top"]["draw"], ok)
