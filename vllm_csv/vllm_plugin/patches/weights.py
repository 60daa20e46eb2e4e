"""The served weights watched: after vLLM or an RLHF framework writes new weights in place, the
CSV layers build their heads again from the weights as they are. Applied by
:mod:`vllm_csv.vllm_plugin.patches` (the runners' methods at install, a model's ``load_weights``
when it is loaded and at its runner's first step)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..logits_processor import CSVLogitsProcessor


def root_model(runner):
    """The runner's model itself (``get_model()``: past a CUDA-graph or micro-batch wrapper), or
    its ``model`` attribute where ``get_model`` is missing or refuses."""
    model = getattr(runner, "model", None)
    get = getattr(runner, "get_model", None)
    try:
        return get() if callable(get) else model
    except Exception:  # (a runner whose get_model refuses: the attribute as it is)
        return model


def watch_model_loads(classes=None) -> None:
    """Wrap the runners' ``load_model`` (``classes``; default V1's and vLLM-CPU's and V2's, where
    they import): once it returns, the loaded model's ``load_weights`` is watched
    (:func:`watch_load_weights`), before vLLM's start-up calls build any head. An RLHF framework
    that loads dummy weights syncs the real ones with ``load_weights`` before the first step,
    when :func:`bind` (at the first step) has not wrapped it yet: the heads built at start-up
    then described the dummy weights."""
    if classes is None:
        classes = []
        for mod, cls in (("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
                         ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
                         ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner")):
            try:
                classes.append(getattr(__import__(mod, fromlist=[cls]), cls))
            except (ImportError, AttributeError):
                continue
    for klass in classes:
        orig = klass.__dict__.get("load_model")
        if orig is None or getattr(orig, "_csv_wrapped", False):
            continue

        def load_model(self, *a, _orig=orig, **k):
            out = _orig(self, *a, **k)
            watch_load_weights(root_model(self), lambda runner=self: invalidate_heads(runner))
            return out

        load_model._csv_wrapped = True
        klass.load_model = load_model


def invalidate_heads(runner) -> None:
    """Every CSV layer of ``runner``'s model and of its drafter's builds its head again at its
    next call (:meth:`~..logits_processor.CSVLogitsProcessor.csv_invalidate`)."""
    for root in (root_model(runner), getattr(getattr(runner, "drafter", None), "model", None)):
        invalidate_layers(root)


def invalidate_layers(root) -> None:
    """Every CSV layer under ``root`` builds its head again at its next call."""
    for m in root.modules() if isinstance(root, torch.nn.Module) else ():
        if isinstance(m, CSVLogitsProcessor):
            m.csv_invalidate()


def watch_load_weights(model, invalidate: Callable[[], None]) -> None:
    """Wrap ``model.load_weights`` (on the instance a runner or proposer serves): after each call
    (returned or raised), ``invalidate()`` (the runner's CSV layers and its drafter's,
    :func:`invalidate_heads`, or a drafter's own) builds the heads again from the weights as
    they are. RLHF frameworks sync weights by calling it themselves, in place, through
    ``collective_rpc`` / ``LLM.apply_model`` (verl, OpenRLHF, vLLM's RLHF examples), past the
    methods :func:`watch_weights` wraps; vLLM's own reloads call it too (one rebuild either way:
    a layer builds at its next call)."""
    orig = getattr(model, "load_weights", None)
    if orig is None or getattr(orig, "_csv_wrapped", False) or not isinstance(model, torch.nn.Module):
        return

    def load_weights(*a, **k):
        try:
            return orig(*a, **k)
        finally:
            invalidate()

    load_weights._csv_wrapped = True
    model.load_weights = load_weights


def watch_weights(targets=None) -> None:
    """vLLM writes new weights into the served tensors in place (``reload_weights`` of the V1 and
    V2 runners; the worker's ``update_weights`` / ``finish_weight_update``, RLHF weight sync;
    ``reset_weights``, the RL API's weight checker; ``wake_up`` after a level-2 sleep): after each
    (returned or raised), the runner's CSV heads are built again from the weights as they are
    (their screens, error models and indexes describe the old ones). ``targets``: ``[(class,
    method names)]`` (default: those, where they import). A model's own ``load_weights`` called
    from outside: :func:`watch_load_weights`."""
    if targets is None:
        targets = []
        for mod, cls, names in (("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", ("reload_weights",)),
                                ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", ("reload_weights",)),
                                ("vllm.v1.worker.gpu_worker", "Worker",
                                 ("update_weights", "finish_weight_update", "reset_weights", "wake_up"))):
            try:
                targets.append((getattr(__import__(mod, fromlist=[cls]), cls), names))
            except (ImportError, AttributeError):
                continue
    for klass, names in targets:
        for name in names:
            orig = klass.__dict__.get(name)
            if orig is None or getattr(orig, "_csv_wrapped", False):
                continue

            def wrapped(self, *a, _orig=orig, **k):
                try:
                    return _orig(self, *a, **k)
                finally:
                    invalidate_heads(getattr(self, "model_runner", self))

            wrapped._csv_wrapped = True
            setattr(klass, name, wrapped)
