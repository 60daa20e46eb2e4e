"""The CPU kernels' build lock: a build killed mid-way must not make later loads hang, and a
build held too long by another process must end in the torch reference, said in the log."""

import fcntl
import logging
import os
import shutil
import subprocess
import sys

import pytest

from vllm_csv.ops import build

pytestmark = pytest.mark.skipif(build.load_ops() is None, reason="CPU kernels not built")

LOAD = ("import logging; logging.basicConfig(level=logging.INFO); from vllm_csv.ops import build; "
        "print('ops', build.load_ops() is not None)")


@pytest.fixture
def private_build(tmp_path, monkeypatch):
    """A copy of this process's kernel build (times kept, so ninja finds nothing to do) under a
    ``TORCH_EXTENSIONS_DIR`` of the test's own: the locks these tests leave or hold are then seen
    only by their subprocess, not by the suite's end-to-end servers loading the kernels in the
    background (which removed the stale lock first and logged it in their own log)."""
    name = build._extension()[0]
    shared = build._build_directory(name)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    private = build._build_directory(name)
    assert private != shared and str(private).startswith(str(tmp_path))
    shutil.copytree(shared, private, ignore=shutil.ignore_patterns("lock", build.BUILD_LOCK),
                    dirs_exist_ok=True)  # (torch made it, empty)
    return private


def _load(timeout, **env):
    return subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


def test_a_lock_left_by_a_killed_build_is_removed(private_build):
    """torch's lock file, as a process killed mid-build leaves it: without the fix the load waits
    on it forever (here: the subprocess times out)."""
    baton = os.path.join(private_build, "lock")
    open(baton, "w").close()
    try:
        r = _load(300)
    finally:
        if os.path.exists(baton):
            os.unlink(baton)
            pytest.fail("the stale lock file is still there")
    assert "ops True" in r.stdout, r.stderr
    assert "left by a build that did not finish" in r.stderr


def test_a_build_held_past_the_wait_falls_back_to_the_reference(private_build):
    fd = os.open(os.path.join(private_build, build.BUILD_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        r = _load(120, **{build.BUILD_WAIT_ENV: "1"})
    finally:
        os.close(fd)
    assert "ops False" in r.stdout, r.stderr
    assert "TimeoutError" in r.stderr and "uses its torch reference" in r.stderr


def _fresh_load(monkeypatch, tmp_path, load):
    """load_ops as a new process runs it, with torch's loader replaced by ``load`` and the build
    directory ``tmp_path`` (the kernels this process loaded stay loaded: torch.ops answers)."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "_fakes", {})  # (registered already; not twice)
    monkeypatch.setattr(build, "_build_directory", lambda name: tmp_path)
    monkeypatch.setattr(cpp, "load", load)
    return build.load_ops()


def test_a_build_says_what_it_builds_where_and_how_long_it_took(monkeypatch, tmp_path, caplog):
    """The first build of a version (no library in its directory) is announced before it starts,
    with where it goes and that it takes minutes, and its time is logged when it ends; a later
    load of that build says nothing at INFO (issue 45: minutes of silence at a server's start)."""
    calls = []

    def fake_load(name, sources, build_directory, **kw):
        calls.append(name)
        (tmp_path / f"{name}.so").write_bytes(b"")  # what torch's loader leaves

    with caplog.at_level(logging.INFO, logger="vllm.csv_decode"):
        assert _fresh_load(monkeypatch, tmp_path, fake_load) is not None
    msgs = [r.getMessage() for r in caplog.records if r.name == "vllm.csv_decode"]
    start = [m for m in msgs if "building" in m]
    end = [m for m in msgs if "built in" in m]
    assert len(calls) == 1 and len(start) == 1 and len(end) == 1, msgs
    assert str(tmp_path) in start[0] and "minutes" in start[0] and str(build.SOURCES[0].parent) in start[0]
    assert str(tmp_path) in end[0] and msgs.index(start[0]) < msgs.index(end[0])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.csv_decode"):
        assert _fresh_load(monkeypatch, tmp_path, fake_load) is not None
    assert len(calls) == 2  # (torch's loader still runs: ninja finds nothing to do)
    assert not [r for r in caplog.records if "build" in r.getMessage()], caplog.text


def test_a_failed_build_is_announced_and_says_why(monkeypatch, tmp_path, caplog):
    def failing_load(name, sources, build_directory, **kw):
        raise RuntimeError("Error building extension 'vllm_csv_cpu': g++ not found")

    with caplog.at_level(logging.INFO, logger="vllm.csv_decode"):
        assert _fresh_load(monkeypatch, tmp_path, failing_load) is None
    assert "building" in caplog.text and "g++ not found" in caplog.text and "torch reference" in caplog.text


def test_build_kernels_command_prints_its_messages_whatever_the_logging(monkeypatch, tmp_path, capfd):
    """`vllm-csv build-kernels` (run.sh's server and scripts/test.sh build through it) prints the
    build's messages on stderr without any logging set-up, and exits 0."""
    from vllm_csv import cli

    def fake_load(name, sources, build_directory, **kw):
        (tmp_path / f"{name}.so").write_bytes(b"")

    _fresh_load(monkeypatch, tmp_path, fake_load)  # (patches in place; loads once)
    monkeypatch.setattr(build, "_state", {})
    log = logging.getLogger("vllm.csv_decode")
    before = (list(log.handlers), log.level, log.propagate)
    assert cli.main(["build-kernels"]) == 0
    err = capfd.readouterr().err
    assert "[vllm-csv] CSV CPU kernels: ready" in err, err
    assert (list(log.handlers), log.level, log.propagate) == before  # (its handler removed)
    (tmp_path / f"{build._extension()[0]}.so").unlink()
    monkeypatch.setattr(build, "_state", {})
    assert cli.main(["build-kernels"]) == 0
    err = capfd.readouterr().err
    assert "[vllm-csv] CSV CPU kernels: building" in err and "[vllm-csv] CSV CPU kernels: built in" in err, err


def test_the_serve_wrapper_builds_the_kernels_before_the_server_starts(monkeypatch):
    """`vllm-csv serve` (run.sh) builds the kernels, with its messages, before it starts
    `vllm serve` on a CPU machine, so that the worker loads them instead of building them."""
    from vllm_csv import serve as srv

    order = []
    monkeypatch.setattr(build, "build_kernels", lambda: order.append("build") or True)
    monkeypatch.setattr(srv, "_vllm_command", lambda: order.append("vllm") or [sys.executable, "-c", "pass"])
    monkeypatch.setattr(srv, "_run", lambda *a: 0)
    srv.serve("M", "127.0.0.1", 1, True, [], 1.0)
    assert order[:2] == ["build", "vllm"]
