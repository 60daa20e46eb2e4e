"""The suite's long subprocess work, run in background processes while the rest of a whole-suite
run goes on in the session. Measured on a quiet 2-core Xeon (fresh clones, 2026-11-30): with the
end-to-end tests in the session, pytest took 26:34; with them beside the unit tests (below), 26:50:
both keep the two cores ~99% busy, so the order decides little and the suite's CPU work decides the
time (the parallel run used ~6 CPU-minutes more: oversubscribed cores). On the 2-core Zen 4
(fresh clones of main, `bash .ci/run`, 2026-11-30): 27:40 in all (pytest 24:08, 43.4 CPU-minutes);
with the runs started longest first (:data:`COST`) 26:20 (23:22); and with OpenMP's idle threads
sleeping in the suite's processes (``tests/conftest.py``) 21:53 (18:25, 32.8 CPU-minutes).

Three kinds of job, queued at the end of collection (``tests/conftest.py``):

- :data:`WHOLE`: a directory of tests (``tests/e2e``) run in one pytest process, so that its
  package-scoped servers are shared as in place; at normal priority and on a thread of its own,
  first (alone it is the longest run). The session's unit tests run beside it.
- :data:`DEFERRED`: test files whose time is mostly subprocesses of their own (vLLM's V2 sampler
  code under Triton's interpreter, about five minutes of one core, and again on vLLM 0.33.0's
  package, about three; the CPU kernels rebuilt and tested capped at AVX2, about a minute): a
  pytest process each, at the lowest CPU priority, two at a time, longest first (:data:`COST`).
- :data:`INTERPRETED`: GPU test files run whole under Triton's interpreter in a fresh process
  (``TRITON_INTERPRET=1``; this process has imported Triton compiled, through vLLM), with the
  deferred files; their results are ``tests/test_gpu_kernels_interpreted.py``'s tests.

A background run of :data:`WHOLE` or :data:`DEFERRED` writes one line per test report
(:data:`REPORT_ENV`, :func:`record`). In the session each of its tests is replaced by a
:class:`Proxy` at the end of the run (same node id, markers and location, no fixtures: no server
starts twice) that reports the background outcome of its node id, a failure's text included
(:func:`outcome`); the session's summary shows the whole-directory runs' slowest tests
(:func:`summary`).

A run of only those tests (``pytest tests/e2e``) runs them in place, and so does every run with
``VLLM_CSV_TEST_BACKGROUND=0`` (for ``--pdb`` and the like). A session that ends early (``-x``)
does not wait: :meth:`Jobs.stop` drops the queued jobs and kills the running ones with their
process groups (servers included); SIGTERM to the session does the same, and a background run
dies with the session's process however that dies.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
INTERPRETED = ("test_gpu_kernels.py", "test_gpu_gumbel_draw.py", "test_verify_v2_fused.py", "test_gpu_philox.py")
DEFERRED = ("test_sampler_hook_v2.py", "test_spec_decode_v2.py", "test_verify_v2.py", "test_cpu_isa.py",
            "test_vllm033.py")
WHOLE = ("e2e",)  # directories of tests/ run whole, each in one background process
# One core's seconds each deferred or interpreted file took alone (a quiet 2-core Zen 4, 2026-11-30,
# `pytest tests/FILE`): the runs start longest first (:meth:`Jobs.start`), so that the last to end,
# which the session waits for once its own tests are done, are short ones. In file order a whole
# run waited 277 s at its end for test_vllm033.py, started fifth, alone on a core.
COST = {"test_vllm033.py": 201, "test_gpu_kernels.py": 189, "test_sampler_hook_v2.py": 144,
        "test_verify_v2_fused.py": 105, "test_spec_decode_v2.py": 100, "test_gpu_gumbel_draw.py": 92,
        "test_verify_v2.py": 48, "test_cpu_isa.py": 37, "test_gpu_philox.py": 5}
REPORT_ENV = "VLLM_CSV_TEST_REPORT"  # set in a background run: where its reports go (a line each)
OFF_ENV = "VLLM_CSV_TEST_BACKGROUND"  # "0": every test in place
TIMEOUT = 1500  # seconds a background run of a file may take
WHOLE_TIMEOUT = 3600  # and of a directory (tests/e2e: 23 minutes alone on CI's two cores)
DURATIONS = 15  # the slowest tests of a directory's run, shown in the session's summary
PYTEST = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider")  # every background run's command


def enabled() -> bool:
    """Whether this session may run work in the background: not switched off, not itself a
    background run, and no CUDA (there the interpreted files run compiled, in process)."""
    import torch

    return os.environ.get(OFF_ENV, "1") != "0" and REPORT_ENV not in os.environ and not torch.cuda.is_available()


def group_of(nodeid: str) -> str | None:
    """The background run a test (``nodeid``, relative to the root) belongs to: its directory's
    (:data:`WHOLE`), its file's (:data:`DEFERRED`), or None."""
    parts = Path(nodeid.split("::")[0]).parts
    whole = [d for d in WHOLE if d in parts[:-1]]
    return whole[0] if whole else parts[-1] if parts and parts[-1] in DEFERRED else None


