"""Which vLLM V2 draw the V2 sampler hook certifies: the code of vLLM's V2 sampling path, read
from its source files and compared with the releases the replica was checked against.

The V2 certificate (:mod:`vllm_csv.sampling.gumbel_v2`, :mod:`vllm_csv.sampling.rows_v2`) replays
vLLM's V2 Gumbel draw: its hash of ``(seed, position, token)``, its uniform, its fp32 noise, its
temperature and min-p kernels, the order the ``Sampler`` applies them in, and the call that draws
(with no logits cache: a draw *with* one, as vLLM 0.33's speculators make, mixes the speculative
step into the seed, ``spec_step_seed``). Any change there changes which token a row draws. So the
hook certifies V2 rows only where each of those functions is, up to docstrings, comment lines and
trailing blanks, the code of a release listed in :data:`KNOWN` (feature detection on the code
itself, not on the version string); elsewhere the V2 sampled rows stay dense, with one warning.
vLLM 0.32.0 and 0.33.0 differ in these functions only in the top-k / top-p plumbing of
``Sampler.sample`` (``has_topp_only_rows``; batches with top-k or top-p are dense in the hook) and
in ``gumbel_block_argmax``'s speculative seed (used only with a logits cache, which the target
sampler never passes): the noise of every row the hook certifies is the same
(``tests/test_vllm033.py`` runs both kernels).

vLLM's native processors, which both hooks run on bounds (each moves a token's value alone, and
monotonically), are read the same way, whole files (:data:`WHOLE`). So is the V2 speculative
verification the verification hooks replay (:mod:`.spec`, :mod:`.verify`: the rejection kernel's
test and its uniform's seed, the residual draw, the logsumexp over blocks, the greedy
verification by the first argmax): :func:`v2_verify_known`, against :data:`KNOWN_VERIFY` (vLLM
0.32.0 and 0.33.0 differ there, and each release's code is the one the tests run); elsewhere
speculative steps on the V2 runner are dense.

``python -m vllm_csv.vllm_plugin.v2.known [SAMPLE_DIR]`` prints the fingerprint of the installed
vLLM (or of a directory holding ``gumbel.py``, ``min_p.py``, ``states.py``, ``sampler.py`` and the
processors' files), then that of its verification.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import logging
import sys
from pathlib import Path

logger = logging.getLogger("vllm.csv_decode")

PACKAGE = "vllm.v1.worker.gpu.sample"
VERIFY_PACKAGE = "vllm.v1.worker.gpu.spec_decode"
WHOLE = "*"  # a file's whole code (less comment-only and blank lines, trailing blanks)
# per file of vllm/v1/worker/gpu/sample/: the functions (``Class.method``) that decide a V2 draw
FUNCTIONS = {
    "logit_bias": (WHOLE,),  # (logit bias, allowed ids, min_tokens' stop tokens)
    "penalties": (WHOLE,),
    "bad_words": (WHOLE,),
    "gumbel": ("_temperature_kernel", "apply_temperature", "_murmur3_rotl32", "_murmur3_mix", "_murmur3_fmix32",
               "murmur3_hash32", "murmur3_uniform32", "_log1p_neg_stable", "gumbel_noised_argmax",
               "gumbel_block_argmax", "_gumbel_sample_kernel", "gumbel_sample"),
    "min_p": ("_min_p_kernel", "apply_min_p"),
    "states": ("SamplingStates.apply_temperature", "SamplingStates.apply_min_p"),
    "sampler": ("Sampler.apply_sampling_params", "Sampler.sample", "Sampler._sample_random"),
}
# per file of vllm/v1/worker/gpu/spec_decode/: what decides a V2 speculative verification
VERIFY_FUNCTIONS = {"rejection_sampler": (WHOLE,), "rejection_sampler_utils": (WHOLE,)}
# vllm/v1/sample/ops/: the top-k / top-p masks V2 applies after min-p (Qrita's Triton kernels, and
# the call that picks them), which the certificate of top-k / top-p rows relies on keeping a row's
# maximum (vllm_csv.gumbel_noise.top_mask_margin)
MASKS_PACKAGE = "vllm.v1.sample.ops"
MASKS_FUNCTIONS = {"topk_topp_triton": (WHOLE,), "topk_topp_sampler": ("apply_top_k_top_p",)}
# fingerprint (function -> sha256 prefix, None where the release has no such function) per release
KNOWN: dict[str, dict[str, str | None]] = {
    "0.32.0": {},  # filled below
    "0.33.0": {},
}
KNOWN_VERIFY: dict[str, dict[str, str | None]] = {
    "0.32.0": {},
    "0.33.0": {},
}
KNOWN_MASKS: dict[str, dict[str, str | None]] = {
    "0.32.0": {},
    "0.33.0": {},
}


def _find(tree: ast.Module, qualname: str):
    body = tree.body
    node = None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node


def function_hash(src: str, tree: ast.Module, qualname: str) -> str | None:
    """sha256 (16 hex digits) of ``qualname``'s source in ``src`` with its decorators, less its
    docstring, comment-only lines, blank lines and trailing blanks; None where it is not there.
    :data:`WHOLE`: the whole file's, less comment-only lines, blank lines and trailing blanks."""
    if qualname == WHOLE:
        kept = [ln.rstrip() for ln in src.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]
    node = _find(tree, qualname)
    if node is None:
        return None
    lines = src.splitlines()
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    skip = set()
    doc = node.body[0] if node.body else None
    if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
        skip = set(range(doc.lineno, doc.end_lineno + 1))
    kept = [ln.rstrip() for i, ln in enumerate(lines[first - 1:node.end_lineno], start=first)
            if i not in skip and ln.strip() and not ln.strip().startswith("#")]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def _source(name: str, directory: str | Path | None, package: str = PACKAGE) -> str | None:
    if directory is not None:
        p = Path(directory) / f"{name}.py"
        return p.read_text() if p.exists() else None
    mod = sys.modules.get(f"{package}.{name}")
    origin = getattr(mod, "__file__", None)
    if origin is None:
        try:
            spec = importlib.util.find_spec(f"{package}.{name}")
        except (ImportError, ValueError):
            return None
        origin = getattr(spec, "origin", None)
    try:
        return Path(origin).read_text() if origin else None
    except OSError:
        return None


