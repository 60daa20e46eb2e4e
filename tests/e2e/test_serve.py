"""`vllm serve --enable-csv-decode` answers exactly as `vllm serve` does, for every sampling feature.

Both servers run the same model with the same seed; each request goes to both and the
answers (text, token logprobs) must be identical. Requests batch many prompts, so rows
with different features share a step.
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
import time
import urllib.request

import pytest

from vllm_csv.metrics import FLUSH_SECONDS

from .conftest import on_both, server_env, vllm_command

pytestmark = pytest.mark.e2e

PROMPTS = [
    "import os\nimport sys\n", "def fibonacci(n):\n", "class Parser:\n    def __init__(self", "for i in range(",
    "# Copyright", "    return self.", "if __name__ == ", "def test_", "from collections import",
    "    raise ValueError(", "try:\n    import ", "with open(", "x = [", "\"\"\"Utilities for", "    @property\n",
    "        self.assertEqual(",
]

FEATURES = {
    "greedy": dict(temperature=0),
    "seeded_temperature": dict(temperature=0.8, seed=1234),
    "top_k": dict(temperature=1.0, extra_body={"top_k": 5}, seed=7),
    "top_k_greedyish": dict(temperature=0.3, extra_body={"top_k": 2}, seed=11),
    "top_p": dict(temperature=1.0, top_p=0.9, seed=3),
    "min_p": dict(temperature=1.0, extra_body={"min_p": 0.1}, seed=5),
    "penalties": dict(temperature=0, presence_penalty=0.5, frequency_penalty=0.3,
                      extra_body={"repetition_penalty": 1.3}),
    "negative_penalties": dict(temperature=0, presence_penalty=-0.5, frequency_penalty=-0.4,
                               extra_body={"repetition_penalty": 0.8}),
    "logit_bias": dict(temperature=0, logit_bias={"10": 5.0, "50": -100.0}),
    "allowed_token_ids": dict(temperature=0, extra_body={"allowed_token_ids": list(range(20, 400))}),
    "bad_words": dict(temperature=0, extra_body={"bad_words": ["self", " the"]}),
    "min_tokens": dict(temperature=0, extra_body={"min_tokens": 12}),
    "logprobs": dict(temperature=0, logprobs=3),
    "prompt_logprobs": dict(temperature=0, extra_body={"prompt_logprobs": 2}),
    "n3_seeded": dict(temperature=0.9, extra_body={"top_k": 8}, n=3, seed=99),
    "stop_strings": dict(temperature=0, stop=["\n\n", ")"]),
    # top_k with what the sampler certifies, or above the head's limit: certified in the sampler
    "top_k_top_p": dict(temperature=0.8, top_p=0.9, extra_body={"top_k": 20}, seed=17),
    "top_k_penalty": dict(temperature=0.7, presence_penalty=0.6, extra_body={"top_k": 40}, seed=19),
    "top_k_above_limit": dict(temperature=0.9, extra_body={"top_k": 300}, seed=23),
}

# structured output (vLLM's grammar bitmask, xgrammar): certified in the sampler over the allowed tokens
GRAMMARS = {
    "json": {"json": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                       "n": {"type": "integer"}},
                      "required": ["name", "n"], "additionalProperties": False}},
    "regex": {"regex": r"(def|class) [a-z_]{1,12}\((self)?\):"},
    "choice": {"choice": ["import os", "import sys", "from typing import Any", "pass", "return None"]},
}
STRUCTURED = {f"structured_{name}_{how}": dict(kw, extra_body={"structured_outputs": grammar, **extra})
              for name, grammar in GRAMMARS.items()
              for how, kw, extra in (("greedy", dict(temperature=0), {}),
                                     ("seeded", dict(temperature=0.8, seed=21), {}),
                                     ("top_k", dict(temperature=0.8, seed=25, top_p=0.95), {"top_k": 10}))}
FEATURES.update(STRUCTURED)


# features CSV certifies, and the `mode` label of csv_decode_rows_certified_total that must grow
CERTIFIED_MODES = {
    "greedy": "greedy", "top_k": "top_k", "top_k_greedyish": "top_k", "n3_seeded": "top_k",
    "seeded_temperature": "sampling", "penalties": "processed", "negative_penalties": "processed",
    "logit_bias": "processed", "allowed_token_ids": "processed", "bad_words": "processed",
    "min_tokens": "processed", "stop_strings": "greedy", "top_p": "top_p", "min_p": "min_p",
    "top_k_top_p": "top_p", "top_k_penalty": "processed", "top_k_above_limit": "top_k",
    **{feature: "structured" for feature in STRUCTURED},
}


def metrics(server) -> dict[str, float]:
    """csv_decode_ samples of /metrics: certified rows by mode, fallbacks by reason (read once
    the workers' counts of the steps so far are written: they flush every FLUSH_SECONDS)."""
    time.sleep(3 * FLUSH_SECONDS)
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(csv_decode_\w+)\{([^}]*)\} ([0-9.eE+-]+)$", text, re.M):
        key = name + "".join(f"[{v}]" for k, v in re.findall(r'(\w+)="([^"]*)"', labels) if k != "model_name")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def certified(server, mode: str) -> float:
    return metrics(server).get(f"csv_decode_rows_certified_total[{mode}]", 0.0)


