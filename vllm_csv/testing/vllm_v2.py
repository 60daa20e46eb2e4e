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


# vLLM's V2 sampling modules (``vllm/v1/worker/gpu/sample/<name>.py``) that differ between the
# installed vLLM and the copies a test overlays on it (``tests/vllm_033/sample``: vLLM 0.33.0's),
# in import order (each imports the ones before it).
OVERLAY_ORDER = ("gumbel", "penalties", "states", "sampler")


def _apply_top_k_top_p_033(logits, k, p, has_topp_only_rows: bool = True):
    """vLLM 0.33's ``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p`` where neither
    top-k nor top-p is asked for (its first statement: the logits as they are); its kernels for
    the other case are not copied, and a test reaching them is refused."""
    if p is None and k is None:
        return logits
    raise NotImplementedError("vLLM 0.33's top-k / top-p kernels are not part of the overlay")


def overlay_vllm_v2_sample(directory) -> list[str]:
    """Load the copies of vLLM's V2 sampling modules in ``directory`` (:data:`OVERLAY_ORDER`, where
    present) as ``vllm.v1.worker.gpu.sample.<name>``, in place of the installed vLLM's, before
    anything imports those: the installed vLLM's other modules then import the copies. Where
    the installed ``apply_top_k_top_p`` takes no ``has_topp_only_rows`` (vLLM 0.32) a copy
    that imports it gets :func:`_apply_top_k_top_p_033` instead. (On the CPU, point
    ``vllm.triton_utils`` at Triton first, as ``tests/v2_interpreted.py`` does.) Returns the
    files loaded."""
    import inspect
    import sys

    import vllm.v1.worker.gpu.sample as package

    loaded = []
    for name in OVERLAY_ORDER:
        path = Path(directory) / f"{name}.py"
        full = f"{package.__name__}.{name}"
        if not path.exists():
            continue
        assert full not in sys.modules or getattr(sys.modules[full], "__file__", None) == str(path), \
            f"{full} was imported before the overlay"
        spec = importlib.util.spec_from_file_location(full, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
        setattr(package, name, module)
        top = getattr(module, "apply_top_k_top_p", None)
        if top is not None and "has_topp_only_rows" not in inspect.signature(top).parameters:
            module.apply_top_k_top_p = _apply_top_k_top_p_033
        loaded.append(str(path))
    return loaded
