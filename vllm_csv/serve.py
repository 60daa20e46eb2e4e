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
# Teardown reports that plain `vllm serve` prints too when it is stopped: harmless, hundreds of
# lines. Triton's nanobind bindings list their objects alive at interpreter exit (the lines
# NANOBIND_LEAKS matches, printed by any vLLM process that exits, whoever stopped it: always
# dropped; its last line, NANOBIND_URL, ends without a newline, so the next output is glued to
# it); multiprocessing's resource tracker lists its semaphores (dropped once the server was
# asked to stop).
NANOBIND_LEAKS = re.compile(r"(\(\w[\w ]* pid=\d+\) )?(nanobind: leaked \d+ |nanobind: this is likely caused "
                            r"| - leaked (function|type) \"| - leaked instance 0x| - \.\.\. skipped remainder"
                            r"|nanobind::detail::nb_func_dealloc\()")
NANOBIND_URL = "See https://nanobind.readthedocs.io/en/latest/refleaks.html"
TEARDOWN_NOISE = ("resource_tracker: There appear to be", "  warnings.warn('resource_tracker")
# vLLM's warning for each weight of an fp32 checkpoint loaded into a 16-bit model (11 lines for
# the demo model, trained and saved in fp32, served in bf16): one line of ours instead, when the
# model is the demo (a user's model keeps vLLM's warnings).
DEMO_CAST = re.compile(r"Attempted to load weight \S+ with dtype torch\.float32 into parameter with dtype "
                       r"torch\.(bfloat16|float16)\s*$")
# The wrapper's exit code when a signal stopped it: the shell's 128 + N (Ctrl-C: 130).
SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


# vLLM 0.32's own shutdown race (vllm-project/vllm#48745, fix proposed in #49000): AsyncLLM
# tears the engine core down before it cancels its output handler, which may first see the
# client's "engine dead" pill and log it as `AsyncLLM output_handler failed` with an
# EngineDeadError traceback, although the shutdown it was asked for completes normally.
SHUTDOWN_RACE = ("AsyncLLM output_handler failed", "EngineDeadError")


class _Forward:
    """Copies the server's output to ours, line by line. Triton's leak reports
    (:data:`NANOBIND_LEAKS`) are counted instead of printed, and so are, for the ``demo``
    model, vLLM's warnings of its weights cast at load (:data:`DEMO_CAST`: one line of ours
    instead). After :meth:`stopping`, so are the lines of :data:`TEARDOWN_NOISE`, and so is
    vLLM's report of its shutdown race (:data:`SHUTDOWN_RACE`: the `output_handler failed`
    block, only when it ends in an EngineDeadError; any other error after the stop is printed
    in full)."""

    def __init__(self, stream, out=None, demo: bool = False):
        import threading

        self.stream, self.out, self.demo = stream, out or sys.stdout, demo
        self.stop, self.dropped, self.race, self.casts = False, 0, 0, 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _write(self, lines):
        self.out.write("".join(lines))
        self.out.flush()

    def _run(self):
        block: list[str] = []  # the lines of an `output_handler failed` report seen after the stop
        tag = ""  # its logger prefix (`[async_llm.py:906]`), carried by each line of the report
        for line in self.stream:
            if line.startswith(NANOBIND_URL):  # the leak report's last line, and what was glued to it
                self.dropped += 1
                line = line[len(NANOBIND_URL):]
                if not line.strip():
                    continue
            if block and tag in line:
                block.append(line)
                continue
            block = self._end(block)
            if self.stop and SHUTDOWN_RACE[0] in line:
                m = re.search(r"\[[\w.]+:\d+\]", line)
                block, tag = [line], (m.group(0) if m else SHUTDOWN_RACE[0])
            elif NANOBIND_LEAKS.match(line) or (self.stop and any(n in line for n in TEARDOWN_NOISE)):
                self.dropped += 1
            elif self.demo and DEMO_CAST.search(line):
                if not self.casts:
                    self._write([f"[vllm-csv] the demo model's checkpoint is float32, served in "
                                 f"{DEMO_CAST.search(line).group(1)}: vLLM casts its weights at load (its "
                                 "warning for each, `Attempted to load weight ...`, not shown)\n"])
                self.casts += 1
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
            print(f"[vllm-csv] {self.dropped} lines of triton/multiprocessing teardown reports "
                  "(object leak lists at exit, harmless; plain `vllm serve` prints them too) not shown",
                  file=sys.stderr)
        if self.race:
            print("[vllm-csv] vLLM reported its known shutdown race (an EngineDeadError from its "
                  "output handler after the engine stopped as asked; vllm-project/vllm#48745): "
                  "not shown", file=sys.stderr)


