"""How a row certified in vLLM's sampler walks through the product's modules (issue 43).

Drives vLLM's own V1 ``Sampler`` with the plugin's hook on one batch of the sampler audit
(``vllm_csv.testing.audit_sampler``: a hostile head family, rows deferred to the sampler as the
plugin's layer defers them) and records, with ``sys.setprofile``, every call from one
``vllm_csv`` module into another, through vLLM's and torch's frames (the harness's own modules,
``vllm_csv.testing``, and their calls left out: what the harness does in place of the layer, the
hand-off, is not the row's walk).
The audit's dense reference runs vLLM's own sampler through the same wrapped ``Sampler`` first;
that call takes no hand-off and is left out (:func:`no_step`).
Prints, per module, how many times the walk entered it, and the total; ``--json`` writes them.
A module entered once is a pipeline stage; one entered many times is a helper the walk keeps
returning to (the issue counted 61 entries into 11 modules before the redesign).

    python benchmarks/row_walk.py --family peaked --rows 1
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import torch


def walk(family: str, seed: int, rows: int, screen: str) -> tuple[collections.Counter, list[str]]:
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

    entries, order = collections.Counter(), []

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
                calls.append((mod, frame.f_code.co_name))

    calls: list[tuple[str, str]] = []
    sys.setprofile(profile)
    try:
        audit_sampler.check_sampler(head, case, batch, seed, adapter)
    finally:
        sys.setprofile(None)
    for call in sampler_calls(calls):
        if not no_step(call):
            for mod, _ in call:
                entries[mod] += 1
                order.append(mod)
    return entries, order


SAMPLE = ("vllm_csv.vllm_plugin.v1.sampler", "sample")  # the wrapped Sampler.forward


def sampler_calls(calls: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """``calls`` cut at each entry into the wrapped ``Sampler.forward``: one list per sampler call."""
    out: list[list[tuple[str, str]]] = []
    for c in calls:
        if c == SAMPLE or not out:
            out.append([])
        out[-1].append(c)
    return out


def no_step(call: list[tuple[str, str]]) -> bool:
    """A sampler call that found no step (no hand-off taken: vLLM's own sampler ran, with at most
    the wrapped top-k/top-p's pass-through): the harness's dense reference, on the same
    ``Sampler``, not the row's walk."""
    return all(f != "take_handoff" for _, f in call)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="peaked")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--screen", default="int8")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    entries, order = walk(a.family, a.seed, a.rows, a.screen)
    for mod, n in entries.most_common():
        print(f"{n:5d}  {mod}")
    print(f"{sum(entries.values()):5d}  entries into {len(entries)} modules")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "entries": dict(entries), "order": order}, f, indent=1)


if __name__ == "__main__":
    main()