def certified_above(server, mode: str, before: float, wait_s: float = 10.0) -> bool:
    """Whether the certified count of ``mode`` grows past ``before`` within ``wait_s`` (the
    workers' flusher thread writes every FLUSH_SECONDS, later on a loaded machine: a fresh-clone
    CI run read the count before its last flush twice)."""
    deadline = time.monotonic() + wait_s
    while True:
        if certified(server, mode) > before:
            return True
        if time.monotonic() > deadline:
            return False


def complete(server, **kw):
    extra = kw.pop("extra_body", None)
    r = server.client().completions.create(model=server.model, prompt=PROMPTS, max_tokens=kw.pop("max_tokens", 20),
                                           extra_body=extra, **kw)
    return [(c.index, c.text, c.finish_reason, json.dumps(c.logprobs.model_dump() if c.logprobs else None),
             json.dumps(getattr(c, "prompt_logprobs", None))) for c in sorted(r.choices, key=lambda c: c.index)]


def complete_one_at_a_time(server, max_tokens, **kw):
    """Each of PROMPTS as its own request, in turn: per prompt, its choices by index."""
    return [sorted(server.client().completions.create(model=server.model, prompt=p, max_tokens=max_tokens,
                                                      **kw).choices, key=lambda c: c.index)
            for p in PROMPTS]


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_identical_to_dense(feature, csv_server, dense_server):
    """Identical answers; for the features CSV certifies, its certified-rows counter of the
    feature's mode grows meanwhile (the CSV path was taken, not only the dense one)."""
    mode = CERTIFIED_MODES.get(feature)
    before = certified(csv_server, mode) if mode else 0.0
    got, want = on_both(lambda s: complete(s, **dict(FEATURES[feature])), csv_server, dense_server)
    assert got == want
    if mode:
        assert certified_above(csv_server, mode, before), metrics(csv_server)


def test_seeded_long_completion_certified_and_dense_steps(default_csv_server, dense_server):
    """A seeded sampled request of 200 tokens: identical with and without CSV while some of
    its steps are certified (in the sampler) and others go dense (the off-switch, on by
    default, stops CSV after its first steps on the test model), so the RNG streams stay in
    step across both kinds of steps."""
    csv = default_csv_server
    before = metrics(csv)
    texts = on_both(lambda s: s.client().completions.create(
        model=s.model, prompt="def main(argv):\n", max_tokens=200, temperature=1.0, seed=77,
        extra_body={"ignore_eos": True}).choices[0].text, csv, dense_server)
    after = metrics(csv)
    assert texts[0] == texts[1]
    grew = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert grew.get("csv_decode_rows_certified_total[sampling]", 0) > 0, grew
    assert grew.get("csv_decode_fallbacks_total[off_switch]", 0) > 0, grew


