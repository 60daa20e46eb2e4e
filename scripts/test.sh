#!/usr/bin/env bash
# Install everything into ./.venv, then run the whole test suite (CPU; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
# The CPU kernels built here, with their messages, before pytest (which would build them silently)
.venv/bin/vllm-csv build-kernels || echo "vllm-csv tests: the CPU kernels did not build (see above);" \
    "their tests skip and the torch reference runs" >&2
echo "vllm-csv tests: a first run trains a small test model inside pytest (minutes, no output meanwhile);" \
     "later runs reuse it (~/.cache)." >&2
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec .venv/bin/python -m pytest -ra -q "$@"
