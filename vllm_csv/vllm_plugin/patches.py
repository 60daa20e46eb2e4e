"""Every change this plugin makes to vLLM, in one place, applied once per process behind the
version gate (:func:`vllm_csv.vllm_plugin.register`).

1. ``EngineArgs.add_cli_args`` / ``from_cli_args``: the ``--csv-*`` flags, moved into
   ``additional_config`` (:mod:`.cli_args`);
2. the model runners' step methods: V1 ``GPUModelRunner.execute_model`` (also vLLM-CPU's) and
   V2 ``GPUModelRunner.execute_model`` / ``sample``: each opens the runner's
   :class:`~.step.Step` with its plan (:mod:`.step`, :mod:`.plan`); V1's speculative
   drafters' ``SpecDecodeBaseProposer._greedy_sample`` opens one on the proposer's own channel
   (:mod:`.v1.spec`);
3. the samplers: V1 ``Sampler.forward``, V2 ``Sampler.__call__`` and V2
   ``RejectionSampler.__call__`` resolve the step's deferred rows before vLLM's own code
   (:mod:`.v1.sampler`, :mod:`.v2.sampler`, :mod:`.v2.verify`), V1 ``RejectionSampler.forward``
   verifies greedy drafts on the head's certified tokens (:mod:`.v1.spec`), and vLLM-CPU's
   ``apply_top_k_top_p`` runs on the rows that need it during such a draw (:mod:`.v1.masks`);
4. ``LogitsProcessor.register_oot``: the CSV layer (:mod:`.logits_processor`), which turns
   itself back into vLLM's class whenever CSV is off.

Each patch marks what it wrapped (``_csv_wrapped``), so a second :func:`install` is a no-op;
each optional vLLM module (the V2 runner) is skipped where it does not import.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol

import torch

from ..errors import CSVError
from ..fp import same_bits
from . import v1, v2
from .logits_processor import CSVLogitsProcessor
from .step import LazyPlan, StepChannel, over_mask_tokens, suppressed_tokens


class Integration(Protocol):
    """What a runner generation (:mod:`.v1`, :mod:`.v2`) offers the patches."""

    # -> Plan | None; ``step``: what the runner's step knows (V1: ``spec_tokens``; V2: ``input_batch``)
    def build_plan(self, runner, max_topk: int, req_ids=None, **step): ...

    def certifiable_sampler(self, sampler) -> bool: ...

    def sample(self, orig, sampler, logits, *args, **kwargs): ...


def install(max_topk: Callable[[object], int]) -> None:
    """Apply every patch (idempotent). ``max_topk(runner)`` gives the runner's ``--csv-max-topk``."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from vllm.model_executor import custom_op

    other = custom_op.op_registry_oot.get(LogitsProcessor.__name__)
    if other is not None and other is not CSVLogitsProcessor:  # (vLLM asserts on a second registration)
        from vllm.logger import init_logger

        init_logger("vllm.csv_decode").warning(
            "CSV-Decode is not installed: another plugin already replaces vLLM's LogitsProcessor (%s.%s); "
            "vLLM allows one.", other.__module__, other.__qualname__)
        return
    _engine_args()
    install_runners(max_topk)
    install_samplers()
    if other is None:
        LogitsProcessor.register_oot(CSVLogitsProcessor)
        _yield_to_later_plugins()


def _yield_to_later_plugins() -> None:
    """A plugin loaded after this one that registers its own ``LogitsProcessor`` replaces CSV's
    (one warning) instead of failing vLLM's duplicate-name assert, which stopped every process,
    CSV on or off: ``PluggableLayer.register_oot`` drops CSV's entry first."""
    from vllm.model_executor import custom_op

    base = custom_op.PluggableLayer
    orig = base.__dict__["register_oot"]
    if getattr(orig, "_csv_wrapped", False):
        return

    def register_oot(cls, _decorated_layer_cls=None, name: str | None = None):
        reg = name if name is not None else cls.__name__
        if custom_op.op_registry_oot.get(reg) is CSVLogitsProcessor and _decorated_layer_cls is not CSVLogitsProcessor:
            del custom_op.op_registry_oot[reg]
            from vllm.logger import init_logger

            init_logger("vllm.csv_decode").warning(
                "CSV-Decode is off: another plugin replaces vLLM's LogitsProcessor (vLLM allows one).")
        return orig.__func__(cls, _decorated_layer_cls, name)

    wrapped = classmethod(register_oot)
    register_oot._csv_wrapped = True
    wrapped._csv_wrapped = True  # (read on the classmethod object in the class's __dict__)
    base.register_oot = wrapped


