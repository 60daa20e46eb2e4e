#!/usr/bin/env bash
# On a CUDA machine with torch and Triton (no vLLM, no network needed), the parts named in PARTS
# (default: all), each under its own timeout, results to $OUT (or ./results/gpu):
#   step     the fused GPU step's benchmark and audit (benchmarks/gpu_step.py [args])
#   tests    its kernels' tests compiled for the GPU (tests/test_gpu_kernels.py)
#   arith    the dense engine's arithmetic there (benchmarks/gpu_arithmetic.py, issue 42)
#   draw     the V2 temperature draw on the device: tests/test_gpu_gumbel_draw.py compiled, then
#            benchmarks/v2_fused_draw_gpu.py $DRAW_ARGS (head + sample against the dense V2 step)
#   learned  a model trained on the device, its held-out hidden states through the fused step and
#            the V2 draw, audited against cuBLAS (benchmarks/gpu_learned.py $LEARNED_ARGS)
#   verify   V2's sampled speculative verification certified, against the dense head of the same
#            rows, each certified request checked (benchmarks/v2_verify_gpu.py $VERIFY_ARGS)
# Budget: all parts under 8 minutes on an H100; PARTS="tests draw learned" under 6.
# Usage: VLLM_CSV_COMMIT=<sha> [PARTS="..."] bash benchmarks/run_gpu.sh [gpu_step.py args]
# ONLY_V2_DRAW=1 is PARTS=draw; RUN_LEGACY=1 also builds csrc/ and runs the earlier screen
# benchmarks and CUDA tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export VLLM_CSV_COMMIT=${VLLM_CSV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
PARTS=" ${PARTS:-step tests arith draw learned verify} "
[ "${ONLY_V2_DRAW:-0}" = 1 ] && PARTS=" draw "
part() { [[ "$PARTS" == *" $1 "* ]]; }
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -c "import vllm_csv.gpu.step" || exit 1
python3 -c "import vllm" 2>/dev/null || export VLLM_V2_GUMBEL_PY=${VLLM_V2_GUMBEL_PY:-$PWD/tests/vllm_033/sample/gumbel.py}
if part step; then
T0=$SECONDS
timeout ${STEP_TIMEOUT:-330} python3 benchmarks/gpu_step.py --json "$OUT/gpu_step.json" "$@" 2>&1 | tee "$OUT/gpu_step.log"
echo "gpu_step.py: $((SECONDS - T0)) s"
fi
if part tests; then
T1=$SECONDS
VLLM_CSV_GPU_TUNE=0 timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu_kernels.py tests/test_gpu_philox.py \
    tests/test_verify_v2_cuda.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
echo "tests: $((SECONDS - T1)) s"
fi
if part arith; then
T2=$SECONDS  # issue 42 on a GPU: TF32, reduced-precision reductions, cancelling heads
timeout ${ARITH_TIMEOUT:-150} python3 benchmarks/gpu_arithmetic.py --json "$OUT/gpu_arithmetic.json" 2>&1 \
    | tee "$OUT/gpu_arithmetic.log" | tail -8
echo "gpu_arithmetic.py: $((SECONDS - T2)) s"
fi
if part draw; then  # issue 44: V2 temperature rows drawn on the device
    T3=$SECONDS
    timeout ${DRAW_TEST_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu_gumbel_draw.py 2>&1 \
        | tee "$OUT/pytest_gumbel_draw.log" | tail -8
    timeout ${DRAW_TIMEOUT:-180} python3 benchmarks/v2_fused_draw_gpu.py --json "$OUT/v2_fused_draw.json" \
        ${DRAW_ARGS:-} 2>&1 | tee "$OUT/v2_fused_draw.log"
    echo "v2 draw: $((SECONDS - T3)) s"
fi
if part learned; then  # issue 44: learned heads trained on the device, their own hidden states
    T4=$SECONDS
    timeout ${LEARNED_TIMEOUT:-200} python3 benchmarks/gpu_learned.py --json "$OUT/gpu_learned.json" \
        ${LEARNED_ARGS:-} 2>&1 | tee "$OUT/gpu_learned.log"
    echo "learned: $((SECONDS - T4)) s"
fi
if part verify; then  # issue 46: V2's sampled verification certified, against the dense head
    T5=$SECONDS
    timeout ${VERIFY_TIMEOUT:-150} python3 benchmarks/v2_verify_gpu.py --json "$OUT/v2_verify_gpu.json" \
        ${VERIFY_ARGS:-} 2>&1 | tee "$OUT/v2_verify_gpu.log"
    echo "verify: $((SECONDS - T5)) s"
fi
if [ "${RUN_LEGACY:-0}" = 1 ]; then
    python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
    python3 benchmarks/screen_kernels.py 2>&1 | tee "$OUT/screen_kernels.md"
    python3 -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_head_cuda.py tests/test_off_switch.py 2>&1 \
        | tee "$OUT/pytest_legacy.log" | tail -15
fi
