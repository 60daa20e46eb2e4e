"""``tests/test_gpu_kernels.py``, ``tests/test_gpu_gumbel_draw.py``, ``tests/test_verify_v2_fused.py`` and ``tests/test_gpu_philox.py``
on a machine without CUDA: in a fresh process started with ``TRITON_INTERPRET=1``, so that Triton (its own library included) is imported in interpreter mode
(this process has imported it already, through vLLM, in compiled mode).

Those runs are Triton's interpreter, pure Python on one core for about six minutes: in a run of the
whole suite they start in the background at the end of collection (:mod:`background`) and these
tests collect their results; a run of this file alone runs them in place."""

import pytest
import torch

pytest.importorskip("triton")

from background import INTERPRETED as FILES, Jobs, interpreted_job, run  # noqa: E402


def run_interpreted(name: str):
    """pytest on the test file ``name`` in a fresh process under Triton's interpreter."""
    return run(interpreted_job(name))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA these files run compiled, in process")
@pytest.mark.parametrize("name", FILES)
def test_gpu_kernels_under_the_interpreter(name):
    r = Jobs.result(name) or run_interpreted(name)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
