"""``vllm-csv serve [MODEL]``: the main job. Serve a model with CSV-Decode on through
``vllm serve`` (the embedded demo model when none is given), show one answered
request, then keep serving until interrupted (or exit with ``--once``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .errors import CSVError

DEMO_PROMPT = "def fibonacci(n):\n"
# Teardown reports that plain `vllm serve` prints too when it is stopped (triton's nanobind
# bindings list their objects alive at interpreter exit; multiprocessing's resource tracker
# its semaphores): harmless, hundreds of lines. Dropped once the server was asked to stop.
TEARDOWN_NOISE = ("nanobind: ", " - leaked ", " - ... skipped remainder", "See https://nanobind",
                  "resource_tracker: There appear to be", "  warnings.warn('resource_tracker")


# vLLM 0.32's own shutdown race (vllm-project/vllm#48745, fix proposed in #49000): AsyncLLM
# tears the engine core down before it cancels its output handler, which may first see the
# client's "engine dead" pill and log it as `AsyncLLM output_handler failed` with an
# EngineDeadError traceback, although the shutdown it was asked for completes normally.
SHUTDOWN_RACE = ("AsyncLLM output_handler failed", "EngineDeadError")


class _Forward:
    """Copies the server's output to ours, line by line. After :meth:`stopping`, the lines of
    :data:`TEARDOWN_NOISE` are counted instead of printed, and so is vLLM's report of its
    shutdown race (:data:`SHUTDOWN_RACE`: the `output_handler failed` block, only when it ends
    in an EngineDeadError; any other error after the stop is printed in full)."""

    def __init__(self, stream, out=None):
        import threading

        self.stream, self.out = stream, out or sys.stdout
        self.stop, self.dropped, self.race = False, 0, 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _write(self, lines):
        self.out.write("".join(lines))
        self.out.flush()

    def _run(self):
        block: list[str] = []  # the lines of an `output_handler failed` report seen after the stop
        tag = ""  # its logger prefix (`[async_llm.py:906]`), carried by each line of the report
        for line in self.stream:
            if block and tag in line:
                block.append(line)
                continue
            block = self._end(block)
            if self.stop and SHUTDOWN_RACE[0] in line:
                m = re.search(r"\[[\w.]+:\d+\]", line)
                block, tag = [line], (m.group(0) if m else SHUTDOWN_RACE[0])
            elif self.stop and any(n in line for n in TEARDOWN_NOISE):
                self.dropped += 1
            else:
                self._write([line])
        self._end(block)

    def _end(self, block: list[str]) -> list[str]:
        """A report of :data:`SHUTDOWN_RACE` ended: counted if its last line (the exception)
        is the EngineDeadError, else printed (another error, or a report cut off)."""
        if block and SHUTDOWN_RACE[1] in block[-1]:
            self.race += 1
        elif block:
            self._write(block)
        return []

    def stopping(self):
        self.stop = True

    def close(self, timeout: float = 10.0) -> None:
        self.thread.join(timeout)
        if self.dropped:
            print(f"[vllm-csv] server stopped ({self.dropped} lines of triton/multiprocessing teardown "
                  "reports not shown)", file=sys.stderr)
        if self.race:
            print("[vllm-csv] vLLM reported its known shutdown race (an EngineDeadError from its "
                  "output handler after the engine stopped as asked; vllm-project/vllm#48745): "
                  "not shown", file=sys.stderr)


def _vllm_command() -> list[str]:
    exe = Path(sys.executable).with_name("vllm")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("vllm")
    if found:
        return [found]
    raise CSVError("the `vllm` command is not installed in this environment; `pip install vllm-csv[cpu]` or `[cuda]`")


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CSVError(f"vllm serve exited with code {proc.returncode} during start-up (see its log above)")
        try:
            _get(base + "/health", timeout=2.0)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            time.sleep(1.0)
    raise CSVError(f"vllm serve did not become healthy within {timeout:.0f}s")


def demo_request(base: str, model: str, prompt: str = DEMO_PROMPT, max_tokens: int = 48) -> str:
    out = _post(base + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0})
    return out["choices"][0]["text"]


def csv_metrics(base: str) -> dict[str, float]:
    """:func:`parse_csv_metrics` of the server's ``/metrics``; empty if it does not answer. Read
    once the workers' counts of the steps so far are written (they flush every
    :data:`~vllm_csv.metrics.FLUSH_SECONDS`)."""
    from .metrics import FLUSH_SECONDS

    time.sleep(3 * FLUSH_SECONDS)
    try:
        return parse_csv_metrics(_get(base + "/metrics").decode())
    except (urllib.error.URLError, OSError):
        return {}


def parse_csv_metrics(text: str) -> dict[str, float]:
    """The ``csv_decode_*`` samples of a ``/metrics`` page (histogram buckets left out), keyed
    by name with its labels (``model_name`` dropped) and by bare name (summed over labels)."""
    import re

    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("csv_decode_") and "_bucket" not in line:
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'model_name="[^"]*",?', "", name).replace(",}", "}").replace("{}", "")
            for key in {name, name.split("{")[0]}:
                out[key] = out.get(key, 0.0) + float(value)
    return out


def summary(m: dict[str, float]) -> str:
    """What CSV did so far, from :func:`csv_metrics`: rows certified, and the head's speed-up
    on the steps that ran CSV (the dense head's time there is the off-switch's estimate,
    measured in place by dense steps of the same batch size)."""
    rows, cert = m.get("csv_decode_rows_total", 0.0), m.get("csv_decode_rows_certified_total", 0.0)
    off = m.get('csv_decode_fallbacks_total{reason="off_switch"}', 0.0)
    csv_s, dense_s = m.get("csv_decode_head_seconds_csv_total", 0.0), m.get(
        "csv_decode_head_seconds_dense_estimate_total", 0.0)
    share = f"{cert:.0f} of {rows:.0f} rows certified ({100 * cert / rows:.1f}%)" if rows else "no rows yet"
    if not csv_s:
        return f"{share}; no step ran CSV ({off:.0f} rows dense by the off-switch)"
    return (f"{share}; on the steps that ran CSV the head took {1e3 * csv_s:.1f} ms against "
            f"{1e3 * dense_s:.1f} ms dense (measured in place): {dense_s / csv_s:.2f}x"
            + (f"; {off:.0f} rows dense by the off-switch" if off else ""))


def serve(model: str | None, host: str, port: int, once: bool, extra: list[str], timeout: float) -> int:
    if model is None:
        from .demo_model import ensure_demo_model

        model = str(ensure_demo_model())
        print(f"[vllm-csv] serving the embedded demo model {model}", file=sys.stderr)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [*_vllm_command(), "serve", model, "--enable-csv-decode", "--host", host, "--port", str(port), *extra]
    print("[vllm-csv] " + " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    fwd = _Forward(proc.stdout)
    base = f"http://{host}:{port}"
    try:
        wait_healthy(proc, base, timeout)
        served = json.loads(_get(base + "/v1/models"))["data"][0]["id"]
        t0 = time.perf_counter()
        text = demo_request(base, served)
        print(f"\n[vllm-csv] request answered in {time.perf_counter() - t0:.2f}s (greedy, CSV path):\n"
              f"{DEMO_PROMPT}{text}\n")
        print(f"[vllm-csv] {summary(csv_metrics(base))}")
        if once:
            return 0
        print(f"[vllm-csv] serving the OpenAI API on {base} (Ctrl-C to stop)", file=sys.stderr)
        return proc.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        fwd.stopping()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # vLLM's own clean shutdown (as Ctrl-C)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        fwd.close()
