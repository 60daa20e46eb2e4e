"""The suite's single-core subprocess work, run in background processes at the lowest CPU priority
while the rest of a whole-suite run goes on: the second core of a two-core machine is idle for
much of it (a fresh-clone ``bash .ci/run`` at ``8221ba2`` on CI's kind of machine: pytest's 21
minutes kept the two cores 79% busy on average, 50-75% during the end-to-end servers'
start-ups; the interpreted runs, then started at the first test outside ``tests/e2e``, kept
the session waiting 77 s at its end, and the files below took about five minutes in place).

Two kinds of job, queued at the end of collection (``tests/conftest.py``) on two threads:

- :data:`INTERPRETED`: GPU test files run whole under Triton's interpreter in a fresh process
  (``TRITON_INTERPRET=1``; this process has imported Triton compiled, through vLLM); their
  results are ``tests/test_gpu_kernels_interpreted.py``'s tests.
- :data:`DEFERRED`: test files whose time is mostly subprocesses of their own (vLLM's V2 sampler
  code under Triton's interpreter, about five minutes of one core; the CPU kernels rebuilt and
  tested capped at AVX2, about a minute). Their selected
  tests run in a pytest process of their own per file, which writes one line per test report
  (:data:`REPORT_ENV`); in the session the same tests move to the end of the run, set up their
  fixtures and report the background outcome of their own node id, a failure's text included
  (:func:`outcome`).

A run of only those files (``pytest tests/test_verify_v2.py``) runs them in place, and so does
every run with ``VLLM_CSV_TEST_BACKGROUND=0`` (for ``--pdb`` and the like). A session that
ends early (``-x``) does not wait: :meth:`Jobs.stop` drops the queued jobs and kills the
running ones with their process groups; SIGTERM to the session does the same, and a background
run dies with the session's process however that dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
INTERPRETED = ("test_gpu_kernels.py", "test_gpu_gumbel_draw.py", "test_verify_v2_fused.py", "test_gpu_philox.py")
DEFERRED = ("test_sampler_hook_v2.py", "test_spec_decode_v2.py", "test_verify_v2.py", "test_cpu_isa.py")
REPORT_ENV = "VLLM_CSV_TEST_REPORT"  # set in a deferred run: where its reports go (a line each)
OFF_ENV = "VLLM_CSV_TEST_BACKGROUND"  # "0": every test in place
TIMEOUT = 1500  # seconds a background run may take


def enabled() -> bool:
    """Whether this session may run work in the background: not switched off, not itself a
    background run, and no CUDA (there the interpreted files run compiled, in process)."""
    import torch

    return os.environ.get(OFF_ENV, "1") != "0" and REPORT_ENV not in os.environ and not torch.cuda.is_available()


def run(cmd: list[str], env: dict, cwd: Path, live: list | None = None, nice: bool = False) -> subprocess.CompletedProcess:
    """``cmd`` in ``cwd`` with ``env`` (``live``: where to list the process while it runs;
    ``nice``: at the lowest CPU priority)."""
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, preexec_fn=_lowest_priority if nice else _die_with_parent) as p:
        if live is not None:
            live.append(p)
        try:
            out, err = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        finally:
            if live is not None:
                live.remove(p)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _die_with_parent() -> None:
    """(In the child) SIGKILL when the session's process dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _lowest_priority() -> None:
    os.nice(19)
    _die_with_parent()


def interpreted_job(name: str) -> tuple[list[str], dict, Path]:
    """pytest on the test file ``name`` in a fresh process under Triton's interpreter."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name]
    return cmd, dict(os.environ, TRITON_INTERPRET="1"), HERE


def deferred_job(nodeids: list[str], rootdir: Path, report: Path) -> tuple[list[str], dict, Path]:
    """pytest on ``nodeids`` (relative to ``rootdir``) in a fresh process that writes its
    reports to ``report``."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodeids]
    return cmd, dict(os.environ, **{REPORT_ENV: str(report)}), rootdir


