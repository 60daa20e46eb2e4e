"""A real Prometheus server on loopback for the tests (Debian's `prometheus` package)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path


def ensure_prometheus() -> str | None:
    """Path of the prometheus binary, installing Debian's package when possible (root + apt)."""
    exe = shutil.which("prometheus")
    if exe:
        return exe
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
    r = subprocess.run(["apt-get", "install", "-y", "-qq", "prometheus"], env=env, capture_output=True, timeout=900)
    return shutil.which("prometheus") if r.returncode == 0 else None


class Prometheus:
    def __init__(self, exe: str, target: str, workdir: Path, port: int):
        self.port = port
        cfg = workdir / "prometheus.yml"
        cfg.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: vllm\n"
                       f"    static_configs:\n      - targets: ['{target}']\n")
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [exe, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("prometheus did not become ready")

    def query(self, expr: str) -> list:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, expr: str, timeout: float = 60) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            res = self.query(expr)
            if res:
                return res
            time.sleep(1)
        return []

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.log.close()
