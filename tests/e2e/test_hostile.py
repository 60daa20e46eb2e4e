"""Hostile request parameters through the HTTP API: the CSV server answers exactly as plain
vLLM does (the same error status and message, or identical output), and keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from .conftest import on_both

pytestmark = pytest.mark.e2e

PROMPT = "def fibonacci(n):\n"
V_DEMO_OOV = 10**7  # an id far outside any vocabulary

CASES = {
    "top_k_minus_1": dict(temperature=0.8, top_k=-1, seed=1),
    "top_k_0": dict(temperature=0.8, top_k=0, seed=1),
    "top_k_vocab": dict(temperature=0.8, top_k="V", seed=1),
    "top_k_above_vocab": dict(temperature=0.8, top_k="V+1", seed=1),
    "top_k_above_max_topk": dict(temperature=0.8, top_k=65, seed=1),
    "top_k_2": dict(temperature=0.8, top_k=2, seed=1),
    "temperature_1e-6": dict(temperature=1e-6, seed=1),
    "temperature_1e4": dict(temperature=1e4, top_k=5, seed=1),
    "logit_bias_extremes": dict(temperature=0, logit_bias={"10": 100, "11": -100}),
    "logit_bias_oov": dict(temperature=0, logit_bias={str(V_DEMO_OOV): 5}),
    "allowed_one_token": dict(temperature=0, allowed_token_ids=[42]),
    "max_tokens_0": dict(temperature=0, max_tokens=0),
    "max_tokens_1": dict(temperature=0, max_tokens=1),
    "empty_prompt": dict(temperature=0, prompt=""),
    "n16_best_of": dict(temperature=0.9, top_k=8, n=16, best_of=16, seed=3),
    "n16": dict(temperature=0.9, top_k=8, n=16, seed=3),
}


def _vocab_size(server) -> int:
    cfg = json.loads(open(f"{server.model}/config.json").read())
    return int(cfg["vocab_size"])


def _request(server, params: dict) -> tuple[int, object]:
    """(HTTP status, texts or the error message) for one completion request."""
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 12, **params}
    if isinstance(body.get("top_k"), str):
        V = _vocab_size(server)
        body["top_k"] = V + (1 if body["top_k"] == "V+1" else 0)
    req = urllib.request.Request(server.base_url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
            return r.status, [(c["index"], c["text"], c["finish_reason"]) for c in
                              sorted(out["choices"], key=lambda c: c["index"])]
    except urllib.error.HTTPError as e:
        err = json.loads(e.read() or b"{}")
        return e.code, (err.get("error") or {}).get("message", err)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_parameters_answer_as_plain_vllm(case, csv_server, dense_server):
    got, want = on_both(lambda s: _request(s, dict(CASES[case])), csv_server, dense_server)
    assert got == want, (case, got, want)
    ok = _request(csv_server, {"temperature": 0, "max_tokens": 4})
    assert ok[0] == 200, ok  # and the server keeps serving