def fingerprint(directory: str | Path | None = None, functions: dict = FUNCTIONS,
                package: str = PACKAGE) -> dict[str, str | None] | None:
    """The fingerprint of vLLM's V2 draw (:data:`FUNCTIONS`; with :data:`VERIFY_FUNCTIONS` and
    :data:`VERIFY_PACKAGE`, of its verification): of the modules vLLM imports (as loaded, else as
    installed), or of the files in ``directory``. None where a file is missing."""
    out = {}
    for name, funcs in functions.items():
        src = _source(name, directory, package)
        if src is None:
            return None
        tree = ast.parse(src)
        for f in funcs:
            out[f"{name}:{f}"] = function_hash(src, tree, f)
    return out


def verify_fingerprint(directory: str | Path | None = None) -> dict[str, str | None] | None:
    """:func:`fingerprint` of vLLM's V2 speculative verification (:data:`VERIFY_FUNCTIONS`)."""
    return fingerprint(directory, VERIFY_FUNCTIONS, VERIFY_PACKAGE)


def masks_fingerprint(directory: str | Path | None = None) -> dict[str, str | None] | None:
    """:func:`fingerprint` of vLLM's top-k / top-p masks (:data:`MASKS_FUNCTIONS`)."""
    return fingerprint(directory, MASKS_FUNCTIONS, MASKS_PACKAGE)


def matching_release(fp: dict | None, known: dict = KNOWN) -> str | None:
    """The release in ``known`` (:data:`KNOWN`, :data:`KNOWN_VERIFY`) whose code ``fp`` is, or None."""
    return next((v for v, k in known.items() if fp is not None and k and fp == k), None)


_checked: dict[str, str | None] = {}  # what -> the matching release (None: none), once per process


def _known(what: str, fp, known: dict, where: str, dense: str) -> bool:
    if what not in _checked:
        release = _checked[what] = matching_release(fp(), known)
        if release is None:
            import vllm

            logger.warning("vllm-csv: vLLM %s's %s (%s) is not the code of any release its certificate was "
                           "checked against (%s): %s stay dense", getattr(vllm, "__version__", "?"), what, where,
                           ", ".join(known), dense)
    return _checked[what] is not None


def v2_draw_known() -> bool:
    """Whether the loaded vLLM's V2 draw is one in :data:`KNOWN` (read once per process; a
    warning the first time it is not: the V2 sampled rows then stay dense)."""
    return _known("V2 sampling code", fingerprint, KNOWN, "vllm/v1/worker/gpu/sample", "rows drawn by the V2 sampler")


def v2_masks_known() -> bool:
    """Whether the loaded vLLM's top-k / top-p masks are those of a release in :data:`KNOWN_MASKS`
    (read once per process; a warning the first time they are not: batches with a top-k or top-p
    row then stay dense in the V2 sampler hook)."""
    return _known("top-k / top-p kernels", masks_fingerprint, KNOWN_MASKS, "vllm/v1/sample/ops/topk_topp_*.py",
                  "V2 batches with a top-k or top-p row")


