"""How a row certified in vLLM's sampler walks through the product's modules (issue 43).

Drives vLLM's own V1 ``Sampler`` with the plugin's hook on one batch of the sampler audit
(``vllm_csv.testing.audit_sampler``: a hostile head family, rows deferred to the sampler as the
plugin's layer defers them) and records, with ``sys.setprofile``, every call from one
``vllm_csv`` module into another, through vLLM's and torch's frames (the harness's own modules,
``vllm_csv.testing``, and their calls left out: what the harness does in place of the layer, the
hand-off, is not the row's walk).
The audit's dense reference runs vLLM's own sampler through the same wrapped ``Sampler`` first;
that call takes no hand-off and is left out (:func:`no_step`).
Prints, per module, how many times the walk entered it, and the total (the issue counted 61
entries into 11 modules before the redesign); then, for each phase of the walk (:func:`phases`:
setup, each round, finish), the stages (:func:`stages`) entered more than once in it, with the
functions entered; ``--json`` writes all of them.

    python benchmarks/row_walk.py --family peaked --rows 1
"""

from __future__ import annotations

import argparse
import collections
import json
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
    others (``ops.*``, the clock, records and leaf helpers) are entered and left."""
    return {src for _, _, src in entries if src is not None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="peaked")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--screen", default="int8")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    entries = walk(a.family, a.seed, a.rows, a.screen)
    count = collections.Counter(mod for mod, _, _ in entries)
    for mod, n in count.most_common():
        print(f"{n:5d}  {mod}")
    print(f"{sum(count.values()):5d}  entries into {len(count)} modules")
    # each phase: the stages entered more than once in it (what "each module once" leaves, phase by phase)
    stage = stages(entries)
    repeats = {}
    for name, part in phases(entries):
        c = collections.Counter(mod for mod, _, _ in part if mod in stage)
        repeats[name] = {mod: [f for m, f, _ in part if m == mod] for mod, n in c.items() if n > 1}
        print(f"{name}: {len(part)} entries, stages entered more than once: "
              + (", ".join(f"{m.removeprefix('vllm_csv.')} ({' '.join(fs)})" for m, fs in repeats[name].items())
                 or "none"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "entries": dict(count), "order": [mod for mod, _, _ in entries],
                       "calls": [list(e) for e in entries], "stages": sorted(stage),
                       "repeated_stages": repeats}, f, indent=1)

if __name__ == "__main__":
    main()