def bind(runner) -> StepChannel:
    """The runner's channel, bound to the CSV layers of its model and to its sampler (once; again
    if the runner's model object changed)."""
    channel = runner.__dict__.get("_csv_channel")
    if channel is None:
        channel = runner._csv_channel = StepChannel()
    model = getattr(runner, "model", None)
    if model is not None and channel.model is not model:
        root = _root_model(runner)
        _bind_layers(root, channel)
        channel.forget_model()  # (another model: its first call shows what it does to the logits)
        watch_logits(model, channel, type(root).__name__)
        watch_load_weights(root, lambda: invalidate_heads(runner))  # (its drafter's too: EAGLE shares the head)
        channel.model = model
    sampler = getattr(runner, "sampler", None)
    if sampler is not None and sampler.__dict__.get("csv_channel") is not channel:  # (per step: skip
        sampler.csv_channel = channel  # nn.Module.__setattr__ unless the runner's sampler is new)
        from vllm.v1.sample.sampler import Sampler

        # V1's sampler hook certifies deferred rows over the -inf a model writes on them
        # (StepChannel.suppressed); V2's does not: its rows other than greedy ones are then dense
        channel.masks_ok = isinstance(sampler, Sampler)
    return channel


def _root_model(runner):
    """The runner's model itself (``get_model()``: past a CUDA-graph or micro-batch wrapper), or
    its ``model`` attribute where ``get_model`` is missing or refuses."""
    model = getattr(runner, "model", None)
    get = getattr(runner, "get_model", None)
    try:
        return get() if callable(get) else model
    except Exception:  # (a runner whose get_model refuses: the attribute as it is)
        return model


def bind_drafter(proposer) -> StepChannel:
    """A speculative proposer's own channel, bound to the CSV layers of its drafter model (once;
    again if its model object changed). A layer already bound to another channel (a module the
    drafter shares with the target model) is left to that channel: its calls from the drafter
    then find no plan (the target's is closed when its step method returns) and stay dense."""
    channel = proposer.__dict__.get("_csv_channel")
    if channel is None:
        channel = proposer._csv_channel = StepChannel()
        channel.drafter = True
    model = getattr(proposer, "model", None)
    if model is not None and channel.model is not model:
        _bind_layers(model, channel, keep_bound=True)
        channel.forget_model()
        watch_logits(model, channel, type(model).__name__)
        watch_load_weights(model, lambda: _invalidate(model))
        channel.model = model
    return channel


def _bind_layers(root, channel: StepChannel, keep_bound: bool = False) -> None:
    """Every CSV layer under ``root`` to ``channel`` (``keep_bound``: not one bound elsewhere)."""
    for m in root.modules() if isinstance(root, torch.nn.Module) else ():
        if isinstance(m, CSVLogitsProcessor):
            if keep_bound and m.__dict__.get("csv_channel") not in (None, channel):
                continue
            m.csv_channel = channel


