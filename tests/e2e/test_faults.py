"""Faults while serving: NaN/inf hidden states in the middle of a run, the index file deleted or
rewritten while serving and before a restart, an unusable metrics directory.

NaN/inf come from the test-only plugin ``tests/e2e/faults/csv_test_faults.py``, loaded into the
shared CSV and dense servers (``conftest.POISON``): it poisons the LM-head input of prompts that
start with its marker tokens, while they produce their output tokens 2 to 4, and touches nothing
else.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request

import pytest

from vllm_csv.metrics import FLUSH_SECONDS

from .conftest import POISON, server_env, start_server, vllm_command
from .test_serve import metrics

pytestmark = pytest.mark.e2e

PROMPTS = ["import os\nimport sys\n", "def fibonacci(n):\n", "class Parser:\n    def __init__(self",
           "for i in range(", "    return self.", "with open("]
MAX_TOKENS = 12
MODES = {  # the head's top-1 and top-k certificates, and the sampler hook's
    "greedy": dict(temperature=0),
    "top_k": dict(temperature=0.8, seed=5, extra_body={"top_k": 4}),
    "sampling": dict(temperature=0.8, seed=5),
}


def tokens(server, text: str) -> list[int]:
    import json

    req = urllib.request.Request(server.base_url + "/tokenize", json.dumps({"model": server.model, "prompt": text})
                                 .encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["tokens"]


def complete(server, prompts, **kw) -> list[str]:
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    r = server.client().completions.create(model=server.model, prompt=prompts, max_tokens=MAX_TOKENS,
                                           extra_body=extra, **kw)
    assert r.usage.completion_tokens == MAX_TOKENS * len(prompts)
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_nonfinite_hidden_states_mid_run(mode, csv_server, dense_server):
    """Two of six batched prompts get NaN and +inf LM-head inputs for three steps in the middle
    of their run, on the CSV server and on plain vLLM alike: those rows, and the other rows of
    the steps that hold them (the dense GEMM may write NaN into another row of such a batch:
    ``CertifiedHead.prepare``), go dense and are counted (reason ``nonfinite``), every prompt
    (the poisoned ones included) answers exactly as on plain vLLM, rows are certified again
    after those steps, and the server keeps serving."""
    toks = [tokens(csv_server, p) for p in PROMPTS]
    batch = [POISON["nan"] + toks[0], toks[1], POISON["inf"] + toks[2], *toks[3:]]
    poisoned = {0, 2}
    steps = POISON["steps"][1] - POISON["steps"][0]
    logs = [(s, len(s.log())) for s in (csv_server, dense_server)]
    before = metrics(csv_server)
    got = complete(csv_server, batch, **MODES[mode])
    after = metrics(csv_server)
    want = complete(dense_server, batch, **MODES[mode])
    grew = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    # every row of a step that holds a poisoned row: the poisoned rows, and the others of that
    # step's batch (the two poisoned prompts' steps may not coincide: up to steps * 2 such steps
    # of up to six rows; measured 4 steps of 6 rows here)
    nonfinite = grew.get("csv_decode_fallbacks_total[nonfinite]", 0)
    assert steps * len(poisoned) <= nonfinite <= steps * len(poisoned) * len(batch), grew
    assert grew.get(f"csv_decode_rows_certified_total[{mode}]", 0) > 0, grew
    assert got == want
    for server, start in logs:  # the injector's own count: it acted on both servers
        assert server.log()[start:].count("csv_test_faults: poisoned") == steps * len(poisoned), server.log_path
    again = complete(csv_server, [toks[1]], temperature=0)
    assert again == complete(dense_server, [toks[1]], temperature=0)


@pytest.fixture(scope="module")
def ball_server(test_model_dir, tmp_path_factory):
    """Screen ``ball`` with ``--csv-index`` (budget 1: rows certify, so the index is in use
    every step) and PROMETHEUS_MULTIPROC_DIR set to a path that cannot hold files. Compiled, not
    :data:`EAGER`: its answers are compared with the session's dense server's."""
    from vllm_csv.cli import main

    d = tmp_path_factory.mktemp("ball")
    index = d / "test-index.safetensors"
    # The test checkpoint is fp32, served in bf16 (--dtype bfloat16 below): the index is built
    # from the weights as served (their fingerprint is checked at start-up).
    assert main(["build-index", test_model_dir, "--output", str(index), "--clusters", "128", "--dtype", "bfloat16",
                 "--quiet"]) == 0
    (d / "a_file").write_text("")
    env = {"PROMETHEUS_MULTIPROC_DIR": str(d / "a_file" / "prom")}
    args = ["--dtype", "bfloat16", "--enable-csv-decode", "--csv-screen", "ball", "--csv-index", str(index), "--csv-budget", "1.0",
            "--additional-config", '{"csv_decode": {"off_switch": false}}']
    s = start_server(test_model_dir, args, d / "ball.log", env=env)
    s.index, s.args, s.env = index, args, env
    yield s
    s.stop()


def test_unusable_metrics_dir_serves_with_one_warning(ball_server):
    s = ball_server
    complete(s, PROMPTS[:2], temperature=0)
    time.sleep(3 * FLUSH_SECONDS)  # the workers' counts are written every FLUSH_SECONDS
    with urllib.request.urlopen(s.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "csv_decode_rows_certified_total" in text and "vllm:generation_tokens_total" in text
    assert sum("PROMETHEUS_MULTIPROC_DIR=" in ln and "is unusable" in ln for ln in s.log().splitlines()) == 1


def test_index_rewritten_or_deleted_while_serving(ball_server, dense_server):
    """The index is read once at start-up (into memory, not a map of the file): rewriting the
    file in place (which truncates it) and deleting it change no answer, and rows keep
    certifying with it."""
    s = ball_server
    want = complete(dense_server, PROMPTS, temperature=0)
    assert complete(s, PROMPTS, temperature=0) == want
    for damage in ("rewrite", "delete"):
        before = metrics(s).get("csv_decode_rows_certified_total[greedy]", 0)
        if damage == "rewrite":
            s.index.write_bytes(b"garbage")
        else:
            s.index.unlink()
        assert complete(s, PROMPTS, temperature=0) == want, damage
        assert metrics(s).get("csv_decode_rows_certified_total[greedy]", 0) > before, damage


@pytest.mark.parametrize("damage", ["corrupt", "deleted"])
def test_restart_with_a_damaged_index_is_one_line(ball_server, damage):
    """Restarting with the same flags after the file was damaged: one error line, exit code 2,
    before any engine process starts (no traceback)."""
    s = ball_server
    if damage == "corrupt":
        s.index.write_bytes(b"garbage")
    else:
        s.index.unlink(missing_ok=True)
    r = subprocess.run([*vllm_command(), "serve", s.model, "--max-model-len", "1024", *s.args],
                       capture_output=True, text=True, timeout=300, env=server_env(s.env))
    out = r.stdout + r.stderr
    errors = [ln for ln in out.splitlines() if ln.startswith("vllm serve: error:") or " ERROR " in ln]
    assert r.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert len(errors) == 1 and errors[0].startswith("vllm serve: error: CSV index "), errors
    assert ("corrupt" if damage == "corrupt" else "not found") in errors[0]
