"""Real `vllm serve` subprocesses on the locally trained test model (vllm_csv.demo_model.TEST) (shared per session)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")
STARTUP_TIMEOUT = float(os.environ.get("VLLM_CSV_E2E_STARTUP_TIMEOUT", "600"))
FAULTS_DIR = Path(__file__).with_name("faults")  # the test-only plugin csv_test_faults (never shipped)
# Prompts starting with these token ids get NaN / +inf LM-head inputs while producing their
# output tokens 2, 3 and 4 (tests/e2e/faults/csv_test_faults.py); no other request is touched.
POISON = {"nan": [8191, 8190, 8189], "inf": [8188, 8187, 8186], "steps": [2, 5]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command() -> list[str]:
    exe = Path(sys.executable).with_name("vllm")
    return [str(exe)] if exe.exists() else [shutil.which("vllm") or "vllm"]


def server_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra or {})
    return env


def fault_env() -> dict:
    """Environment that loads the test-only fault injector (:data:`POISON`) into a server."""
    path = os.pathsep.join(p for p in (str(FAULTS_DIR), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "VLLM_CSV_TEST_FAULTS": json.dumps(POISON)}
    if os.environ.get("VLLM_PLUGINS"):  # an allow-list: add the injector to it
        env["VLLM_PLUGINS"] = os.environ["VLLM_PLUGINS"] + ",csv_test_faults"
    return env


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    model: str
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="none", timeout=300)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(model: str, args: list[str], log_path: Path, env: dict | None = None) -> Server:
    port = free_port()
    log = open(log_path, "w")
    cmd = [*vllm_command(), "serve", model, "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           "--max-model-len", "1024", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(env),
                            start_new_session=True)
    server = Server(proc, port, model, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            urllib.request.urlopen(server.base_url + "/health", timeout=2)
            return server
        except OSError:
            time.sleep(1)
    server.stop()
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT}s:\n{server.log()[-4000:]}")


@pytest.fixture(scope="session")
def test_model_dir() -> str:
    from vllm_csv.demo_model import ensure_test_model

    return str(ensure_test_model(progress=False))


@pytest.fixture(scope="session")
def csv_server(test_model_dir, tmp_path_factory):
    # Off-switch disabled: the test model's head is too small for CSV to pay on a CPU, so with it on CSV
    # would stop trying after a few steps and the comparisons would test the dense path.
    # The fault injector is loaded (test_faults.py); it touches only prompts carrying its markers.
    s = start_server(test_model_dir, ["--enable-csv-decode", "--additional-config",
                                      '{"csv_decode": {"off_switch": false}}'],
                     tmp_path_factory.mktemp("logs") / "csv.log", env=fault_env())
    yield s
    s.stop()


@pytest.fixture(scope="session")
def default_csv_server(test_model_dir, tmp_path_factory):
    """`--enable-csv-decode` as users run it (off-switch on): on the test model CSV certifies its
    first steps and then the off-switch sends steps dense."""
    s = start_server(test_model_dir, ["--enable-csv-decode"], tmp_path_factory.mktemp("logs") / "csv-default.log")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def dense_server(test_model_dir, tmp_path_factory):
    # The same fault injector as csv_server's: a poisoned prompt gets plain vLLM's answer to it.
    s = start_server(test_model_dir, [], tmp_path_factory.mktemp("logs") / "dense.log", env=fault_env())
    yield s
    s.stop()
