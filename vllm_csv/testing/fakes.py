"""vLLM pieces built without vLLM's engine config, as a step leaves them: vLLM's CPU logits
processors (min-p, logit bias), the plugin's LM-head layer, the hand-off a layer leaves its
sampler (and a ledger that keeps the sampler's account), and a clock that advances only when told
to."""

from __future__ import annotations

import torch

from ..vllm_plugin.step import DeferredStats, Handoff, Step, StepAccount, StepChannel


class FakeClock:
    """The steps' clocks (:func:`vllm_csv.clock.now`, :func:`~vllm_csv.clock.wall`) for the
    plugin's modules: they advance only by the simulated costs (``clock.now += seconds``);
    :meth:`install` puts them in place."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def install(self, monkeypatch) -> "FakeClock":
        from .. import clock

        monkeypatch.setattr(clock, "now", self.perf_counter)
        monkeypatch.setattr(clock, "wall", self.perf_counter)
        return self


def csv_layer(head, metrics=None):
    """The plugin's LM-head layer (``CSVLogitsProcessor``) around ``head``, built without vLLM's
    constructor (no vLLM config), as its first ``forward`` leaves it."""
    from ..vllm_plugin.logits_processor import CSVLogitsProcessor

    return CSVLogitsProcessor.around(head, metrics)


def min_p_processor(values):
    """vLLM's ``MinPLogitsProcessor`` as ``update_state`` leaves it on the CPU, for ``values``
    (``[B]``, a tensor or a list; 0: no min-p)."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    p = MinPLogitsProcessor.__new__(MinPLogitsProcessor)
    p.min_p_cpu_tensor = torch.as_tensor(values, dtype=torch.float32)
    p.min_p_cpu = p.min_p_cpu_tensor.numpy()
    p.min_p_count = int((p.min_p_cpu_tensor > 0).sum())
    p.use_double_tensor = False
    p.min_p_device = p.min_p_cpu_tensor
    p.min_p = p.min_p_device.unsqueeze(1)
    return p


def logit_bias_processor(biases: dict[int, dict[int, float]]):
    """vLLM's ``LogitBiasLogitsProcessor`` as ``update_state`` leaves it on the CPU, for
    ``biases`` (batch row -> {token id: bias}). Its fields set here, not by its constructor
    (0.33's makes empty tensors in pinned memory, which a machine without an accelerator
    refuses: ``scripts/check_vllm033.sh`` runs the CUDA wheel's modules on the CPU)."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor

    lb = LogitBiasLogitsProcessor.__new__(LogitBiasLogitsProcessor)
    lb.device = torch.device("cpu")
    lb.biases = biases
    reqs = [r for r, d in biases.items() for _ in d]
    toks = [t for d in biases.values() for t in d]
    lb.bias_tensor = torch.tensor([v for d in biases.values() for v in d.values()], dtype=torch.float32)
    lb.logits_slice = (torch.tensor(reqs, dtype=torch.int32), torch.tensor(toks, dtype=torch.int32))
    return lb


def hand_off(consumer, handoff: Handoff | None) -> Step:
    """Leave ``handoff`` for ``consumer``'s next call (a sampler), as the plugin's layer does on its
    runner's step; a consumer no runner bound gets a channel of its own."""
    channel = getattr(consumer, "csv_channel", None)
    if channel is None:
        channel = consumer.csv_channel = StepChannel()
    channel.step.handoff = handoff
    return channel.step


class Tally:
    """A :class:`~vllm_csv.vllm_plugin.step.Ledger` that keeps what it is told, for harnesses: ``seen`` holds each settled
    step's :class:`DeferredStats` (the sampler call's time added where the account counts it),
    and ``then(stats)``, if given, is called with it."""

    def __init__(self, then=None):
        self.seen: list[DeferredStats] = []
        self._then = then

    def account(self, with_sampler: bool = False) -> StepAccount:
        return StepAccount(self, "deferred", with_sampler=with_sampler)

    def settle(self, account: StepAccount, deferred: DeferredStats | None, sampler_seconds: float) -> None:
        if deferred is not None:
            deferred.seconds += sampler_seconds
        self.seen.append(deferred)
        if self._then is not None:
            self._then(deferred)
