"""The suite's background runs (``tests/background.py``): a background test reports its background
run's outcome, a failure's text included, and a test the background run said nothing of fails; a
directory's tests run in one process with their fixtures, which the session never sets up."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import background
import pytest

X = background.DEFERRED[0]


def _report(tmp_path, monkeypatch, *reports):
    """``reports`` recorded as a deferred run records them; the file they went to."""
    path = tmp_path / "r.jsonl"
    monkeypatch.setenv(background.REPORT_ENV, str(path))
    for r in reports:
        background.record(r)
    return path


def _test_report(nodeid, when, outcome, longrepr=None, text=""):
    return SimpleNamespace(nodeid=nodeid, when=when, outcome=outcome, passed=outcome == "passed",
                           skipped=outcome == "skipped", failed=outcome == "failed", longrepr=longrepr,
                           longreprtext=text)


@pytest.fixture
def deferred(tmp_path, monkeypatch):
    """Items of a deferred file whose background run has ended (exit 1, some output)."""
    done = subprocess.CompletedProcess([], 1, "background stdout", "background stderr")
    monkeypatch.setattr(background.Jobs, "futures", {X: SimpleNamespace(result=lambda: done)})
    monkeypatch.setattr(background.Jobs, "reports", {})

    return lambda name: SimpleNamespace(nodeid=f"tests/{X}::{name}", path=tmp_path / X)


def test_each_outcome_is_reported_as_the_tests_own(tmp_path, monkeypatch, deferred):
    path = _report(tmp_path, monkeypatch,
                   _test_report(f"tests/{X}::ok", "setup", "passed"),
                   _test_report(f"tests/{X}::ok", "call", "passed"),
                   _test_report(f"tests/{X}::bad", "call", "failed", text="assert 1 == 2"),
                   _test_report(f"tests/{X}::skip", "setup", "skipped", ("f", 1, "Skipped: no GPU")),
                   _test_report(f"tests/{X}::teardown", "call", "passed"),
                   _test_report(f"tests/{X}::teardown", "teardown", "failed", text="leaked"),
                   _test_report("tests/test_rows.py::nested", "call", "failed", text="a nested run's"))
    assert len(path.read_text().splitlines()) == 5  # neither passed setups nor a nested run's tests
    for name in ("ok", "bad", "skip", "teardown", "silent"):
        background.Jobs.reports[f"tests/{X}::{name}"] = (X, path)
    assert background.outcome(deferred("ok")) is None
    with pytest.raises(pytest.fail.Exception, match="assert 1 == 2"):
        background.outcome(deferred("bad"))
    with pytest.raises(pytest.skip.Exception, match="no GPU"):
        background.outcome(deferred("skip"))
    with pytest.raises(pytest.fail.Exception, match="(?s)teardown.*leaked"):
        background.outcome(deferred("teardown"))
    with pytest.raises(pytest.fail.Exception, match="(?s)reported nothing.*exit 1.*background stdout"):
        background.outcome(deferred("silent"))


def test_group_of_each_test():
    assert background.group_of(f"tests/{X}::t[a/b]") == X
    assert background.group_of("tests/e2e/test_serve.py::test_x[a]") == "e2e"
    assert background.group_of("tests/e2e/sub/test_y.py::C::t") == "e2e"
    assert background.group_of("tests/test_rows.py::test_e2e") is None
    assert background.group_of("tests/test_e2e.py::t") is None


def test_background_runs_start_directories_first_then_longest_first():
    """The session waits, at its end, for the background runs still going: the long ones start
    first, so that those are short (``COST``); every deferred and interpreted file has a cost."""
    job = lambda nice: background.Job([], {}, background.HERE, nice=nice)  # noqa: E731
    names = ["test_cpu_isa.py", "unlisted.py", "test_vllm033.py", "e2e", "test_gpu_kernels.py"]
    jobs = {n: job(n != "e2e") for n in names}
    assert background.queue_order(jobs) == ["e2e", "test_vllm033.py", "test_gpu_kernels.py", "test_cpu_isa.py",
                                            "unlisted.py"]
    assert set(background.DEFERRED) | set(background.INTERPRETED) <= set(background.COST)


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="no autogroup scheduling here")
def test_a_nice_run_is_nice_in_its_own_autogroup(tmp_path):
    """A run at the lowest priority (a session of its own) yields within its autogroup and as
    one: its autogroup's nice is 19 (else it takes a full share beside the session's tests)."""
    code = "import os; print(os.nice(0), open('/proc/self/autogroup').read().split()[-1])"
    r = background.run(background.Job([sys.executable, "-c", code], dict(os.environ), tmp_path))
    assert r.returncode == 0 and r.stdout.split() == ["19", "19"], (r.stdout, r.stderr)


def _suite(root, plain: str, deferred: str) -> None:
    """A project at ``root`` whose ``tests/`` holds this suite's conftest and background module, a
    test file ``plain`` and a file named as the first deferred file holding ``deferred``."""
    d = root / "tests"
    d.mkdir()
    (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    for name in ("conftest.py", "background.py"):
        (d / name).write_text((background.HERE / name).read_text())
    (d / "test_a.py").write_text(plain)
    (d / background.DEFERRED[0]).write_text(deferred)


def _env() -> dict:
    """This environment, less a deferred run's report variable (a session, not a deferred run) and
    the off switch (the temporary session tests the background runs, also from a suite run with
    ``VLLM_CSV_TEST_BACKGROUND=0``, where these tests failed)."""
    return {k: v for k, v in os.environ.items() if k not in (background.REPORT_ENV, background.OFF_ENV)}


def _failing_session(root) -> tuple[str, list[str]]:
    """A whole session (``-v``) of the suite at ``root``, which must fail: its output, and the
    test files in the order their tests ran."""
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "tests"],
                       cwd=root, capture_output=True, text=True, timeout=600, env=_env())
    out = p.stdout
    assert p.returncode == 1, out + p.stderr
    return out, [s.split("::")[0] for s in out.splitlines() if s.startswith("tests/") and "::" in s]


def test_a_deferred_file_runs_in_the_background_and_its_failure_reaches_the_session(tmp_path):
    """A whole session (this conftest) over a passing test and a copy of a deferred file holding a
    failing test: the deferred tests move to the end, run in a pytest process of their own, and
    their outcomes are the session's."""
    name = background.DEFERRED[0]
    _suite(tmp_path, "def test_here():\n    pass\n",
           "import os\n\n"
           "def test_passes_away():\n    assert os.environ.get('VLLM_CSV_TEST_REPORT')\n\n"
           "def test_fails_away():\n    assert os.getpid() == -1, 'ran in the background'\n")
    out, order = _failing_session(tmp_path)
    assert order[0] == "tests/test_a.py" and order[-1] == f"tests/{name}", out
    assert f"tests/{name}::test_passes_away PASSED" in out, out
    assert f"tests/{name}::test_fails_away FAILED" in out and "ran in the background" in out, out


