#!/usr/bin/env bash
# Install everything into ./.venv, then run the whole test suite (CPU; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
echo "vllm-csv tests: a first run trains a small test model inside pytest (minutes, no output meanwhile)" \
     "and builds the CPU kernels (about a minute); later runs reuse both (~/.cache)." >&2
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec .venv/bin/python -m pytest -ra -q "$@"
