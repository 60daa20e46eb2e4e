#!/usr/bin/env bash
# Install everything into ./.venv, then run the whole test suite (CPU; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
# The CPU kernels built here, with their messages, before pytest (which would build them silently)
.venv/bin/vllm-csv build-kernels || echo "vllm-csv tests: the CPU kernels did not build (see above);" \
    "their tests skip and the torch reference runs" >&2
# The end-to-end tests' model, trained here with a progress bar before the whole suite (inside
# pytest its training showed nothing for ~12 minutes); a run of chosen tests trains it only if
# one of them needs it (inside pytest, silently)
if [ $# -eq 0 ]; then
    echo "vllm-csv tests: the end-to-end tests' model (trained once: minutes on a first run; cached in" \
         "~/.cache/vllm_csv/models)" >&2
    .venv/bin/python -c "from vllm_csv.demo_model import ensure_test_model; print('[vllm-csv] test model:', ensure_test_model())" >&2 \
        || echo "vllm-csv tests: training the test model failed (see above); the end-to-end tests will try again" >&2
    # vLLM 0.33.0's wheel, for tests/test_vllm033.py (fetched once, 336 MB, kept in ~/.cache/vllm-csv)
    .venv/bin/python tests/vllm_033/wheel_033.py >/dev/null \
        || echo "vllm-csv tests: the vLLM 0.33.0 wheel could not be fetched (see above); its tests will try again" >&2
fi
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# (--durations: where CI's time goes, in every log; CI must stay under ~25 minutes)
exec .venv/bin/python -m pytest -ra -q --durations=25 "$@"