def test_a_directory_runs_whole_in_one_background_process(tmp_path):
    """``tests/e2e``'s tests run in one background pytest process, which sets their
    package-scoped fixture up once (the session never does: its proxies have no fixtures), at
    the end of the run; their outcomes, a failure's text included, are the session's, and its
    summary lists the run's slowest tests."""
    _suite(tmp_path, "def test_here():\n    pass\n", "def test_away():\n    pass\n")
    d = tmp_path / "tests" / "e2e"
    d.mkdir()
    (d / "__init__.py").write_text("")
    setups = tmp_path / "setups"
    (d / "conftest.py").write_text(
        "import os\nimport pytest\n\n\n@pytest.fixture(scope='package')\ndef server():\n"
        f"    open({str(setups)!r}, 'a').write(os.environ.get('VLLM_CSV_TEST_REPORT', 'session') + '\\n')\n"
        "    return os.getpid()\n")
    (d / "test_x.py").write_text(
        "import os\n\n\ndef test_one(server):\n    assert server == os.getpid()\n\n\n"
        "def test_two(server):\n    assert server == os.getpid()\n\n\n"
        "def test_fails(server):\n    assert server == -1, 'failed in the directory run'\n")
    out, order = _failing_session(tmp_path)
    assert order[0] == "tests/test_a.py" and order[-3:] == ["tests/e2e/test_x.py"] * 3, out
    assert "tests/e2e/test_x.py::test_one PASSED" in out and "tests/e2e/test_x.py::test_two PASSED" in out, out
    assert "tests/e2e/test_x.py::test_fails FAILED" in out and "failed in the directory run" in out, out
    where = setups.read_text().splitlines()
    assert len(where) == 1 and where[0].endswith("e2e.jsonl"), where  # once, in the background run
    assert "background run of tests/e2e: slowest" in out, out


def test_a_session_stopped_by_sigterm_takes_its_background_runs_with_it(tmp_path):
    """A cancelled CI run (SIGTERM to pytest) leaves no background run behind."""
    import signal
    import time

    pid_file = tmp_path / "pid"
    _suite(tmp_path, "import time\n\ndef test_here():\n    time.sleep(120)\n",
           f"import os, time\n\ndef test_sleeps():\n    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
           "    time.sleep(300)\n")
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        pid = int(pid_file.read_text())
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{pid}"), "the background run outlived its session"
    finally:
        p.kill()