def watch_logits(model, channel: StepChannel, name: str) -> None:
    """Wrap ``model.compute_logits`` (on the instance the runner or proposer calls) so that a model
    which changes the head's logits after the head (:class:`~.step.Returned`) gets the dense head.

    The channel's first call that reaches the layer runs dense and the layer keeps a copy of
    its output: a model that returns another tensor, or the same one with other bits, changes
    them (one warning; no plan for this channel again). Every later call checks the identity
    alone (a copy and a comparison of ``[B, V]`` once per runner, then nothing: vLLM runs its
    steps in inference mode, where a tensor's in-place writes leave no version counter to
    compare): a call that returns another tensor than the layer's, with rows the head certified
    or deferred, is made again dense (its hand-off dropped), so that step's tokens are vLLM's
    too. ``name``: the model's class, for the warning. The first call's comparison reads the
    result on the host once (a device sync, once per runner).

    A model whose change is only to set the same tokens to ``-inf`` on every row, in place
    (:func:`~.step.suppressed_tokens`: Gemma 4's ``suppress_tokens``, Moondream 3's answer
    token), keeps CSV: its tokens become :attr:`~.step.StepChannel.suppressed`; greedy and draft
    rows are certified in the head over the other tokens (:meth:`~.plan.Plan.over_mask`; each
    call here then checks, on those rows, that the model set at least those tokens to ``-inf``
    and not the rows' own, else makes the call again dense: :func:`~.step.over_mask_tokens`),
    and every other row goes to the sampler where it certifies rows over such masks
    (``channel.masks_ok``, V1's), which reads the tokens off the placeholders as it reads a
    grammar's (and checks, every step, that the model wrote exactly those:
    :func:`~.fill.suppression_holds`), else is dense."""
    orig = getattr(model, "compute_logits", None)
    if orig is None or getattr(orig, "_csv_channel", None) is channel:
        return

    def compute_logits(*args, **kwargs):
        step = channel.step
        first = not channel.logits_checked
        if first:
            step.plan, step.snapshot = None, True  # (this call dense: its bits show what the model does)
        step.returned, step.over_mask = None, None
        try:
            out = orig(*args, **kwargs)
        finally:
            step.snapshot = False
        r, step.returned = step.returned, None
        if r is None:  # (the layer was not called: nothing to compare)
            return out
        if first and r.logits.dim() == 2 and not r.logits.shape[0]:
            return out  # (a call with no row shows nothing: the next call is the first again)
        if first:
            channel.logits_checked = True
        if out is r.logits and (r.copy is None or same_bits(out, r.copy)):
            over, step.over_mask = step.over_mask, None
            if over is None or over_mask_tokens(out, over[0], step.suppressed_ids, over[1]) is not None:
                return out  # (a Top1 hand-off the layer left holds: the check passed)
            if not channel.warned_over_mask:
                channel.warned_over_mask = True
                from vllm.logger import init_logger

                init_logger("vllm.csv_decode").warning(
                    "CSV-Decode: %s.compute_logits suppressed other tokens than its first call did (a "
                    "row's certified token, or not every token seen then); such a step is made again "
                    "without CSV.", name)
            step.plan = step.handoff = None
            return orig(*args, **kwargs)  # (no plan: the layer computes vLLM's logits, the model masks them)
        if first and out is r.logits:
            tokens = suppressed_tokens(r.copy, out)
            if tokens is not None:
                channel.suppressed, channel.suppressed_ids = tokens, tokens.nonzero().squeeze(1)
                from vllm.logger import init_logger

                init_logger("vllm.csv_decode").info(
                    "CSV-Decode: %s.compute_logits sets %d tokens to -inf after the head; greedy rows are "
                    "certified in the head over the other tokens, the others in the sampler.", name,
                    channel.suppressed_ids.numel())
                return out
        if channel.post_processing is None:
            channel.post_processing = name
            from vllm.logger import init_logger

            init_logger("vllm.csv_decode").warning(
                "CSV-Decode is off for this model: %s.compute_logits changes the head's logits after the head "
                "(suppressed tokens, a scale, a soft-cap or a vocabulary map the certificate does not cover); "
                "using the dense head.", name)
        if not r.csv:
            return out
        step.plan = step.handoff = None
        return orig(*args, **kwargs)  # (no plan: the layer computes vLLM's logits)

    compute_logits._csv_channel = channel
    model.compute_logits = compute_logits


