"""Builds the optional CUDA extension ``vllm_csv._C`` where nvcc and a CUDA torch exist.

Everywhere else (CPU machines, pip's isolated build environment without torch) the
package installs pure-Python and the torch reference path runs. To build the kernels:
``pip install --no-build-isolation -e .`` on a machine with CUDA torch and nvcc.
"""

import os
import sys

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("VLLM_CSV_NO_CUDA") != "1":
    try:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc"))
        from build import cuda_extensions  # csrc/build.py: [] unless nvcc and CUDA torch are present

        ext_modules = cuda_extensions()
        if ext_modules:
            from torch.utils.cpp_extension import BuildExtension

            cmdclass = {"build_ext": BuildExtension}
    except ImportError:  # no torch in the build environment: pure-Python install
        ext_modules = []

setup(ext_modules=ext_modules, cmdclass=cmdclass)
