"""Test-only vLLM general plugin: poisons the LM head's input of chosen requests with NaN / inf.

Never installed and never shipped: the e2e fixtures put this directory on the server's
``PYTHONPATH``. vLLM finds general plugins through ``importlib.metadata`` entry points, and
``importlib.metadata`` reads the ``csv_test_faults-0.dist-info`` folder beside this file like
any installed distribution's, so vLLM loads ``register`` in the API server, the engine core
and the worker, as it loads vllm-csv itself.

``VLLM_CSV_TEST_FAULTS`` (JSON) says what to poison, e.g.
``{"nan": [8191, 8190], "inf": [8189, 8188], "steps": [2, 5]}``: a request whose prompt token
ids start with the ``nan`` (``inf``) marker gets its LM-head row set to NaN (``+inf``) on the
steps that produce its output tokens ``steps[0] .. steps[1] - 1`` (the middle of its run); every
other row, request and step passes through untouched (the wrapper then calls the original
method with the same arguments). Each poisoned row prints one ``csv_test_faults: poisoned``
line to the server's log. Without the variable ``register`` does nothing.
"""

from __future__ import annotations

import json
import math
import os
import threading

_local = threading.local()
_done = False


def _config() -> dict | None:
    raw = os.environ.get("VLLM_CSV_TEST_FAULTS")
    return json.loads(raw) if raw else None


def poison_rows(runner, num_rows: int, cfg: dict) -> dict[int, float]:
    """Row -> value for the marked requests of this step (rows in ``input_batch.req_ids`` order,
    one per request, as vLLM's V1 runner lays out the logits without speculative decoding)."""
    req_ids = list(runner.input_batch.req_ids)
    if len(req_ids) != num_rows:
        return {}
    lo, hi = cfg.get("steps", (2, 5))
    out = {}
    for row, rid in enumerate(req_ids):
        state = runner.requests.get(rid)
        prompt = list(getattr(state, "prompt_token_ids", None) or ())
        if state is None or not lo <= len(state.output_token_ids) < hi:
            continue
        for kind, value in (("nan", math.nan), ("inf", math.inf)):
            marker = cfg.get(kind)
            if marker and prompt[:len(marker)] == list(marker):
                out[row] = value
    return out


def _wrap_forward(cls, cfg: dict) -> None:
    orig = cls.__dict__["forward"]

    def forward(self, lm_head, hidden_states, *args, **kwargs):
        runner = getattr(_local, "runner", None)
        if runner is not None and hidden_states.dim() == 2:
            rows = poison_rows(runner, hidden_states.shape[0], cfg)
            if rows and not getattr(hidden_states, "_csv_test_poisoned", False):
                hidden_states = hidden_states.clone()
                for row, value in rows.items():
                    hidden_states[row] = value
                    print(f"csv_test_faults: poisoned row {row} with {value}", flush=True)
                hidden_states._csv_test_poisoned = True  # CSV's dense path calls vLLM's layer with it
        return orig(self, lm_head, hidden_states, *args, **kwargs)

    cls.forward = forward


def register() -> None:
    global _done
    cfg = _config()
    if _done or cfg is None:
        return
    _done = True
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_csv.vllm_plugin.logits_processor import CSVLogitsProcessor

    orig_exec = GPUModelRunner.execute_model

    def execute_model(self, *args, **kwargs):
        prev, _local.runner = getattr(_local, "runner", None), self
        try:
            return orig_exec(self, *args, **kwargs)
        finally:
            _local.runner = prev

    GPUModelRunner.execute_model = execute_model
    # vLLM's layer (dense servers, and the dense path of CSV's, which calls it) and CSV's own.
    _wrap_forward(LogitsProcessor, cfg)
    _wrap_forward(CSVLogitsProcessor, cfg)