@dataclass
class Job:
    """A background run: ``cmd`` in ``cwd`` with ``env``; ``nice``: at the lowest CPU priority."""

    cmd: list[str]
    env: dict = field(repr=False)
    cwd: Path
    nice: bool = True
    timeout: float = TIMEOUT


def run(job: Job, live: list | None = None) -> subprocess.CompletedProcess:
    """``job``'s process, waited for (``live``: where to list it while it runs). Past its timeout
    it is killed with its process group (a directory's servers included)."""
    with subprocess.Popen(job.cmd, cwd=job.cwd, env=job.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True,
                          preexec_fn=_lowest_priority if job.nice else _die_with_parent) as p:
        if live is not None:
            live.append(p)
        try:
            out, err = p.communicate(timeout=job.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(p)
            out, err = p.communicate()
            err += f"\n(killed after {job.timeout:.0f} s)"
        finally:
            if live is not None:
                live.remove(p)
    return subprocess.CompletedProcess(job.cmd, p.returncode, out, err)


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        p.kill()


def _die_with_parent() -> None:
    """(In the child) SIGKILL when the session's process dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _lowest_priority() -> None:
    """(In the child, a session of its own) the lowest CPU priority: nice 19, for the process and
    for its session's autogroup (with the kernel's autogroup scheduling, on by default, CPU time
    is shared between sessions first, and a process's nice counts only within its session: a
    nice run in a new session took a full share beside the unit tests)."""
    os.nice(19)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except OSError:  # (no autogroups: the nice value alone counts)
        pass
    _die_with_parent()


def interpreted_job(name: str) -> Job:
    """pytest on the test file ``name`` in a fresh process under Triton's interpreter."""
    return Job([*PYTEST, name], dict(os.environ, TRITON_INTERPRET="1"), HERE)


def deferred_job(nodeids: list[str], rootdir: Path, report: Path, whole: bool = False) -> Job:
    """pytest on ``nodeids`` (relative to ``rootdir``) in a fresh process that writes its reports
    to ``report``; ``whole``: a directory's run (normal priority, its slowest tests listed)."""
    cmd = [*PYTEST, *([f"--durations={DURATIONS}"] if whole else []), *nodeids]
    env = dict(os.environ, **{REPORT_ENV: str(report)})
    return Job(cmd, env, rootdir, nice=not whole, timeout=WHOLE_TIMEOUT if whole else TIMEOUT)


def queue_order(jobs: dict[str, Job]) -> list[str]:
    """The order ``jobs`` start in: the directories (not nice) first, then the longest
    (:data:`COST`; a file it does not list last), ties in the given order."""
    return sorted(jobs, key=lambda name: (jobs[name].nice, -COST.get(name, 0)))


class Jobs:
    """The session's background jobs by name, started once (:meth:`start`): the directories' each
    on a thread of its own, the others two at a time, longest first (:data:`COST`)."""

    futures: dict[str, Future] = {}
    reports: dict[str, tuple[str, Path]] = {}  # a background test's node id: (its job, its report)
    _pool: ThreadPoolExecutor | None = None
    _live: list = []

    @classmethod
    def start(cls, jobs: dict[str, Job]) -> None:
        if cls._pool is None and jobs:
            first = queue_order(jobs)
            cls._pool = ThreadPoolExecutor(2 + sum(not j.nice for j in jobs.values()), thread_name_prefix="csv-background")
            cls.futures = {name: cls._pool.submit(run, jobs[name], cls._live) for name in first}
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
                _kill_group(p)


