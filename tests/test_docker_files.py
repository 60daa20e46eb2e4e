"""docker/: the compose file, Prometheus config and Grafana dashboard are consistent."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

DOCKER = Path(__file__).parents[1] / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "vllm-csv.json"


def test_docker_files_validate():
    import yaml

    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    assert {"vllm", "prometheus", "grafana"} <= set(compose["services"])
    root = DOCKER
    for svc in compose["services"].values():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (root / src).exists(), src
    assert (root.parent / compose["services"]["vllm"]["build"]["dockerfile"]).exists()
    prom = yaml.safe_load((root / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["vllm:8000"]
    assert all("${datasource}" in json.dumps(p["datasource"]) for p in json.loads(DASHBOARD.read_text())["panels"])


def test_dashboard_queries_use_our_metrics_and_vllms():
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    assert any("csv_decode_rows_certified_total" in e for e in exprs)
    assert any("csv_decode_fallbacks_total" in e and "reason" in e for e in exprs)
    assert any("histogram_quantile" in e and "csv_decode_scored_tokens_bucket" in e for e in exprs)
    assert any("vllm:generation_tokens_total" in e for e in exprs)
    assert any("vllm:e2e_request_latency_seconds_bucket" in e for e in exprs)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus package) not installed")
def test_promtool_accepts_the_prometheus_config():
    r = subprocess.run(["promtool", "check", "config", str(DOCKER / "prometheus.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
