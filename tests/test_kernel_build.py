"""The CPU kernels' build lock: a build killed mid-way must not make later loads hang, and a
build held too long by another process must end in the torch reference, said in the log."""

import fcntl
import os
import subprocess
import sys

import pytest

from vllm_csv.ops import build

pytestmark = pytest.mark.skipif(build.load_ops() is None, reason="CPU kernels not built")

LOAD = ("import logging; logging.basicConfig(level=logging.INFO); from vllm_csv.ops import build; "
        "print('ops', build.load_ops() is not None)")


def _build_dir():
    return build._build_directory(build._extension()[0])


def _load(timeout, **env):
    return subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


def test_a_lock_left_by_a_killed_build_is_removed():
    """torch's lock file, as a process killed mid-build leaves it: without the fix the load waits
    on it forever (here: the subprocess times out)."""
    baton = os.path.join(_build_dir(), "lock")
    open(baton, "w").close()
    try:
        r = _load(300)
    finally:
        if os.path.exists(baton):
            os.unlink(baton)
            pytest.fail("the stale lock file is still there")
    assert "ops True" in r.stdout, r.stderr
    assert "left by a build that did not finish" in r.stderr


def test_a_build_held_past_the_wait_falls_back_to_the_reference():
    fd = os.open(os.path.join(_build_dir(), build.BUILD_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        r = _load(120, **{build.BUILD_WAIT_ENV: "1"})
    finally:
        os.close(fd)
    assert "ops False" in r.stdout, r.stderr
    assert "TimeoutError" in r.stderr and "uses its torch reference" in r.stderr
