#!/usr/bin/env bash
# On a CUDA machine with torch and Triton (no vLLM, no network needed): the fused GPU step's
# benchmark and audit (benchmarks/gpu_step.py), its tests compiled for the GPU, then the dense
# engine's arithmetic there (benchmarks/gpu_arithmetic.py, issue 42), then the V2 temperature draw
# on the device (tests/test_gpu_gumbel_draw.py compiled, benchmarks/v2_fused_draw_gpu.py: head +
# sample against the dense V2 step at B = 1 and 8; RUN_V2_DRAW=0 skips it). Results go to
# $OUT (or ./results/gpu). Budget: under 8 minutes on an H100 (each part under its own timeout).
# Usage: VLLM_CSV_COMMIT=<sha> bash benchmarks/run_gpu.sh [gpu_step.py args]
# RUN_LEGACY=1 also builds csrc/ and runs the earlier screen benchmarks and CUDA tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export VLLM_CSV_COMMIT=${VLLM_CSV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -c "import vllm_csv.gpu.step" || exit 1
if [ "${ONLY_V2_DRAW:-0}" != 1 ]; then  # ONLY_V2_DRAW=1: the V2 draw part alone (issue 44), under 5 minutes
T0=$SECONDS
timeout ${STEP_TIMEOUT:-330} python3 benchmarks/gpu_step.py --json "$OUT/gpu_step.json" "$@" 2>&1 | tee "$OUT/gpu_step.log"
echo "gpu_step.py: $((SECONDS - T0)) s"
T1=$SECONDS
VLLM_CSV_GPU_TUNE=0 timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu_kernels.py 2>&1 \
    | tee "$OUT/pytest_gpu.log" | tail -25
echo "tests: $((SECONDS - T1)) s"
T2=$SECONDS  # issue 42 on a GPU: TF32, reduced-precision reductions, cancelling heads
timeout ${ARITH_TIMEOUT:-150} python3 benchmarks/gpu_arithmetic.py --json "$OUT/gpu_arithmetic.json" 2>&1 \
    | tee "$OUT/gpu_arithmetic.log" | tail -8
echo "gpu_arithmetic.py: $((SECONDS - T2)) s"
fi
if [ "${RUN_V2_DRAW:-1}" = 1 ]; then  # issue 44: V2 temperature rows drawn on the device
    python3 -c "import vllm" 2>/dev/null || export VLLM_V2_GUMBEL_PY=${VLLM_V2_GUMBEL_PY:-$PWD/tests/vllm_033/sample/gumbel.py}
    T3=$SECONDS
    timeout ${DRAW_TEST_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu_gumbel_draw.py 2>&1 \
        | tee "$OUT/pytest_gumbel_draw.log" | tail -8
    timeout ${DRAW_TIMEOUT:-180} python3 benchmarks/v2_fused_draw_gpu.py --json "$OUT/v2_fused_draw.json" \
        ${DRAW_ARGS:-} 2>&1 | tee "$OUT/v2_fused_draw.log"
    echo "v2 draw: $((SECONDS - T3)) s"
fi
if [ "${RUN_LEGACY:-0}" = 1 ]; then
    python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
    python3 benchmarks/screen_kernels.py 2>&1 | tee "$OUT/screen_kernels.md"
    python3 -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_head_cuda.py tests/test_off_switch.py 2>&1 \
        | tee "$OUT/pytest_legacy.log" | tail -15
fi
