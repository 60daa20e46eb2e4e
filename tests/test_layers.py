"""The package's import graph: no module imports from a layer above its own, and no import loop
between modules at import time (issue 43). Read from the sources (``ast``), not by importing.
And the walk of one sampled row through the modules (:mod:`vllm_csv.testing.row_walk`): each
pipeline stage entered once per phase.

Layers, lowest first (a module may import its own layer and those below):

1. ``base``: floating-point facts, errors, the vocabulary, the cache, the CPU allocator, vLLM V2's
   Gumbel noise replica;
2. ``ops``: the kernels and their references;
3. ``math``: the dense engine's arithmetic, clustering, the index, the screens;
4. ``head``: the certified head (CPU and GPU), its off-switch, tensor parallelism, loading a head;
5. ``sampling``: certificates of the sampler's draw;
6. ``serving``: metrics, the vLLM plugin, the demo server and the CLI;
7. ``testing``: harnesses for tests and benchmarks (nothing in the product imports them).
"""

import ast
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "vllm_csv"

LAYERS = [
    ("base", ("fp", "errors", "vocabulary", "cache", "cpu_malloc", "_C", "gumbel_noise", "clock")),
    ("ops", ("ops",)),
    ("math", ("dense_engine", "kmeans", "index", "screens")),
    ("head", ("head", "gpu", "off_switch", "sharded", "hf_head")),
    ("sampling", ("sampling",)),
    ("serving", ("metrics", "vllm_plugin", "serve", "demo_model", "cli")),
    ("testing", ("testing",)),
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


MODULES = _modules()


def _layer(module: str) -> int | None:
    """The layer of ``vllm_csv.X...`` (None: the package root, which re-exports the public API)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    for i, (_, names) in enumerate(LAYERS):
        if parts[1] in names:
            return i
    raise AssertionError(f"{module} is in no layer: add it to tests/test_layers.py's LAYERS")


def _targets(module: str, node) -> list[str]:
    """The package modules an import statement of ``module`` reads."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        pkg = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(pkg[: len(pkg) - node.level + 1] if node.level else [])
        mod = ".".join(x for x in (base, node.module or "") if x) if node.level else (node.module or "")
        names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
    out = []
    for n in names:
        while n not in MODULES and "." in n:
            n = n.rsplit(".", 1)[0]
        if n in MODULES and n.startswith("vllm_csv") and n != module:
            out.append(n)
    return out


@functools.cache
def _imports(top_level_only: bool) -> dict[str, set[str]]:
    graph = {}
    for m, p in MODULES.items():
        tree = ast.parse(p.read_text())
        nodes = tree.body if top_level_only else ast.walk(tree)
        graph[m] = {t for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom)) for t in _targets(m, n)}
    return graph


def test_every_module_is_in_a_layer():
    for m in MODULES:
        _layer(m)
    # (the graph is read: the layer imports the head, lazily imported names included)
    assert "vllm_csv.head" in _imports(False)["vllm_csv.vllm_plugin.logits_processor"]
    assert "vllm_csv.vllm_plugin.logits_processor" in _imports(True)["vllm_csv.vllm_plugin.patches"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_from_a_layer_above(module):
    mine = _layer(module)
    if mine is None:
        return
    above = sorted(t for t in _imports(False)[module] if (_layer(t) or 0) > mine)
    assert not above, f"{module} ({LAYERS[mine][0]}) imports from above: {above}"


def test_no_import_loop_at_import_time():
    """Strongly connected components of the module-level import graph (Tarjan): each one module."""
    graph = _imports(True)
    index, low, stack, on, loops = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                loops.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not loops, loops


MAX_LINES = 450  # (issue 43: "no product file over ~450 lines"; the harness, vllm_csv.testing, too)


def test_no_module_over_max_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by idea): {long}"


def test_one_sampled_row_enters_each_stage_once_a_phase():
    """Issue 43's "a walk of one sampled row enters each module once", as far as a loop allows:
    one deferred row through vLLM's own V1 sampler with the hook, cut into setup, each
    certificate round and finish; no module that enters another (a pipeline stage) is entered
    twice within a phase. (A round is an iteration: its stages are entered again in the next.)"""
    from vllm_csv.testing.row_walk import phases, repeated_stages, walk

    entries = walk("peaked", 0, 1, "int8")
    names = [name for name, _ in phases(entries)]
    assert names[0] == "setup" and names[-1] == "finish" and "round 1" in names, names  # (the walk was taken)
    assert {name: r for name, r in repeated_stages(entries).items() if r} == {}
