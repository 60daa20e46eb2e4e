"""What the CSV layer's head is built from, and when it is built again (``logits_processor``:
``_head_for``, ``csv_invalidate``; ``patches.watch_weights``). Found by review, each with a
reproducer that certified tokens vLLM does not serve:

* a bias vLLM does not add: PhiMoE and Moondream 3 build ``ParallelLMHead(bias=True)`` and pass
  no ``embedding_bias``; vLLM's head adds ``embedding_bias`` alone, the plugin added ``lm_head.bias``;
* one layer called with several heads (DeepSeek and Bailing MTP drafters, Medusa): every head
  was certified with the first one's screen;
* weights written in place after the head was built (``reload_weights``, RLHF
  ``update_weights``, ``wake_up``; later, ``reset_weights`` and a model's own ``load_weights``
  called by an RLHF framework): the screen described the old weights;
* a quantized head stopped the server at warm-up instead of keeping vLLM's layer.

The layer is built by its own constructor (as vLLM builds it, CSV on) around a head module with
vLLM's ``UnquantizedEmbeddingMethod``; "vLLM's tokens" are vLLM's own ``LogitsProcessor.forward``
on the same head."""

from __future__ import annotations

import importlib.metadata
import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
import vllm.config  # noqa: E402
from vllm.model_executor.layers.logits_processor import LogitsProcessor  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod  # noqa: E402

from vllm_csv.errors import CSVError  # noqa: E402
from vllm_csv.vllm_plugin import patches, step as csv_step  # noqa: E402
from vllm_csv.vllm_plugin.logits_processor import CSVLogitsProcessor  # noqa: E402
from vllm_csv.vllm_plugin.plan import Plan  # noqa: E402

V, D, B = 4096, 256, 4


def _layer(monkeypatch, **csv) -> CSVLogitsProcessor:
    """The plugin's layer from its own constructor, CSV on (no plugin installed); ``csv``: more of
    its configuration (``--csv-*``)."""
    mc = SimpleNamespace(logits_processors=None, dtype=torch.bfloat16, served_model_name="m", model="m")
    vc = SimpleNamespace(additional_config={"csv_decode": {"enabled": True, "off_switch": False, **csv}},
                         model_config=mc)
    orig_ep = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [] if group == "vllm.logits_processors" else orig_ep(group=group))
    with vllm.config.set_current_vllm_config(vllm.config.VllmConfig()):
        with monkeypatch.context() as m:
            m.setattr(vllm.config, "get_current_vllm_config", lambda: vc)
            layer = CSVLogitsProcessor(V)
    assert type(layer) is CSVLogitsProcessor
    return layer


def _lm_head(weight, bias=None, quant_method=None):
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        m.bias = torch.nn.Parameter(bias, requires_grad=False)
    m.quant_method = quant_method or UnquantizedEmbeddingMethod()
    m.tp_size = 1
    if quant_method is None:
        m.quant_method.process_weights_after_loading(m)  # (vLLM's CPU GEMM dispatch)
    return m


def _weight(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, D, generator=g) * 0.05).bfloat16()


H = (torch.randn(B, D, generator=torch.Generator().manual_seed(9))).bfloat16()


def _tokens(layer, lm_head, bias=None):
    """One greedy step through the layer (every row planned ``k = 1``): its tokens, the step's
    hand-off, and vLLM's own layer's tokens on the same head."""
    channel = csv_step.StepChannel()
    layer.csv_channel = channel
    channel.open(Plan([str(i) for i in range(B)], [1] * B, ["greedy"] * B, [0.0] * B))
    with torch.inference_mode():
        got = layer(lm_head, H, bias).float().argmax(-1)
        want = LogitsProcessor.forward(layer, lm_head, H, bias).float().argmax(-1)
    return got, channel.step.handoff, want


def test_a_head_bias_vllm_does_not_add_is_not_bounded(monkeypatch):
    b = torch.zeros(V).bfloat16()
    b[11] = 8.0  # (it would decide every row's argmax)
    layer, head = _layer(monkeypatch), _lm_head(_weight(0), b)
    _tokens(layer, head)  # (the first call builds the head)
    got, handoff, want = _tokens(layer, head)
    assert torch.equal(got, want) and (want != 11).all()
    assert isinstance(handoff, csv_step.Top1) and layer.csv_head.bias is None


def test_another_head_on_the_same_layer_is_dense(monkeypatch, caplog):
    layer, h1, h2 = _layer(monkeypatch), _lm_head(_weight(0)), _lm_head(_weight(1))
    _tokens(layer, h1)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            got, handoff, want = _tokens(layer, h2)
            assert torch.equal(got, want) and handoff is None
        got, handoff, want = _tokens(layer, h1)  # the head it was built for: certified
    assert torch.equal(got, want) and isinstance(handoff, csv_step.Top1)
    assert caplog.text.count("called with another head or bias") == 1


class Fp8LinearMethod:  # (a quantized head's method, by its name as vLLM's are)
    def apply(self, layer, x, bias=None):
        return x.float() @ layer.weight.float().t()