class _Signals:
    """The wrapper's SIGINT and SIGTERM while it runs a server (installed even where the shell
    left SIGINT ignored, as it does for a job in the background of a script: vLLM's server
    answers it there, and so must its wrapper). The first one records its exit code
    (:data:`SIGNAL_EXIT`), tells the output relay that the server is stopping (its teardown
    reports follow within seconds: a Ctrl-C reaches the server too) and raises
    KeyboardInterrupt to leave whatever the wrapper waits on; a second one while the server
    shuts down kills it instead of waiting."""

    def __init__(self):
        self.fwd: _Forward | None = None
        self.proc: subprocess.Popen | None = None
        self.code: int | None = None
        self.saved: dict = {}

    def __enter__(self) -> "_Signals":
        try:
            self.saved = {s: signal.signal(s, self._handle) for s in SIGNAL_EXIT}
        except ValueError:  # not the main thread: no handlers (the caller's own stay)
            self.saved = {}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self.saved.items():
            signal.signal(s, h)

    def _handle(self, signum, frame) -> None:
        if self.code is None:
            self.code = SIGNAL_EXIT[signum]
            if self.fwd is not None:
                self.fwd.stopping()
            raise KeyboardInterrupt
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


def exit_code(returncode: int) -> int:
    """The wrapper's exit code for the server's: the shell's 128 + N for a server killed by
    signal N (Popen's returncode -N)."""
    return 128 - returncode if returncode < 0 else returncode


def _vllm_command() -> list[str]:
    exe = Path(sys.executable).with_name("vllm")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("vllm")
    if found:
        return [found]
    raise CSVError("the `vllm` command is not installed in this environment; `pip install vllm-csv[cpu]` or `[cuda]`")


PLUGIN_ENTRY_POINT = "csv_decode"  # this plugin's name in vLLM's vllm.general_plugins (pyproject.toml)


def without_plugin(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a ``vllm serve`` that does not load this plugin at all: ``VLLM_PLUGINS`` lists
    every other installed general plugin (vLLM then loads only those). A benchmark's dense
    server runs so, so that its baseline is vLLM's own dense path, and any cost the plugin puts
    on a server whose CSV is off is charged to CSV rather than hidden in the baseline."""
    from importlib.metadata import entry_points

    others = sorted({e.name for e in entry_points(group="vllm.general_plugins")} - {PLUGIN_ENTRY_POINT})
    # (an unknown name matches no plugin: "none" when there are no others, VLLM_PLUGINS="" being read as [""])
    return dict(env, VLLM_PLUGINS=",".join(others) or "none")


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


def spec_metrics(base: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters on the server's ``/metrics`` (drafts, draft tokens,
    accepted tokens; summed over labels), with the acceptance rate; empty without speculation."""
    try:
        return parse_spec_metrics(_get(base + "/metrics").decode())
    except (urllib.error.URLError, OSError):
        return {}


def parse_spec_metrics(text: str) -> dict[str, float]:
    """:func:`spec_metrics` of a ``/metrics`` page."""
    import re

    out: dict[str, float] = {}
    for name, value in re.findall(r"^vllm:(spec_decode_num_\w+?)_total(?:\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M):
        out[name] = out.get(name, 0.0) + float(value)
    drafted = out.get("spec_decode_num_draft_tokens", 0.0)
    if drafted:
        out["acceptance_rate"] = round(out.get("spec_decode_num_accepted_tokens", 0.0) / drafted, 4)
    return out


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


def _prepare_kernels() -> None:
    """On a CPU machine, build the CSV CPU kernels here, before the server starts (where its
    worker would build them, silently for 1-3 minutes while vLLM waits on it): the build says what
    it builds and how long it took, and the worker loads it. A failed build is said here too;
    the server then runs the torch reference, as it would have."""
    import torch

    if torch.cuda.is_available():  # (the CUDA head runs no CPU kernel)
        return
    from .ops import build

    build.build_kernels()


def serve(model: str | None, host: str, port: int, once: bool, extra: list[str], timeout: float) -> int:
    demo = model is None
    if demo:
        from .demo_model import ensure_demo_model

        model = str(ensure_demo_model())
        print(f"[vllm-csv] serving the embedded demo model {model}", file=sys.stderr)
    _prepare_kernels()
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [*_vllm_command(), "serve", model, "--enable-csv-decode", "--host", host, "--port", str(port), *extra]
    print("[vllm-csv] " + " ".join(cmd), file=sys.stderr)
    with _Signals() as sig:  # the server is stopped whatever happens, and so is the relay
        rc, proc, fwd = 130, None, None
        try:
            proc = sig.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               text=True, errors="replace")
            fwd = sig.fwd = _Forward(proc.stdout, demo=demo)
            rc = _run(proc, f"http://{host}:{port}", once, timeout)
        except KeyboardInterrupt:
            pass  # rc stays 130, or sig.code below
        finally:
            if fwd is not None:
                fwd.stopping()
            if proc is not None:
                _stop(proc)
            if fwd is not None:
                fwd.close()
        if sig.code:  # a signal stopped us, even one that came while the server shut down
            print(f"[vllm-csv] stopped by {signal.Signals(sig.code - 128).name}: exit code {sig.code}",
                  file=sys.stderr)
        return sig.code or rc


def _run(proc: subprocess.Popen, base: str, once: bool, timeout: float) -> int:
    """Wait for the server, answer the demo request, then (unless ``once``) serve until the
    server exits (its exit code, :func:`exit_code`) or a signal stops the wrapper."""
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
    return exit_code(proc.wait())


def _stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop the server as Ctrl-C does (vLLM's own clean shutdown), killed after ``timeout``
    seconds or at a second signal."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.kill()
    proc.wait()