# ---- the background run's side ---------------------------------------------------------------
def record(report) -> None:
    """In a background run: one line for ``report`` (a ``TestReport``) in :data:`REPORT_ENV`'s file
    (not for the tests of a pytest run that a background test starts: they inherit the variable,
    and are not :func:`group_of` any run)."""
    if (report.passed and report.when != "call") or group_of(report.nodeid) is None:
        return
    line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}
    if report.skipped:
        line["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    elif report.failed:
        line["text"] = report.longreprtext[-12000:]
    with open(os.environ[REPORT_ENV], "a") as f:
        f.write(json.dumps(line) + "\n")


# ---- the session's side -----------------------------------------------------------------------
class Proxy(pytest.Item):
    """Stands in the session for a test run in the background: the same node id, markers (a
    ``skipif`` skips it here as there) and location, and no fixtures; its outcome is the
    background run's (:func:`outcome`)."""

    def __init__(self, *, real: pytest.Item, **kw):
        super().__init__(**kw)
        self.own_markers.extend(real.own_markers)
        self.keywords.update(real.keywords)
        self._info = real.reportinfo()

    def runtest(self) -> None:
        outcome(self)

    def reportinfo(self):
        return self._info


def defer(items: list, rootdir: Path, tmp: Path) -> dict[str, Job]:
    """Replace the items of :data:`WHOLE` directories and :data:`DEFERRED` files by
    :class:`Proxy` items at the end of ``items`` (in place; the directories' last) and return one
    background job per directory and file (its reports under ``tmp``)."""
    by_group: dict[str, list] = {}
    for it in items:
        group = group_of(it.nodeid)
        if group is not None:
            by_group.setdefault(group, []).append(it)
    moved = {it.nodeid for group in by_group.values() for it in group}
    order = sorted(by_group, key=lambda g: g in WHOLE)
    items[:] = [it for it in items if it.nodeid not in moved] + [
        Proxy.from_parent(it.parent, name=it.name, real=it) for g in order for it in by_group[g]]
    jobs = {}
    for name, group in by_group.items():
        report = tmp / f"{name}.jsonl"
        for it in group:
            Jobs.reports[it.nodeid] = (name, report)
        jobs[name] = deferred_job([it.nodeid for it in group], rootdir, report, whole=name in WHOLE)
    return jobs


def outcome(item) -> None:
    """For a background test ``item`` (waited for): its background outcome, reported as this
    test's (a pass returns; a skip or a failure raised here)."""
    name, report = Jobs.reports[item.nodeid]
    done = Jobs.result(name)
    lines = [json.loads(s) for s in report.read_text().splitlines()] if report.exists() else []
    mine = [r for r in lines if r["nodeid"] == item.nodeid]
    for r in mine:
        if r["outcome"] == "failed":
            pytest.fail(f"(run in the background, {r['when']}) {r['text']}", pytrace=False)
        if r["outcome"] == "skipped":
            pytest.skip(r["reason"])
    if any(r["when"] == "call" and r["outcome"] == "passed" for r in mine):
        return
    tail = (done.stdout[-6000:] + done.stderr[-3000:]) if done is not None else "(not run)"
    pytest.fail(f"the background run of {name} reported nothing for this test "
                f"(exit {done.returncode if done is not None else None}):\n{tail}", pytrace=False)


def summary(write) -> None:
    """The slowest tests of each finished directory run (its ``--durations`` section), through
    ``write`` (a line at a time): where CI's time goes, in every log."""
    for name in WHOLE:
        fut = Jobs.futures.get(name)
        if fut is None or not fut.done() or fut.cancelled():
            continue
        lines = fut.result().stdout.splitlines()
        start = next((i for i, ln in enumerate(lines) if "slowest" in ln and "durations" in ln), None)
        if start is None:
            continue
        write(f"background run of tests/{name}: {lines[start].strip('= ')}")
        for ln in lines[start + 1:]:
            if not re.match(r"\d+\.\d+s (setup|call|teardown) ", ln):
                break
            write(ln)
