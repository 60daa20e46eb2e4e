"""How a row certified in vLLM's sampler walks through the product's modules (issue 43: "a walk
of one sampled row enters each module once"; ``benchmarks/row_walk.py`` prints it,
``tests/test_layers.py`` checks it).

:func:`walk` drives vLLM's own V1 ``Sampler`` with the plugin's hook on one batch of the sampler
audit (:mod:`.audit_sampler`: a hostile head family, rows deferred to the sampler as the plugin's
layer defers them) and records, with ``sys.setprofile``, every call from one ``vllm_csv`` module
into another, through vLLM's and torch's frames (the harness's own modules, ``vllm_csv.testing``,
and their calls left out: what the harness does in place of the layer, the hand-off, is not the
row's walk). The audit's dense reference runs vLLM's own sampler through the same wrapped
``Sampler`` first; that call takes no hand-off and is left out (:func:`no_step`).

:func:`phases` cuts the walk into setup, each certificate round and finish; :func:`repeated_stages`
names, per phase, the stages (:func:`stages`: modules that enter another product module) entered
more than once in it. A round is a loop's iteration, so a stage is entered once per round at best;
leaf modules (``ops.*``, the clock, records) are entered per use.
"""

from __future__ import annotations

import collections
import sys

import torch


Entry = tuple[str, str, str]  # (module entered, function, the product module it was entered from)


def walk(family: str, seed: int, rows: int, screen: str) -> list[Entry]:
    from vllm_csv.sampling.head_adapter import HeadAdapter
    from vllm_csv.testing import audit, audit_sampler

    g = torch.Generator().manual_seed(seed)
    case = audit.FAMILIES[family](g, torch.bfloat16)
    case.hidden = case.hidden[:rows]
    batch = audit_sampler.draw_batch(g, rows, case.weight.shape[0])
    batch.deferred = torch.arange(rows)
    head = audit.make_head(case, screen)
    adapter = HeadAdapter(head)  # (built with the head, as the plugin's layer builds it: not the row's walk)
    audit_sampler.check_sampler(head, case, batch, seed, adapter)  # warm-up (kernels, caches)

    def product(frame) -> str | None:
        name = frame.f_globals.get("__name__", "")
        return name if name.startswith("vllm_csv") and not name.startswith("vllm_csv.testing") else None

    def profile(frame, event, arg):
        if event == "call":
            mod = product(frame)
            caller = frame.f_back
            while caller is not None and product(caller) is None and caller.f_globals.get(
                    "__name__", "").startswith(("torch", "vllm.", "numpy")):
                caller = caller.f_back  # (through vLLM's and torch's frames to the product's caller)
            src = None if caller is None else product(caller)
            harness = caller is not None and caller.f_globals.get("__name__", "").startswith("vllm_csv.testing")
            if mod is not None and mod != src and not harness:  # (the harness's own calls: not the row's walk)
                calls.append((mod, frame.f_code.co_name, src))

    calls: list[Entry] = []
    sys.setprofile(profile)
    try:
        audit_sampler.check_sampler(head, case, batch, seed, adapter)
    finally:
        sys.setprofile(None)
    return [e for call in sampler_calls(calls) if not no_step(call) for e in call]


SAMPLE = ("vllm_csv.vllm_plugin.v1.sampler", "sample")  # the wrapped Sampler.forward


def sampler_calls(calls: list[Entry]) -> list[list[Entry]]:
    """``calls`` cut at each entry into the wrapped ``Sampler.forward``: one list per sampler call."""
    out: list[list[Entry]] = []
    for c in calls:
        if c[:2] == SAMPLE or not out:
            out.append([])
        out[-1].append(c)
    return out


# what a sampler call with no hand-off enters: the wrapped forward, the step (asked for a hand-off),
# and the wrapped top-k/top-p (masks_on_rows' pass-through, inside vLLM's own sampler)
NO_STEP = {SAMPLE, ("vllm_csv.vllm_plugin.step", "take_handoff"), ("vllm_csv.vllm_plugin.v1.masks", "apply")}


def no_step(call: list[Entry]) -> bool:
    """A sampler call that found no hand-off (it entered the step only to ask for one, then vLLM's
    own sampler ran, with at most the wrapped top-k/top-p's pass-through): the harness's dense
    reference, on the same ``Sampler``, not the row's walk."""
    return {c[:2] for c in call} <= NO_STEP


PROCESS = {("vllm_csv.vllm_plugin.v1.sampler", "elementwise"), ("vllm_csv.vllm_plugin.v1.sampler", "columns")}
FINISH = ("vllm_csv.vllm_plugin.fill", "finish")


def phases(entries: list[Entry]) -> list[tuple[str, list[Entry]]]:
    """The walk cut into its phases: ``setup`` (the hand-off taken, the screen's bounds), one
    ``round N`` from each call of the caller's map (``process``: the bounds mapped, masked,
    certified, the next columns scored), and ``finish`` (the row written, the account settled)."""
    out: list[tuple[str, list[Entry]]] = [("setup", [])]
    for e in entries:
        if e[:2] in PROCESS:
            out.append((f"round {len(out)}", []))
        elif e[:2] == FINISH:
            out.append(("finish", []))
        out[-1][1].append(e)
    return out


def stages(entries: list[Entry]) -> set[str]:
    """The modules that, on the walk, enter another product module: a pipeline's stages; the
    others (the clock, records and leaf helpers) are entered and left, and so are the kernels,
    ``ops.*``, whose torch references (``VLLM_CSV_CPU_KERNELS=0``, no compiler) call the
    package's floating-point helpers (the layer below, :mod:`vllm_csv.fp`)."""
    return {src for _, _, src in entries if src is not None and not src.startswith(OPS)}


OPS = "vllm_csv.ops."


def repeated_stages(entries: list[Entry]) -> dict[str, dict[str, list[str]]]:
    """Per phase (:func:`phases`), the stages entered more than once in it, each with the
    functions entered (in order); a phase with none maps to ``{}``."""
    stage = stages(entries)
    out = {}
    for name, part in phases(entries):
        c = collections.Counter(mod for mod, _, _ in part if mod in stage)
        out[name] = {mod: [f for m, f, _ in part if m == mod] for mod, n in c.items() if n > 1}
    return out