@pytest.mark.parametrize("feature", sorted(f for f in CERTIFIED_MODES if f not in STRUCTURED))
def test_identical_to_dense_one_request_at_a_time(feature, csv_server, dense_server):
    """The 16 prompts one request at a time, for every feature CSV certifies (test_identical_to_dense
    sends them together, so their rows share steps; here each step holds one request's rows):
    identical answers, and the feature's certified-rows counter grows. (Structured output:
    test_structured_output_sequential.)"""
    mode = CERTIFIED_MODES[feature]
    before = certified(csv_server, mode)
    answers = on_both(lambda s: [[(c.index, c.text, c.finish_reason) for c in choices]
                                 for choices in complete_one_at_a_time(s, 20, **FEATURES[feature])],
                      csv_server, dense_server)
    assert answers[0] == answers[1]
    assert certified_above(csv_server, mode, before), metrics(csv_server)


@pytest.mark.parametrize("feature", sorted(STRUCTURED))
def test_structured_output_sequential(feature, csv_server, dense_server):
    """The 16 prompts one request at a time (test_identical_to_dense sends them together):
    identical answers, each within its grammar, and the ``structured`` certified counter grows."""
    before = certified(csv_server, "structured")
    kw = STRUCTURED[feature]
    answers = on_both(lambda s: [(choices[0].text, choices[0].finish_reason)
                                 for choices in complete_one_at_a_time(s, 16, **kw)], csv_server, dense_server)
    assert answers[0] == answers[1]
    grammar = kw["extra_body"]["structured_outputs"]
    finished = [text for text, why in answers[0] if why == "stop"]  # the others: cut by max_tokens
    if "choice" in grammar:
        assert set(finished) <= set(grammar["choice"]), answers[0]
        assert all(any(c.startswith(text) for c in grammar["choice"]) for text, _ in answers[0]), answers[0]
    elif "regex" in grammar:
        assert all(re.fullmatch(grammar["regex"], text) for text in finished), answers[0]
    else:
        assert all(json.loads(text).keys() == {"name", "n"} for text in finished), answers[0]
    assert certified_above(csv_server, "structured", before), metrics(csv_server)


def test_json_schema_structured_output(csv_server, dense_server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
              "required": ["name"], "additionalProperties": False}
    before = certified(csv_server, "structured")
    outs = on_both(lambda s: s.client().chat.completions.create(
        model=s.model, messages=[{"role": "user", "content": "Give a name as JSON."}], max_tokens=24,
        temperature=0, extra_body={"structured_outputs": {"json": schema}}).choices[0].message.content,
        csv_server, dense_server)
    assert outs[0] == outs[1]
    assert certified_above(csv_server, "structured", before), metrics(csv_server)


def test_csv_path_was_taken(csv_server, dense_server):
    complete(csv_server, temperature=0)
    log = csv_server.log()
    m = re.search(r"CSV-Decode active: screen=(\w+) V=(\d+) d=(\d+)(?: backend=([\w+]+))?", log)
    assert m, log[-3000:]
    assert "CSV-Decode active" not in dense_server.log()
    if m.group(1) == "int8" and platform.machine() == "x86_64":  # the CPU default: our GEMM where it runs
        from vllm_csv.ops import int8_vnni

        want = "fbgemm" if int8_vnni.unavailable_reason(8, 8) is not None else (
            "vnni+amx" if int8_vnni.amx_available() else "vnni" if int8_vnni.cpu_supports("avx512_vnni") else "avx2")
        assert m.group(4) == want, m.group(0)


def test_invalid_request_gets_400_and_server_keeps_serving(csv_server):
    import openai

    with pytest.raises(openai.BadRequestError):
        csv_server.client().completions.create(model=csv_server.model, prompt="x", max_tokens=-1)
    ok = csv_server.client().completions.create(model=csv_server.model, prompt="def f(", max_tokens=4, temperature=0)
    assert ok.choices[0].text is not None


def test_bad_flag_stops_startup(test_model_dir):
    r = subprocess.run([*vllm_command(), "serve", test_model_dir, "--enable-csv-decode", "--csv-budget", "2"],
                       capture_output=True, text=True, timeout=300, env=server_env())
    assert r.returncode == 2
    assert "invalid csv_decode configuration: budget" in r.stderr, r.stderr[-3000:]
