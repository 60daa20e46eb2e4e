"""Every change this plugin makes to vLLM, in one place, applied once per process behind the
version gate (:func:`vllm_csv.vllm_plugin.register`).

1. ``EngineArgs.add_cli_args`` / ``from_cli_args``: the ``--csv-*`` flags, moved into
   ``additional_config`` (:mod:`..cli_args`);
2. the model runners' step methods: V1 ``GPUModelRunner.execute_model`` (also vLLM-CPU's) and
   V2 ``GPUModelRunner.execute_model`` / ``sample``: each opens the runner's
   :class:`~..step.Step` with its plan (:mod:`..step`, :mod:`..plan`); V1's speculative
   drafters' ``SpecDecodeBaseProposer._greedy_sample`` opens one on the proposer's own channel
   (:mod:`..v1.spec`);
3. the samplers: V1 ``Sampler.forward``, V2 ``Sampler.__call__`` and V2
   ``RejectionSampler.__call__`` resolve the step's deferred rows before vLLM's own code
   (:mod:`..v1.sampler`, :mod:`..v2.sampler`, :mod:`..v2.verify`), V1 ``RejectionSampler.forward``
   verifies greedy drafts on the head's certified tokens (:mod:`..v1.spec`), and vLLM-CPU's
   ``apply_top_k_top_p`` runs on the rows that need it during such a draw (:mod:`..v1.masks`);
4. ``LogitsProcessor.register_oot``: the CSV layer (:mod:`..logits_processor`), which turns
   itself back into vLLM's class whenever CSV is off;
5. at a runner's (or drafter's) first step, its model's ``compute_logits`` and the layers' step
   channel (:mod:`.binding`); its model's ``load_weights`` and the methods that write new weights
   in place (:mod:`.weights`).

Each patch marks what it wrapped (``_csv_wrapped``), so a second :func:`install` is a no-op;
each optional vLLM module (the V2 runner) is skipped where it does not import.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol

from ...errors import CSVError
from .. import v1, v2
from ..logits_processor import CSVLogitsProcessor
from ..step import LazyPlan
from .binding import bind, bind_drafter, watch_logits  # noqa: F401  (watch_logits: for harnesses)
from .weights import invalidate_heads, watch_load_weights, watch_model_loads, watch_weights  # noqa: F401


class Integration(Protocol):
    """What a runner generation (:mod:`..v1`, :mod:`..v2`) offers the patches."""

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


def _engine_args() -> None:
    """Wrap ``EngineArgs.add_cli_args`` / ``from_cli_args`` (:mod:`..cli_args`)."""
    from vllm.engine.arg_utils import EngineArgs

    from ..cli_args import add_csv_args, apply_csv_args, check_index_file
    from ..config import from_additional_config

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
            from ...metrics import ensure_multiprocess_dir

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
        channel.open(LazyPlan(self, v1.build_plan, max_topk(self), batch=v1.batch_key, spec_tokens=spec))
        try:
            return orig(self, scheduler_output, *a, **k)
        finally:
            channel.close_plan()

    execute_model._csv_orig = orig  # (vLLM's own, for benchmarks/off_switch_cost.py's plugin-free rounds)
    GPUModelRunner.execute_model = execute_model
    GPUModelRunner._csv_wrapped = True


def _v1_drafter() -> None:
    """V1 ``SpecDecodeBaseProposer._greedy_sample`` (draft model, EAGLE, MTP: the drafter's logits and
    their argmax) opens a step on the proposer's channel with every row planned ``k = 1``
    (:mod:`..v1.spec`), closed when it returns."""
    try:
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    except ImportError:
        return
    if getattr(SpecDecodeBaseProposer, "_csv_wrapped", False) or not hasattr(SpecDecodeBaseProposer, "_greedy_sample"):
        return
    from ..v1 import spec

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

    from ..v1 import spec
    from ..v1.masks import masks_on_rows

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

        forward._csv_orig = orig
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
    from ..v2.verify import verify

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