def _engine_args() -> None:
    """Wrap ``EngineArgs.add_cli_args`` / ``from_cli_args`` (:mod:`.cli_args`)."""
    from vllm.engine.arg_utils import EngineArgs

    from .cli_args import add_csv_args, apply_csv_args, check_index_file
    from .config import from_additional_config

    if getattr(EngineArgs, "_csv_wrapped", False):
        return
    orig_add = EngineArgs.add_cli_args
    orig_from = EngineArgs.from_cli_args.__func__

    def add_cli_args(parser, *a, **k):
        parser = orig_add(parser, *a, **k)
        if not any("--enable-csv-decode" in act.option_strings for act in parser._actions):
            add_csv_args(parser)
        return parser

    def from_cli_args(cls, args):
        engine_args = orig_from(cls, args)
        try:
            engine_args.additional_config = apply_csv_args(args, engine_args.additional_config)
            check_index_file(from_additional_config(engine_args.additional_config),
                             getattr(engine_args, "tensor_parallel_size", 1))
        except CSVError as e:
            print(f"vllm serve: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        if from_additional_config(engine_args.additional_config).enabled:
            from ..metrics import ensure_multiprocess_dir

            ensure_multiprocess_dir()  # before the engine processes start: they inherit it
        return engine_args

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs._csv_wrapped = True


def install_runners(max_topk: Callable[[object], int]) -> None:
    """The V1 and V2 runners' step methods and V1's drafters' (each where it imports), and the
    methods that change their weights in place (:func:`watch_weights`, :func:`watch_model_loads`)."""
    _v1_runner(max_topk)
    _v1_drafter()
    _v2_runner(max_topk)
    watch_weights()
    watch_model_loads()


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
            watch_load_weights(_root_model(self), lambda runner=self: invalidate_heads(runner))
            return out

        load_model._csv_wrapped = True
        klass.load_model = load_model


def invalidate_heads(runner) -> None:
    """Every CSV layer of ``runner``'s model and of its drafter's builds its head again at its
    next call (:meth:`~.logits_processor.CSVLogitsProcessor.csv_invalidate`)."""
    for root in (_root_model(runner), getattr(getattr(runner, "drafter", None), "model", None)):
        _invalidate(root)


def _invalidate(root) -> None:
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


def _v1_runner(max_topk) -> None:
    """V1 ``execute_model`` opens the step; its plan is built lazily (at the logits call), so that
    it sees the batch ``execute_model`` updates first, and closed when the method returns; the
    hand-off for ``sample_tokens``' sampler call stays on the step."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return
    if getattr(GPUModelRunner, "_csv_wrapped", False):
        return
    orig = GPUModelRunner.execute_model

    def execute_model(self, scheduler_output, *a, **k):
        channel = bind(self)
        # (speculative decoding: the draft tokens each request's rows verify, v1.spec)
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
        channel.open(LazyPlan(self, v1.build_plan, max_topk(self), spec_tokens=spec))
        try:
            return orig(self, scheduler_output, *a, **k)
        finally:
            channel.close_plan()

    GPUModelRunner.execute_model = execute_model
    GPUModelRunner._csv_wrapped = True


def _v1_drafter() -> None:
    """V1 ``SpecDecodeBaseProposer._greedy_sample`` (draft model, EAGLE, MTP: the drafter's logits and
    their argmax) opens a step on the proposer's channel with every row planned ``k = 1``
    (:mod:`.v1.spec`), closed when it returns."""
    try:
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    except ImportError:
        return
    if getattr(SpecDecodeBaseProposer, "_csv_wrapped", False) or not hasattr(SpecDecodeBaseProposer, "_greedy_sample"):
        return
    from .v1 import spec

    orig = SpecDecodeBaseProposer._greedy_sample

    def _greedy_sample(self, hidden_states, *a, **k):
        if a or k or not spec.certifiable_draft(self, hidden_states):
            return orig(self, hidden_states, *a, **k)
        step = bind_drafter(self).open(spec.draft_plan(self, hidden_states.shape[0]))
        try:
            # orig's body where certifiable_draft holds (vLLM 0.32.0 and 0.33.0, the same source:
            # tests/test_vllm033.py): compute_logits(hidden_states).argmax(dim=-1)
            return spec.draft_tokens(step, self.model.compute_logits(hidden_states))
        finally:
            step.plan = step.handoff = None  # (nothing outlives the call)

    SpecDecodeBaseProposer._greedy_sample = _greedy_sample
    SpecDecodeBaseProposer._csv_wrapped = True


def _v2_runner(max_topk) -> None:
    """V2 ``execute_model`` keeps each new request's sampling parameters (the V2 runner keeps
    none it would hand out); V2 ``sample`` (head and sampler together) opens the step."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    except ImportError:
        return
    if getattr(V2Runner, "_csv_wrapped", False):
        return
    orig_exec, orig_sample = V2Runner.execute_model, V2Runner.sample

    def execute_model(self, scheduler_output, *a, **k):
        params = self.__dict__.setdefault("_csv_sampling_params", {})
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            params[new.req_id] = new.sampling_params
        rows = self.__dict__.setdefault("_csv_rows", {})  # (v2.plan.request_plan's rows)
        for rid in getattr(scheduler_output, "finished_req_ids", ()) or ():
            params.pop(rid, None)
            rows.pop(rid, None)
        return orig_exec(self, scheduler_output, *a, **k)

    def sample(self, hidden_states, input_batch, grammar_output, *a, **k):
        plan = v2.build_plan(self, max_topk(self), input_batch=input_batch)
        channel = bind(self)
        step = channel.open(plan)
        try:
            return orig_sample(self, hidden_states, input_batch, grammar_output, *a, **k)
        finally:
            # a hand-off no sampler call took (none expected) must not reach the next step
            step.plan = step.handoff = None

    V2Runner.execute_model = execute_model
    V2Runner.sample = sample
    V2Runner._csv_wrapped = True


