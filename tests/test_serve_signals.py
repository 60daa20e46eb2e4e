"""`vllm-csv serve` (``bash run.sh``) stopped by a signal: exit code 128 + N (Ctrl-C: 130), the
server stopped, and triton's nanobind leak report at exit kept off the terminal. The server is
a fake `vllm serve` (a few lines of Python answering the endpoints the wrapper calls), so these
run in seconds without vLLM."""

import os
import signal
import socket
import sys
import threading
import time

import pytest

from vllm_csv import serve as srv

# What the fake prints when it stops: vLLM's last log line, then the report triton's nanobind
# bindings print at interpreter exit (its format strings, from triton/_C/libtriton.so).
SHUTDOWN = "(APIServer pid=1) INFO Shutting down FastAPI HTTP server.\n"
LEAKS = ['nanobind: leaked 2 instances!\n',
         ' - leaked instance 0x7f00deadbeef of type "triton._C.ir.context"\n',
         'nanobind: leaked 61 functions!\n', ' - leaked function "get_int1_ty"\n',
         ' - ... skipped remainder\n',
         'nanobind: this is likely caused by a reference counting issue in the binding code.\n',
         'See https://nanobind.readthedocs.io/en/latest/refleaks.html\n']

FAKE_VLLM = r'''
import http.server, json, os, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
LEAKS = %r
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, body):
        b = json.dumps(body).encode() if isinstance(body, dict) else body.encode()
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers()
        self.wfile.write(b)
    def do_GET(self):
        self._send({"data": [{"id": "fake"}]} if self.path == "/v1/models" else "csv_decode_rows_total 4.0\n")
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send({"choices": [{"text": "    return n"}]})
def stop(signum, frame):
    print(%r, flush=True)
    sys.stdout.write("".join(LEAKS)); sys.stdout.flush()
    if signum == signal.SIGTERM:  # dies of it, as a process without a handler would
        signal.signal(signal.SIGTERM, signal.SIG_DFL); os.kill(os.getpid(), signal.SIGTERM)
    os._exit(0)  # vLLM exits 0 after its SIGINT shutdown
signal.signal(signal.SIGINT, stop); signal.signal(signal.SIGTERM, stop)
open(os.environ["FAKE_VLLM_PID"], "w").write(str(os.getpid()))
print("INFO fake vllm serve up", flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
''' % (LEAKS, SHUTDOWN.rstrip("\n"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Runs `serve` against the fake; `then(pid)` is called (in a thread) once the wrapper
    serves, with the fake's pid. Returns (exit code, stdout, stderr)."""
    exe = tmp_path / "fake_vllm.py"
    exe.write_text(FAKE_VLLM)
    pidfile = tmp_path / "pid"
    monkeypatch.setenv("FAKE_VLLM_PID", str(pidfile))
    monkeypatch.setattr(srv, "_vllm_command", lambda: [sys.executable, str(exe)])
    monkeypatch.setattr(srv, "_prepare_kernels", lambda: None)  # (tested in test_kernel_build.py)
    serving = threading.Event()
    monkeypatch.setattr(srv, "csv_metrics", lambda base: serving.set() or {})

    def run(then, capfd):
        def later():
            serving.wait(30)
            time.sleep(0.3)  # the wrapper is in proc.wait() by now
            then(int(pidfile.read_text()))
        t = threading.Thread(target=later, daemon=True)
        t.start()
        rc = srv.serve("M", "127.0.0.1", _free_port(), False, [], 30.0)
        t.join(5)
        out, err = capfd.readouterr()
        return rc, out, err
    return run


def test_sigint_to_the_wrapper_exits_130_and_hides_the_leak_report(fake, capfd):
    """`kill -INT` of the wrapper: it stops the server (SIGINT, vLLM's clean shutdown), whose
    last log line still shows and whose nanobind report is counted, not shown; exit 130."""
    before = signal.getsignal(signal.SIGINT)
    rc, out, err = fake(lambda pid: os.kill(os.getpid(), signal.SIGINT), capfd)
    assert rc == 130
    assert "fake vllm serve up" in out and SHUTDOWN in out and "nanobind" not in out + err
    assert f"[vllm-csv] {len(LEAKS)} lines of triton/multiprocessing teardown reports" in err
    assert "stopped by SIGINT: exit code 130" in err
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler is back


def test_ctrl_c_from_a_shell_that_ignored_sigint_exits_130(fake, capfd):
    """The issue's case: the wrapper started in the background of a script (the shell leaves
    SIGINT ignored there), then SIGINT to the whole process group, as Ctrl-C sends it. The
    server stops by itself and exits 0; before, the wrapper returned that 0 and relayed the
    server's leak report (it had not been told that the server was stopping)."""
    def ctrl_c(pid):
        os.kill(pid, signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        rc, out, err = fake(ctrl_c, capfd)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # restored as it was
    finally:
        signal.signal(signal.SIGINT, old)
    assert rc == 130 and SHUTDOWN in out and "nanobind" not in out + err


def test_sigterm_to_the_wrapper_exits_143(fake, capfd):
    rc, out, err = fake(lambda pid: os.kill(os.getpid(), signal.SIGTERM), capfd)
    assert rc == 143 and "stopped by SIGTERM: exit code 143" in err and "nanobind" not in out


def test_server_killed_alone_gives_128_plus_n_and_no_leak_report(fake, capfd):
    """The server stopped by someone else (SIGTERM to it alone, which it dies of): the wrapper
    was not told that it stops, and still its nanobind report is not shown; exit 128 + 15."""
    rc, out, err = fake(lambda pid: os.kill(pid, signal.SIGTERM), capfd)
    assert rc == 143 and SHUTDOWN in out and "nanobind" not in out
    assert "stopped by" not in err  # not the wrapper's signal


def test_exit_code_of_the_server():
    assert [srv.exit_code(c) for c in (0, 1, -2, -15, -9)] == [0, 1, 130, 143, 137]


# As a vLLM 0.32 server on the CPU printed them (benchmarks' logs): the demo's fp32 weights cast
# at load, and at exit nanobind's last line without its newline, the next output glued to it.
_CAST = ("(Worker pid=14624) WARNING 11-24 03:08:42 [utils.py:333] Attempted to load weight {} with dtype "
         "torch.float32 into parameter with dtype torch.bfloat16\n")
_GLUED = ("See https://nanobind.readthedocs.io/en/latest/refleaks.html/root/.pyenv/versions/3.11.7/lib/"
          "python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear "
          "to be 1 leaked semaphore objects to clean up at shutdown\n")


@pytest.mark.parametrize("demo", [True, False])
def test_relay_of_canned_lines(demo):
    """The relay on canned lines: the demo's 11 cast warnings become one line of ours (a user's
    model keeps vLLM's); nanobind's report goes whether or not the wrapper stopped the server,
    and a line glued to its last one is judged on its own (here the resource tracker's report,
    shown while serving, dropped after the stop)."""
    import io

    names = ["lm_head.weight", "embed_tokens.weight", "norm.weight"] + [
        f"layers.{i}.{w}.weight" for i in range(2) for w in
        ("input_layernorm", "mlp.down_proj", "post_attention_layernorm", "self_attn.o_proj")]
    casts = [_CAST.format(n) for n in names]
    up = "(APIServer pid=1) INFO 11-24 03:09:10 [api_server.py:1000] Starting vLLM API server\n"
    for stop in (False, True):
        out = io.StringIO()
        f = srv._Forward(iter(()), out, demo=demo)
        f.thread.join()
        f.stream, f.stop = iter(casts + [up] + LEAKS[:-1] + [_GLUED]), stop
        f._run()
        text = out.getvalue()
        assert text.count("[utils.py:333] Attempted to load weight") == (0 if demo else 11)
        assert text.count("[vllm-csv] the demo model's checkpoint is float32, served in bfloat16") == demo
        assert up in text and "nanobind" not in text
        assert ("resource_tracker" in text) is (not stop)
        assert f.dropped == len(LEAKS) + stop and f.casts == (11 if demo else 0)