def test_a_quantized_head_keeps_vllms_layer(monkeypatch, caplog):
    layer = _layer(monkeypatch)
    head = _lm_head(_weight(0), quant_method=Fp8LinearMethod())
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            got, handoff, want = _tokens(layer, head)
            assert torch.equal(got, want) and handoff is None
    assert layer.csv_head is None and "a quantized LM head (Fp8LinearMethod)" in caplog.text


def test_an_added_vocabulary_under_tp_keeps_vllms_layer():
    """Rows past the vocabulary in a vocabulary-sharded head (LoRA extra tokens, PLaMo 3's head
    rounded up to a multiple of 16): the shard layout the sharded head needs does not hold, so
    every rank keeps vLLM's layer (before: an error at start-up where vLLM serves)."""
    from vllm_csv.vllm_plugin.head_builder import unsupported_head

    head = _lm_head(_weight(0))
    head.num_added_embeddings = 16
    assert unsupported_head(head) is None  # (one rank: the vocabulary's rows are sliced)
    head.tp_size = 2
    assert "an added vocabulary" in unsupported_head(head)
    head.num_added_embeddings = 0
    assert unsupported_head(head) is None


@pytest.mark.parametrize("invalidate", [True, False])
def test_weights_written_in_place_build_the_head_again(invalidate, monkeypatch):
    """``reload_weights`` / ``update_weights`` copy new weights into the same tensors: after
    :func:`patches.invalidate_heads` the next call certifies on them; without it (the mutation)
    the old screen certifies the old argmax."""
    layer, head = _layer(monkeypatch), _lm_head(_weight(0))
    _tokens(layer, head)
    runner = SimpleNamespace(model=torch.nn.Sequential(layer))
    new = head.weight.detach().clone()
    s = H.float().sum(0)
    new[7] = (s / s.norm() * 3.0).bfloat16()  # (token 7 wins every row after the update; the screen's old row 7 loses)
    head.weight.data.copy_(new)
    head.quant_method.process_weights_after_loading(head)  # (as vLLM's reload does: its CPU GEMM's packing)
    if invalidate:
        patches.invalidate_heads(runner)
    got, handoff, want = _tokens(layer, head)
    assert (want == 7).all()
    if invalidate:
        assert torch.equal(got, want) and isinstance(handoff, csv_step.Top1)
    else:
        assert not torch.equal(got, want)


class _Model(torch.nn.Module):
    """A served model: the CSV layer, its LM head, and vLLM's ``load_weights`` (copies in place)."""

    def __init__(self, layer, lm_head):
        super().__init__()
        self.logits_processor, self.lm_head = layer, lm_head

    def compute_logits(self, hidden):
        return self.logits_processor(self.lm_head, hidden)

    def load_weights(self, weights):
        for name, w in weights:
            self.get_parameter(name).data.copy_(w)
        self.lm_head.quant_method.process_weights_after_loading(self.lm_head)
        return {name for name, _ in weights}


@pytest.mark.parametrize("watched", [True, False])
def test_a_models_own_load_weights_builds_the_head_again(watched, monkeypatch):
    """RLHF weight sync (verl, OpenRLHF, vLLM's RLHF examples) calls the served model's own
    ``load_weights`` through ``collective_rpc`` / ``apply_model``, in place, past the runner's and
    worker's methods: the bound model's ``load_weights`` is wrapped (``patches.bind``), so the next
    step certifies on the new weights; without the wrap (the mutation: found by review) the old
    screen certified the old argmax."""
    layer, head = _layer(monkeypatch), _lm_head(_weight(0))
    model = _Model(layer, head)
    drafter = _Model(_layer(monkeypatch), head)  # (EAGLE: a drafter sharing the target's LM head)
    if not watched:
        monkeypatch.setattr(patches.binding, "watch_load_weights", lambda model, invalidate: None)
    patches.bind(SimpleNamespace(model=model, drafter=SimpleNamespace(model=drafter)))
    _tokens(layer, head)
    _tokens(drafter.logits_processor, head)
    new = head.weight.detach().clone()
    s = H.float().sum(0)
    new[7] = (s / s.norm() * 3.0).bfloat16()  # (token 7 wins every row after the update)
    assert model.load_weights([("lm_head.weight", new)]) == {"lm_head.weight"}
    got, handoff, want = _tokens(layer, head)
    drafted = _tokens(drafter.logits_processor, head)[0]  # (the drafter's layer, invalidated too)
    assert (want == 7).all()
    if watched:
        assert torch.equal(got, want) and isinstance(handoff, csv_step.Top1) and torch.equal(drafted, want)
        patches.bind(SimpleNamespace(model=model))  # (another runner binding it: wrapped once)
        assert getattr(model.load_weights, "_csv_wrapped", False)
    else:
        assert not torch.equal(got, want) and not torch.equal(drafted, want)


