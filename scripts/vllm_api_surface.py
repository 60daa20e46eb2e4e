"""The part of vLLM's Python API that vllm-csv touches, read with ``ast`` (nothing imported), as
JSON: ``python scripts/vllm_api_surface.py [SRC] > tests/vllm_033/api_surface.json``.

SRC: a vLLM wheel (``.whl``), a directory holding ``vllm/`` (site-packages, an unpacked wheel),
or nothing (the installed vLLM). Written for ``tests/test_vllm033.py``, which compares vLLM
0.33.0's surface (committed, from ``vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl``) with the
installed vLLM's (0.32), computed the same way:

* ``files``: sha256 of each file the plugin's patches and hooks rely on (an equal file needs no
  further look);
* ``signatures``: the arguments (names, kinds, defaults; no annotations) and decorators of each
  function the plugin wraps or calls (:data:`SIGNATURES`);
* ``imports``: for each ``from vllm... import name`` in ``vllm_csv/``, whether the module defines
  the name (top-level definitions, imports, star imports, submodules);
* ``v2_draw``: the fingerprint of the V2 draw (:mod:`vllm_csv.vllm_plugin.v2.known`); ``v2_verify``
  of its speculative verification; ``v2_masks`` of the top-k / top-p masks it applies.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = (
    "vllm/model_executor/layers/logits_processor.py", "vllm/model_executor/custom_op.py",
    "vllm/model_executor/layers/utils.py", "vllm/engine/arg_utils.py", "vllm/plugins/__init__.py",
    "vllm/v1/sample/sampler.py", "vllm/v1/sample/metadata.py", "vllm/v1/sample/ops/topk_topp_sampler.py",
    "vllm/v1/sample/logits_processor/__init__.py", "vllm/v1/sample/logits_processor/builtin.py",
    "vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/cpu_model_runner.py",
    "vllm/v1/worker/gpu/model_runner.py", "vllm/v1/worker/gpu/input_batch.py",
    "vllm/v1/worker/gpu/structured_outputs.py", "vllm/v1/spec_decode/llm_base_proposer.py",
    "vllm/v1/sample/rejection_sampler.py", "vllm/v1/worker/gpu/spec_decode/rejection_sampler.py",
    "vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py",
)
SAMPLE_DIR = "vllm/v1/worker/gpu/sample"
SPEC_DIR = "vllm/v1/worker/gpu/spec_decode"
SIGNATURES = (
    "vllm/v1/worker/gpu_model_runner.py:GPUModelRunner.execute_model",
    "vllm/v1/worker/gpu_model_runner.py:GPUModelRunner.sample_tokens",
    "vllm/v1/worker/gpu/model_runner.py:GPUModelRunner.execute_model",
    "vllm/v1/worker/gpu/model_runner.py:GPUModelRunner.sample",
    "vllm/v1/worker/gpu/model_runner.py:GPUModelRunner.sample_tokens",
    "vllm/v1/sample/sampler.py:Sampler.forward",
    "vllm/v1/sample/sampler.py:Sampler.apply_temperature",
    "vllm/v1/sample/sampler.py:Sampler.apply_logits_processors",
    "vllm/v1/sample/sampler.py:Sampler.greedy_sample",
    "vllm/v1/sample/ops/topk_topp_sampler.py:apply_top_k_top_p",
    "vllm/v1/sample/ops/topk_topp_sampler.py:TopKTopPSampler.forward_cpu",
    "vllm/v1/worker/gpu/sample/sampler.py:Sampler.__call__",
    "vllm/v1/worker/gpu/sample/sampler.py:Sampler.sample",
    "vllm/v1/worker/gpu/sample/states.py:SamplingStates.get_top_k_top_p",
    "vllm/v1/worker/gpu/sample/gumbel.py:gumbel_sample",
    "vllm/model_executor/layers/logits_processor.py:LogitsProcessor.__init__",
    "vllm/model_executor/layers/logits_processor.py:LogitsProcessor.forward",
    "vllm/model_executor/custom_op.py:CustomOp.register_oot",
    "vllm/model_executor/custom_op.py:PluggableLayer.register_oot",
    "vllm/engine/arg_utils.py:EngineArgs.add_cli_args",
    "vllm/engine/arg_utils.py:EngineArgs.from_cli_args",
    "vllm/v1/spec_decode/llm_base_proposer.py:SpecDecodeBaseProposer._greedy_sample",
    "vllm/v1/sample/rejection_sampler.py:RejectionSampler.forward",
    "vllm/v1/sample/rejection_sampler.py:rejection_sample",
    "vllm/v1/sample/rejection_sampler.py:_rejection_greedy_sample",
    "vllm/v1/sample/rejection_sampler.py:expand_batch_to_tokens",
    "vllm/v1/worker/gpu/spec_decode/rejection_sampler.py:RejectionSampler.__call__",
    "vllm/v1/worker/gpu/spec_decode/rejection_sampler.py:gather_draft_sampled",
    "vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py:rejection_sample",
)


def _find(tree, qualname):
    body, node = tree.body, None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node


def signature(tree, qualname):
    fn = _find(tree, qualname)
    if fn is None:
        return None
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    out = [[x.arg, "positional", d] for x, d in zip(pos, defaults)]
    if a.vararg:
        out.append([a.vararg.arg, "*", None])
    out += [[x.arg, "keyword", None if d is None else ast.unparse(d)] for x, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append([a.kwarg.arg, "**", None])
    return {"args": out, "decorators": [ast.unparse(d) for d in fn.decorator_list]}


def _defined(root: Path, module: str, name: str, seen=None) -> bool:
    seen = set() if seen is None else seen
    if module in seen:
        return False
    seen.add(module)
    base = root / module.replace(".", "/")
    path = base / "__init__.py" if (base / "__init__.py").exists() else base.with_suffix(".py")
    if not path.exists():
        return False
    if (base / f"{name}.py").exists() or (base / name / "__init__.py").exists():
        return True
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                src = node.module or ""
                if node.level:
                    parts = package.split(".")
                    src = ".".join(parts[:len(parts) - node.level + 1] + ([src] if src else []))
                if _defined(root, src, name, seen):
                    return True
    return False


def plugin_imports() -> list[tuple[str, str]]:
    out = set()
    for path in (ROOT / "vllm_csv").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
                out.update((node.module, a.name) for a in node.names)
    return sorted(out)


def surface(root: Path, source: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from vllm_csv.vllm_plugin.v2 import known

    version = "unknown"
    vfile = root / "vllm/_version.py"
    if vfile.exists():
        for node in ast.parse(vfile.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
                version = node.value.value
    sample = sorted(p.relative_to(root).as_posix() for p in (root / SAMPLE_DIR).rglob("*.py"))
    files = {f: hashlib.sha256((root / f).read_bytes()).hexdigest() if (root / f).exists() else None
             for f in list(FILES) + sample}
    trees = {}
    sigs = {}
    for s in SIGNATURES:
        f, q = s.split(":")
        if f not in trees:
            trees[f] = ast.parse((root / f).read_text()) if (root / f).exists() else ast.Module(body=[])
        sigs[s] = signature(trees[f], q)
    imports = {f"{m}:{n}": _defined(root, m, n) for m, n in plugin_imports()}
    return {"vllm": version, "source": source, "files": files, "signatures": sigs, "imports": imports,
            "v2_draw": known.fingerprint(root / SAMPLE_DIR),
            "v2_verify": known.verify_fingerprint(root / SPEC_DIR),
            "v2_masks": known.masks_fingerprint(root / "vllm/v1/sample/ops")}


def main(argv: list[str]) -> int:
    src = argv[1] if len(argv) > 1 else None
    if src is None:
        import importlib.util

        root = Path(importlib.util.find_spec("vllm").origin).parent.parent
        print(json.dumps(surface(root, "installed"), indent=1, sort_keys=True))
    elif src.endswith(".whl"):
        with tempfile.TemporaryDirectory() as d, zipfile.ZipFile(src) as z:
            z.extractall(d, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
            digest = hashlib.sha256(Path(src).read_bytes()).hexdigest()
            print(json.dumps(surface(Path(d), f"{Path(src).name} sha256:{digest}"), indent=1, sort_keys=True))
    else:
        print(json.dumps(surface(Path(src), str(src)), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