class Jobs:
    """The session's background jobs by name, started once (:meth:`start`), two at a time."""

    futures: dict[str, Future] = {}
    reports: dict[str, Path] = {}  # a deferred node id: its file's report
    _pool: ThreadPoolExecutor | None = None
    _live: list = []

    @classmethod
    def start(cls, jobs: dict[str, tuple[list[str], dict, Path]]) -> None:
        if cls._pool is None and jobs:
            cls._pool = ThreadPoolExecutor(2, thread_name_prefix="csv-background")
            cls.futures = {name: cls._pool.submit(run, *job, cls._live, True) for name, job in jobs.items()}
            # a session stopped by SIGTERM (a cancelled CI run) takes its background runs with it
            signal.signal(signal.SIGTERM, lambda *_: (cls.stop(), os._exit(128 + signal.SIGTERM)))

    @classmethod
    def result(cls, name: str) -> subprocess.CompletedProcess | None:
        """The finished job ``name`` (waited for), or None where none was started."""
        fut = cls.futures.get(name)
        return fut.result() if fut is not None else None

    @classmethod
    def stop(cls) -> None:
        if cls._pool is not None:
            cls._pool.shutdown(wait=False, cancel_futures=True)
            for p in list(cls._live):  # (each run in its own process group: its subprocesses too)
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()


# ---- deferred files: the background run's side --------------------------------------------
def record(report) -> None:
    """In a deferred run: one line for ``report`` (a ``TestReport``) in :data:`REPORT_ENV`'s file
    (not for the tests of a pytest run that a deferred test starts: they inherit the variable)."""
    if (report.passed and report.when != "call") or Path(report.nodeid.split("::")[0]).name not in DEFERRED:
        return
    line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}
    if report.skipped:
        line["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    elif report.failed:
        line["text"] = report.longreprtext[-12000:]
    with open(os.environ[REPORT_ENV], "a") as f:
        f.write(json.dumps(line) + "\n")


# ---- deferred files: the session's side -----------------------------------------------------
def defer(items: list, rootdir: Path, tmp: Path) -> dict[str, tuple[list[str], dict, Path]]:
    """Move the items of :data:`DEFERRED` files to the end of ``items`` (in place) and return one
    background job per file (its reports under ``tmp``)."""
    by_file: dict[str, list] = {}
    for it in items:
        if it.path.name in DEFERRED:
            by_file.setdefault(it.path.name, []).append(it)
    moved = {it.nodeid for group in by_file.values() for it in group}
    items[:] = [it for it in items if it.nodeid not in moved] + [it for group in by_file.values() for it in group]
    jobs = {}
    for name, group in by_file.items():
        report = tmp / f"{name}.jsonl"
        for it in group:
            Jobs.reports[it.nodeid] = report
        jobs[name] = deferred_job([it.nodeid for it in group], rootdir, report)
    return jobs


def outcome(item) -> bool:
    """For a deferred ``item``: its background outcome, reported as this test's (True: passed;
    a skip or a failure raised here). False where ``item`` was not deferred."""
    report = Jobs.reports.get(item.nodeid)
    if report is None:
        return False
    done = Jobs.result(item.path.name)
    lines = [json.loads(s) for s in report.read_text().splitlines()] if report.exists() else []
    mine = [r for r in lines if r["nodeid"] == item.nodeid]
    for r in mine:
        if r["outcome"] == "failed":
            pytest.fail(f"(run in the background, {r['when']}) {r['text']}", pytrace=False)
        if r["outcome"] == "skipped":
            pytest.skip(r["reason"])
    if any(r["when"] == "call" and r["outcome"] == "passed" for r in mine):
        return True
    tail = (done.stdout[-6000:] + done.stderr[-3000:]) if done is not None else "(not run)"
    pytest.fail(f"the background run of {item.path.name} reported nothing for this test "
                f"(exit {done.returncode if done is not None else None}):\n{tail}", pytrace=False)