def test_weights_synced_before_the_first_step_build_the_head_again(monkeypatch):
    """An RLHF framework loads dummy weights and syncs the real ones with the model's
    ``load_weights`` before the first step: the head vLLM's start-up calls built must be built
    again (found by review: the wrap came with the first step's ``bind``, too late). The runner's
    ``load_model`` wraps it (``patches.watch_model_loads``)."""
    layer, head = _layer(monkeypatch), _lm_head(_weight(0))

    class Runner:
        def load_model(self):
            self.model = _Model(layer, head)

    patches.watch_model_loads([Runner])
    patches.watch_model_loads([Runner])  # (once)
    runner = Runner()
    runner.load_model()
    _tokens(layer, head)  # (start-up: the head built on the dummy weights)
    new = head.weight.detach().clone()
    s = H.float().sum(0)
    new[7] = (s / s.norm() * 3.0).bfloat16()
    runner.model.load_weights([("lm_head.weight", new)])  # (before any step: no bind yet)
    got, handoff, want = _tokens(layer, head)
    assert (want == 7).all() and torch.equal(got, want)
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patches.watch_model_loads()
    assert getattr(GPUModelRunner.load_model, "_csv_wrapped", False)
    assert getattr(CPUModelRunner.__dict__["load_model"], "_csv_wrapped", False)


def test_the_weight_changing_methods_invalidate_even_when_they_fail(monkeypatch):
    calls = []

    class Runner:
        def reload_weights(self, fail=False):
            calls.append("reload")
            if fail:
                raise RuntimeError("load failed")

    monkeypatch.setattr(patches.weights, "invalidate_heads", lambda runner: calls.append(("invalidate", runner)))
    patches.watch_weights([(Runner, ("reload_weights",))])
    r = Runner()
    r.reload_weights()
    with pytest.raises(RuntimeError):
        r.reload_weights(fail=True)
    assert calls == ["reload", ("invalidate", r), "reload", ("invalidate", r)]
    patches.watch_weights([(Runner, ("reload_weights",))])  # (once)
    r.reload_weights()
    assert calls.count("reload") == 3 and len(calls) == 6
    patches.watch_weights()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    assert all(getattr(getattr(Worker, n), "_csv_wrapped", False)
               for n in ("update_weights", "finish_weight_update", "reset_weights", "wake_up"))
    assert getattr(GPUModelRunner.reload_weights, "_csv_wrapped", False)


def test_a_rebuild_the_index_refuses_switches_the_layer_off(monkeypatch, caplog):
    layer, head = _layer(monkeypatch), _lm_head(_weight(0))
    _tokens(layer, head)
    layer.csv_invalidate()

    def refuse(*a):
        raise CSVError("the index file's fingerprint does not match the weights")

    monkeypatch.setattr(layer, "_get_head", refuse)
    with caplog.at_level(logging.WARNING):
        got, handoff, want = _tokens(layer, head)
    assert torch.equal(got, want) and handoff is None and "could not be built again" in caplog.text


@pytest.mark.parametrize("case", ["target_index", "fp16_refuses"])
def test_a_drafters_head_that_cannot_be_built_keeps_the_drafter_dense(case, tmp_path, monkeypatch, caplog):
    """A drafter's layer (a draft model's or EAGLE's own head: ``bind_drafter``) builds its head at
    its first proposal, mid-serving (vLLM never calls it at start-up). ``--csv-index`` (the
    target's head's file) is not read for it (the cache serves it); a head its screen refuses
    (fp16 rows too large) keeps the drafter dense, one warning. Before (found by review), both
    raised and stopped the engine. The same failure on a target's layer (its first call is at
    start-up) still stops the server with the message."""
    from vllm_csv.index import build_index

    monkeypatch.setenv("VLLM_CSV_CACHE", str(tmp_path / "cache"))
    target_w, draft_w = _weight(0), _weight(1)
    if case == "target_index":
        csv = {"screen": "int8", "index": str(build_index(target_w.float(), None, 16, progress=False)
                                              .save(tmp_path / "target.safetensors"))}
    else:
        csv, draft_w = {"screen": "fp16"}, (draft_w.float() * 8000).bfloat16()
    target = _layer(monkeypatch, **csv)
    _tokens(target, _lm_head(target_w))  # (the target's head, with the given index where there is one)
    assert target.csv_head is not None
    drafter = _layer(monkeypatch, **csv)
    model = _Model(drafter, _lm_head(draft_w))
    channel = patches.bind_drafter(SimpleNamespace(model=model))
    assert channel.drafter
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        got = model.compute_logits(H)
        want = LogitsProcessor.forward(drafter, model.lm_head, H)
    assert torch.equal(got, want)
    if case == "target_index":  # (the drafter's head built without the target's file: CSV on)
        assert drafter.csv_head is not None and drafter._csv_off is None
    else:
        assert drafter.csv_head is None and "drafter's head could not be built" in caplog.text
    with pytest.raises(CSVError):  # (a target's layer: the start-up stop, with the reason)
        with torch.inference_mode():
            _layer(monkeypatch, **csv)(_lm_head(draft_w), H)
