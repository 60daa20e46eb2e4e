"""``tests/test_gpu_kernels.py``, ``tests/test_gpu_gumbel_draw.py``, ``tests/test_verify_v2_fused.py`` and ``tests/test_gpu_philox.py``
on a machine without CUDA: in a fresh process started with ``TRITON_INTERPRET=1``, so that Triton (its own library included) is imported in interpreter mode
(this process has imported it already, through vLLM, in compiled mode).

Those runs are Triton's interpreter, pure Python on one core for about six minutes, while the rest
of the suite leaves the second core of a two-core machine mostly idle (CI's: 23 CPU minutes in 27
wall minutes). So in a run of the whole suite they start in the background (:class:`Background`, one
after another on a thread of their own, at the lowest CPU priority: at the default one they slowed
the suite's own two-thread tests and kernel builds as much as they saved, 25:06 against 24:31) at
the first test outside ``tests/e2e`` (whose servers use both cores), and their tests, moved to the
end of the run, collect the results (``tests/conftest.py``); a run of this file alone runs them in
place."""

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

FILES = ("test_gpu_kernels.py", "test_gpu_gumbel_draw.py", "test_verify_v2_fused.py", "test_gpu_philox.py")


def run_interpreted(name: str, live: list | None = None, nice: bool = False) -> subprocess.CompletedProcess:
    """pytest on the test file ``name`` in a fresh process under Triton's interpreter (``live``:
    where to list the process while it runs; ``nice``: at the lowest CPU priority)."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name]
    with subprocess.Popen(cmd, cwd=here, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=(lambda: os.nice(19)) if nice else None) as p:
        if live is not None:
            live.append(p)
        try:
            out, err = p.communicate(timeout=1500)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        finally:
            if live is not None:
                live.remove(p)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


class Background:
    """The interpreted runs of :data:`FILES`, started once (:meth:`start`), one after another;
    :meth:`stop` (the end of the session) drops those not started and kills the one running."""

    futures: dict[str, Future] = {}
    _pool: ThreadPoolExecutor | None = None
    _live: list = []

    @classmethod
    def start(cls) -> None:
        if cls._pool is None and not torch.cuda.is_available():
            cls._pool = ThreadPoolExecutor(1, thread_name_prefix="triton-interpreted")
            cls.futures = {name: cls._pool.submit(run_interpreted, name, cls._live, True) for name in FILES}

    @classmethod
    def stop(cls) -> None:
        if cls._pool is not None:
            cls._pool.shutdown(wait=False, cancel_futures=True)
            for p in list(cls._live):
                p.kill()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA these files run compiled, in process")
@pytest.mark.parametrize("name", FILES)
def test_gpu_kernels_under_the_interpreter(name):
    fut = Background.futures.get(name)
    r = fut.result() if fut is not None else run_interpreted(name)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