def install_samplers() -> None:
    """V1 ``Sampler.forward`` and ``RejectionSampler.forward``, V2 ``Sampler.__call__`` and V2
    ``RejectionSampler.__call__`` take the step's hand-off first; vLLM-CPU's ``apply_top_k_top_p``
    (read from its module at each ``forward_cpu`` call) runs on the rows that need it during a draw
    with certified rows."""
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from .v1 import spec
    from .v1.masks import masks_on_rows

    if not getattr(RejectionSampler, "_csv_wrapped", False):
        orig_verify = RejectionSampler.forward

        def verify(self, metadata, draft_probs, logits, sampling_metadata):
            return spec.verify(orig_verify, self, metadata, draft_probs, logits, sampling_metadata)

        RejectionSampler.forward = verify
        RejectionSampler._csv_wrapped = True
    if not getattr(Sampler, "_csv_wrapped", False):
        orig = Sampler.forward

        def forward(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
            return v1.sample(orig, self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override)

        Sampler.forward = forward
        Sampler._csv_wrapped = True
    if not getattr(topk_topp_sampler.apply_top_k_top_p, "_csv_wrapped", False):
        topk_topp_sampler.apply_top_k_top_p = masks_on_rows(topk_topp_sampler.apply_top_k_top_p)
    try:
        from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler
    except ImportError:
        return
    _wrap_call(V2Sampler, v2.sample)
    try:
        from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler as V2RejectionSampler
    except ImportError:
        return
    from .v2.verify import verify

    _wrap_call(V2RejectionSampler, verify)


def _wrap_call(cls, hook) -> None:
    """``cls.__call__(self, logits, input_batch, ...)`` through ``hook(orig, self, logits,
    input_batch, ...)`` (once: marked ``_csv_wrapped``)."""
    if getattr(cls, "_csv_wrapped", False):
        return
    orig = cls.__call__

    def call(self, logits, input_batch, *a, **k):
        return hook(orig, self, logits, input_batch, *a, **k)

    cls.__call__ = call
    cls._csv_wrapped = True
