"""The suite's fixtures: a private cache and the torch reference step. The suite runs on
:data:`vllm_csv.testing.threads.TEST_THREADS` threads; its synthetic heads, dense references and
fakes are in :mod:`vllm_csv.testing`."""

import pytest

from vllm_csv.testing.threads import use_test_threads

use_test_threads()


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
