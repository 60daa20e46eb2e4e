"""``tests/test_gpu_kernels.py``, ``tests/test_gpu_gumbel_draw.py``, ``tests/test_verify_v2_fused.py`` and ``tests/test_gpu_philox.py``
on a machine without CUDA: in a fresh process started with ``TRITON_INTERPRET=1``, so that Triton (its own library included) is imported in interpreter mode
(this process has imported it already, through vLLM, in compiled mode)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA these files run compiled, in process")
@pytest.mark.parametrize("name", ["test_gpu_kernels.py", "test_gpu_gumbel_draw.py", "test_verify_v2_fused.py",
                                  "test_gpu_philox.py"])
def test_gpu_kernels_under_the_interpreter(name):
    here = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name],
                       cwd=here, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
