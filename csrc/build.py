"""setup.py's hook: the CUDA extension ``vllm_csv._C``, only where it can be built."""

from __future__ import annotations

import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["ops.cpp", "int8_screen.cu"]


def cuda_extensions() -> list:
    """``[CUDAExtension]`` when nvcc and a CUDA build of torch are present, else ``[]``."""
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return []
    try:
        import torch
        from torch.utils.cpp_extension import CUDAExtension
    except ImportError:
        return []
    if torch.version.cuda is None:
        return []
    return [CUDAExtension(
        "vllm_csv._C", [os.path.relpath(os.path.join(HERE, s)) for s in SOURCES],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
    )]
