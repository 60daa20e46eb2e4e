#!/usr/bin/env bash
# On a CUDA machine with torch and nvcc (no network needed): build the csrc kernels in place,
# run the GPU tests, then the LM-head benchmark on GPU-trained fixtures. Results go to $OUT
# (or ./results/gpu). Usage: bash benchmarks/run_gpu.sh [HIDDEN ...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
python3 -c "from vllm_csv.ops import has_cuda_kernels; assert has_cuda_kernels(), 'vllm_csv._C missing'; print('vllm_csv._C built')"
python3 benchmarks/screen_kernels.py 2>&1 | tee "$OUT/screen_kernels.md"
python3 -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_head_cuda.py tests/test_off_switch.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
python3 benchmarks/lm_head.py --device cuda --dtype bfloat16 --fixtures "${@:-1024 2048 4096}" \
    --batches 1 8 32 64 --positions 1024 --repeats 50 --json "$OUT/lm_head_gpu.json" 2>&1 | tail -60
