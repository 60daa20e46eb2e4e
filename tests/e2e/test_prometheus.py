"""A real Prometheus scrapes `vllm serve --enable-csv-decode`; every dashboard query returns data."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import free_port
from .prometheus import Prometheus, ensure_prometheus

pytestmark = pytest.mark.e2e
DASHBOARD = Path(__file__).parents[2] / "docker" / "grafana" / "dashboards" / "vllm-csv.json"


def dashboard_queries() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in d["panels"] for t in p["targets"]]


def scrape(server) -> str:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def prometheus(csv_server, tmp_path_factory):
    exe = ensure_prometheus()
    if exe is None:
        pytest.skip("Debian's prometheus package is not installed and cannot be installed here (needs root + apt)")
    p = Prometheus(exe, f"127.0.0.1:{csv_server.port}", tmp_path_factory.mktemp("prometheus"), free_port())
    yield p
    p.stop()


def test_every_dashboard_query_returns_data(csv_server, prometheus):
    client = csv_server.client()
    for i in range(6):  # traffic spread over several scrapes: greedy (certified) and top_p (dense)
        client.completions.create(model=csv_server.model, prompt=["def f(", "import "], max_tokens=8,
                                  temperature=0)
        client.completions.create(model=csv_server.model, prompt="x = ", max_tokens=4, temperature=1.0,
                                  top_p=0.5, seed=i)
        time.sleep(1.5)
    assert prometheus.wait_for('csv_decode_rows_certified_total > 0'), scrape(csv_server)[-3000:]
    time.sleep(3)
    missing = []
    for expr in dashboard_queries():
        e = expr.replace('=~"$model_name"', '=~".*"').replace("$__rate_interval", "1m")
        if not prometheus.wait_for(e, timeout=20):
            missing.append(expr)
    assert not missing, missing


def test_scrape_has_csv_metrics_with_conventions(csv_server):
    text = scrape(csv_server)
    names = set(re.findall(r"^(csv_decode_[a-z_]+)", text, re.M))
    for n in ("csv_decode_steps_total", "csv_decode_rows_certified_total", "csv_decode_fallbacks_total",
              "csv_decode_scored_tokens_bucket", "csv_decode_head_seconds_bucket", "csv_decode_info"):
        assert n in names, sorted(names)
    assert re.search(r'csv_decode_rows_certified_total\{mode="greedy",model_name="[^"]+"\} [1-9]', text)
    assert "vllm:generation_tokens_total" in text  # vLLM's own metrics are still there


def test_no_csv_metrics_without_the_flag(dense_server):
    dense_server.client().completions.create(model=dense_server.model, prompt="x", max_tokens=2, temperature=0)
    text = scrape(dense_server)
    assert "csv_decode_" not in text and "vllm:generation_tokens_total" in text
