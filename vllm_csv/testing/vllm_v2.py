"""vLLM V2's Triton sampling kernels (``vllm/v1/worker/gpu/sample/*.py``) loaded as modules that
need no vLLM: from the installed vLLM or from copies of its files, for the tests that replay them
(Triton's interpreter on the CPU, or a GPU) and the V2 sampler benchmark."""

from __future__ import annotations

import ast
import importlib.util
import os
import tempfile
from pathlib import Path


def load_vllm_v2_sample(name: str, extra: str = ""):
    """vLLM's ``vllm/v1/worker/gpu/sample/<name>.py`` (``gumbel``, ``min_p``, ``logit_bias``,
    ``penalties``) as a module with Triton imported directly and vLLM's other imports given
    placeholders (``object``: the GPU machines here have no vLLM; the kernels and their launch
    functions need none of them), ``extra`` appended (e.g. a test kernel calling its jit functions
    by name). Read from ``VLLM_V2_SAMPLE_DIR`` (copies of those files, vLLM 0.32.0; for ``gumbel``
    also ``VLLM_V2_GUMBEL_PY``) or the installed vLLM; None where neither is there."""
    path = os.environ.get("VLLM_V2_GUMBEL_PY") if name == "gumbel" else None
    if not path and os.environ.get("VLLM_V2_SAMPLE_DIR"):
        path = str(Path(os.environ["VLLM_V2_SAMPLE_DIR"]) / f"{name}.py")
    if not path:
        spec = importlib.util.find_spec("vllm")
        if spec is None:
            return None
        path = str(Path(spec.origin).parent / "v1" / "worker" / "gpu" / "sample" / f"{name}.py")
    src = Path(path).read_text()
    assert "def apply_" in src or "def gumbel_sample(" in src, path
    tree = ast.parse(src)
    body, stubs = [], []
    for node in tree.body:
        mod = getattr(node, "module", None) or ""
        if isinstance(node, ast.ImportFrom) and mod.startswith("vllm"):
            if mod == "vllm.triton_utils":
                body += ast.parse("import triton\nimport triton.language as tl").body
            else:
                stubs += [a.asname or a.name for a in node.names]
            continue
        if isinstance(node, ast.Import) and any(a.name.startswith("vllm") for a in node.names):
            stubs += [(a.asname or a.name).split(".")[0] for a in node.names]
            continue
        body.append(node)
    tree.body = ast.parse("\n".join(f"{n} = object" for n in stubs)).body + body
    out = Path(tempfile.mkdtemp()) / f"vllm_v2_{name}.py"
    out.write_text(ast.unparse(tree) + "\n" + extra)  # a file: Triton's jit reads its functions' source
    spec = importlib.util.spec_from_file_location(f"vllm_v2_{name}", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A Triton kernel writing vLLM V2's per-token hash, uniform and fp32 Gumbel noise of every row and
# token (``[R, n]`` each), to be appended to vLLM's ``gumbel.py`` (``load_vllm_v2_gumbel(NOISE_KERNEL)``)
# so that it calls vLLM's own jit functions by their global names.
NOISE_KERNEL = '''

@triton.jit
def _csv_noise_kernel(seed_ptr, pos_ptr, r_ptr, u_ptr, g_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = blk < n
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    r = murmur3_hash32(seed, pos, blk)
    u = murmur3_uniform32(seed, pos, blk)
    g = -tl.log(-_log1p_neg_stable(u))  # gumbel_noised_argmax's fp32 noise
    tl.store(r_ptr + row * n + blk, r.to(tl.int64), mask=m)
    tl.store(u_ptr + row * n + blk, u, mask=m)
    tl.store(g_ptr + row * n + blk, g, mask=m)
'''


def load_vllm_v2_gumbel(extra: str = ""):
    """:func:`load_vllm_v2_sample` of ``gumbel``."""
    return load_vllm_v2_sample("gumbel", extra)