def v2_verify_known() -> bool:
    """Whether the loaded vLLM's V2 speculative verification is one in :data:`KNOWN_VERIFY` (read
    once per process; a warning the first time it is not: speculative steps then stay dense)."""
    return _known("V2 speculative verification", verify_fingerprint, KNOWN_VERIFY,
                  "vllm/v1/worker/gpu/spec_decode/rejection_sampler*.py", "speculative steps on the V2 runner")


KNOWN["0.32.0"].update({
    'logit_bias:*': '51d59b6bb3b29fa2',
    'penalties:*': 'e9610d51ebb8fc29',
    'bad_words:*': '49907e4fc9b14cae',
    'gumbel:_temperature_kernel': 'a16df71f4a9ccc1b',
    'gumbel:apply_temperature': '44ffa60e94136427',
    'gumbel:_murmur3_rotl32': '06988a47672a2fc6',
    'gumbel:_murmur3_mix': '45c3503783a5f74b',
    'gumbel:_murmur3_fmix32': 'd35488bc7d627a60',
    'gumbel:murmur3_hash32': 'e88dc581df902a2d',
    'gumbel:murmur3_uniform32': '4b1767c3ac5c07d0',
    'gumbel:_log1p_neg_stable': '986dba8a4f261cad',
    'gumbel:gumbel_noised_argmax': '0da638b44e9af5df',
    'gumbel:gumbel_block_argmax': '50175f604bd56032',
    'gumbel:_gumbel_sample_kernel': '89a4813240f3ca08',
    'gumbel:gumbel_sample': '612303a071f0f19a',
    'min_p:_min_p_kernel': 'bf0d185e004679d4',
    'min_p:apply_min_p': 'eea404553e370af0',
    'states:SamplingStates.apply_temperature': '96e6c5cce1e14586',
    'states:SamplingStates.apply_min_p': 'e238f2aa4bccfc99',
    'sampler:Sampler.apply_sampling_params': '74a0680207a798d1',
    'sampler:Sampler.sample': '1846980c7bac2e22',
    'sampler:Sampler._sample_random': '326409932cb37002',
})
# 0.33.0: gumbel_block_argmax mixes the speculative step into the seed where a logits cache is
# given; Sampler.sample / _sample_random pass has_topp_only_rows to apply_top_k_top_p; the
# penalties' block size is a module constant (CPU overrides it)
KNOWN["0.33.0"].update(KNOWN["0.32.0"], **{
    'penalties:*': '948e1baa4d26a672',
    'gumbel:gumbel_block_argmax': 'b0e13e58344beb3c',
    'sampler:Sampler.sample': 'bf85995101ff0409',
    'sampler:Sampler._sample_random': '6ddb95e1ba45f35b',
})

# 0.33.0's verification differs from 0.32.0's (FLy, block verification with spec_step_seed, the
# bonus row found by position): each release's is the code its tests run (tests/test_vllm033.py,
# scripts/check_vllm033.sh)
KNOWN_VERIFY["0.32.0"].update({
    'rejection_sampler:*': '9d6a63435a39b234',
    'rejection_sampler_utils:*': '49005a4968ceda30',
})
KNOWN_VERIFY["0.33.0"].update({
    'rejection_sampler:*': '2fe803480ce3bec6',
    'rejection_sampler_utils:*': '70bcd69fe1a9e15f',
})

# the top-k / top-p masks (tests/test_v2_top_masks.py runs 0.32.0's kernels at the margin; 0.33.0's
# monolithic kernel differs by an early exit where at most k logits are finite, which keeps the row,
# and its split pipeline by how many programs share a row)
KNOWN_MASKS["0.32.0"].update({
    'topk_topp_triton:*': '311e092e682a760a',
    'topk_topp_sampler:apply_top_k_top_p': 'fc5c977fa96b7ba1',
})
KNOWN_MASKS["0.33.0"].update({
    'topk_topp_triton:*': '8a592bd22d1607e3',
    'topk_topp_sampler:apply_top_k_top_p': 'd6460f0a30e8428a',
})


if __name__ == "__main__":
    fp = fingerprint(sys.argv[1] if len(sys.argv) > 1 else None)
    for k, v in (fp or {}).items():
        print(f"    {k!r}: {v!r},")
    print("release:", matching_release(fp))
    fp = verify_fingerprint()
    for k, v in (fp or {}).items():
        print(f"    {k!r}: {v!r},")
    print("verification release:", matching_release(fp, KNOWN_VERIFY))
    fp = masks_fingerprint()
    for k, v in (fp or {}).items():
        print(f"    {k!r}: {v!r},")
    print("top-k / top-p masks release:", matching_release(fp, KNOWN_MASKS))
