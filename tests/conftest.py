"""The suite's fixtures: a private cache and the torch reference step. The suite runs on
:data:`vllm_csv.testing.threads.TEST_THREADS` threads; its synthetic heads, dense references and
fakes are in :mod:`vllm_csv.testing`."""

import os
import tempfile
from pathlib import Path

# The suite's processes (this one, its background runs) share the cores with each other and with
# the end-to-end servers: OpenMP's idle threads sleep instead of spinning (set before torch loads
# libgomp, which reads it once). Spinning, a 2-thread region whose other thread waits for a core
# burns its own core meanwhile: tests/test_audit_aligned.py beside two busy processes took 19 s
# of CPU (21.8 s wall) spinning, 7.2 s (12.6 s) sleeping. The servers run as users run them
# (tests/e2e/conftest.py, server_env: not inherited).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["VLLM_CSV_TEST_OMP_WAIT"] = "1"

import background  # noqa: E402
import pytest  # noqa: E402

from vllm_csv.testing.threads import use_test_threads  # noqa: E402

use_test_threads()

INTERPRETED = "test_gpu_kernels_interpreted.py"  # its tests collect the interpreted runs



@pytest.hookimpl(trylast=True)  # (after -k / -m deselected what they deselect)
def pytest_collection_modifyitems(config, items):
    """The suite's long subprocess work queued in the background (:mod:`background`): the
    end-to-end tests' run, the :data:`~background.DEFERRED` files' runs (their tests replaced by
    proxies at the end, which report the background outcomes) and the interpreted GPU files'
    runs. Only in a run with other tests to overlap."""
    late = [it for it in items if it.path.name == INTERPRETED]
    others = [it for it in items if background.group_of(it.nodeid) is None and it.path.name != INTERPRETED]
    if not background.enabled() or not others or config.option.collectonly:
        return
    # (the deferred and interpreted files' runs start longest first, whichever kind: background.COST;
    # in collection order, the deferred ones first, a fresh clone's run took 27:40 on the Zen 4
    # against 26:20 longest first, one run each)
    jobs = background.defer(items, config.rootpath, Path(tempfile.mkdtemp(prefix="csv-background-")))
    if late:
        items[:] = [it for it in items if it.path.name != INTERPRETED] + late
        jobs.update({name: background.interpreted_job(name) for name in background.INTERPRETED})
    background.Jobs.start(jobs)


def pytest_runtest_logreport(report):
    """In a background run: each report, for the session that waits on it."""
    if background.REPORT_ENV in os.environ:
        background.record(report)


def pytest_terminal_summary(terminalreporter):
    """The background directory runs' slowest tests (their proxies' times here are waits)."""
    background.summary(terminalreporter.write_line)


def pytest_sessionfinish(session):
    """A session that ends early (``-x``) does not wait for the background runs."""
    background.Jobs.stop()


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Tests never write to the user's cache."""
    monkeypatch.setenv("VLLM_CSV_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def torch_reference_step(monkeypatch):
    """The certified step's torch reference instead of the fused CPU kernels
    (:mod:`vllm_csv.ops.rows`, :mod:`vllm_csv.ops.select`, :mod:`vllm_csv.ops.step`), for tests
    that mutate the reference's Python arithmetic (the kernels are checked against that reference
    in ``tests/test_rows.py``, ``tests/test_select.py`` and ``tests/test_step.py``)."""
    from vllm_csv.ops import build

    monkeypatch.setitem(build._state, "ops", None)


@pytest.fixture
def reduced_precision_fp32(monkeypatch):
    """torch's CPU fp32 matmuls set to bf16 passes (``mkldnn.matmul.fp32_precision = "bf16"``, as
    ``VLLM_FLOAT32_MATMUL_PRECISION=medium`` asks), and what oneDNN then does on an AMX or
    AVX512-BF16 CPU emulated here (this CPU may keep fp32 at that setting): fp32 operands of ``@``
    rounded to bf16 while the setting is on."""
    import torch

    from vllm_csv.fp import fp32_matmul_is_ieee

    real = torch.Tensor.__matmul__

    def matmul(a, b):
        if a.dtype == torch.float32 and b.dtype == torch.float32 and not fp32_matmul_is_ieee(a.device.type):
            return real(a.bfloat16().float(), b.bfloat16().float())
        return real(a, b)

    old = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    monkeypatch.setattr(torch.Tensor, "__matmul__", matmul)
    yield real
    torch.backends.mkldnn.matmul.fp32_precision = old
