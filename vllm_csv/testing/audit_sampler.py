"""Adversarial audit of the sampler path: vLLM's own ``Sampler`` drawing from certified rows
(the sampler hook, :mod:`vllm_csv.vllm_plugin.v1.sampler`) against the same ``Sampler`` on the
dense head, on the audit's hostile heads and hidden states (:data:`vllm_csv.testing.audit.FAMILIES`).

Each case draws per-row sampling parameters: greedy, temperature alone, top-k, top-p, min-p and
their combinations, with values at the edges (``k = 1``, ``k = V - 1``, top-p 0.05 to 0.99,
min-p 1e-4 to 0.95, temperatures 2e-5 to 1e4), seeded and unseeded rows; and per batch vLLM's
processors (penalties, logit bias, allowed ids, bad words) and grammar masks (``-inf`` written
into the head's output before the sampler, as ``apply_grammar_bitmask`` does), each on or off.
Some or all rows are deferred to the sampler (the others carry the dense head's values, as rows
the step plan keeps dense). Both draws start from the same global RNG state and request
generators.

:func:`run_sampler_case` returns a :class:`SamplerOutcome`: rows, rows certified (by mode),
rows whose token differs from the dense draw's (any row: a certified row's token is the
certificate's, an uncertified one's the dense fill-in's) and whether any RNG ended out of step.
The CI property suite (``tests/test_audit.py``) and the long campaign
(``benchmarks/audit.py --sampler``) both use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .audit import FAMILIES, Case, _pick, dense_reference, make_head
from .fakes import Tally, hand_off, logit_bias_processor, min_p_processor

ROW_MODES = ("greedy", "temperature", "top_k", "top_p", "min_p", "top_k_top_p", "top_k_min_p",
             "top_p_min_p", "top_k_top_p_min_p")
TEMPERATURES = (2e-5, 1e-2, 0.3, 0.7, 1.0, 1.5, 3.0, 1e4)  # vLLM draws greedily below 1e-5
TOP_K = (1, 2, 3, 5, 20, 64, 65, 200, -1)  # -1: V - 1
TOP_P = (0.05, 0.3, 0.5, 0.7, 0.9, 0.99)
MIN_P = (1e-4, 0.01, 0.05, 0.1, 0.3, 0.95)


# (family, seed, dtype, screen) of the cases that found wrong tokens: before the top-p fix for
# masses that underflow (nucleus.top_p docstring), ties drawn at temperatures near 0.01; and before
# head.hidden_rows, an inf in a row kept dense while finite rows of the batch were certified apart
# from it (the AMX machine's bf16 GEMM wrote NaN over them in the dense batch)
REGRESSIONS = (("near_tie", 7716, torch.bfloat16, "ball"), ("bias_cancel", 21, torch.bfloat16, "int8"),
               ("ties", 38, torch.float16, "ball"), ("near_tie", 53, torch.float32, "int8"),
               ("bias_cancel", 53, torch.float16, "int8"), ("nonfinite", 139, torch.bfloat16, "int8"))


@dataclass
class SamplerOutcome:
    rows: int
    certified: int
    wrong_tokens: int
    rng_out_of_step: int  # 0 or 1
    certified_by_mode: dict[str, int] = field(default_factory=dict)


@dataclass
class Batch:
    """One audited draw: the rows' modes, vLLM's metadata, the grammar's disallowed tokens
    (``[B, V]`` bool or None) and the deferred rows."""

    modes: list[str]
    md: object  # SamplingMetadata
    grammar: torch.Tensor | None
    deferred: torch.Tensor  # [R] int64
    gen_seeds: dict[int, int]


def draw_batch(g: torch.Generator, B: int, V: int) -> Batch:
    """Random per-row sampling parameters and per-batch processors (module docstring)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    modes = [_pick(g, ROW_MODES) for _ in range(B)]
    temp = torch.tensor([0.0 if m == "greedy" else _pick(g, TEMPERATURES) for m in modes], dtype=torch.float32)
    # vLLM resets a greedy request's top-k, top-p and min-p (SamplingParams): V, 1, 0 here
    top_k = torch.tensor([min(V, V - 1 if k == -1 else k) if "top_k" in m else V
                          for m, k in zip(modes, (_pick(g, TOP_K) for _ in modes))]).clamp_min(1)
    top_p = torch.tensor([_pick(g, TOP_P) if "top_p" in m else 1.0 for m in modes], dtype=torch.float32)
    min_p = torch.tensor([_pick(g, MIN_P) if "min_p" in m else 0.0 for m in modes], dtype=torch.float32)
    gen_seeds = {i: int(torch.randint(0, 2**31, (1,), generator=g)) for i in range(B)
                 if modes[i] != "greedy" and _pick(g, (False, True))}
    penalties = _pick(g, (False, False, True))
    procs = [min_p_processor(min_p)]
    if _pick(g, (False, False, True)):  # logit bias on every other row, up to +-20
        procs.append(logit_bias_processor(
            {i: {int(t): float(v) for t, v in zip(torch.randint(0, V, (3,), generator=g),
                                                  torch.randn(3, generator=g) * _pick(g, (1.0, 20.0)))}
             for i in range(0, B, 2)}))
    allowed = (torch.rand(B, V, generator=g) < 0.3) if _pick(g, (False, False, False, True)) else None
    if allowed is not None:
        allowed[:, int(torch.randint(0, V, (1,), generator=g))] = False  # True = not allowed; one token left
    bad = ({i: [[int(torch.randint(0, V, (1,), generator=g))]] for i in range(1, B, 3)}
           if _pick(g, (False, False, False, True)) else {})
    grammar = None
    if _pick(g, (False, False, False, True)):
        grammar = torch.rand(B, V, generator=g) < _pick(g, (0.2, 0.9, 0.999))
        grammar[torch.arange(B), torch.randint(0, V, (B,), generator=g)] = False  # each row allows a token
        grammar[torch.rand(B, generator=g) < 0.5] = False  # rows without a grammar
        modes = ["structured" if bool(grammar[i].any()) else m for i, m in enumerate(modes)]
    out_tokens = [torch.randint(0, V, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(B)]
    zero = torch.zeros(B)
    md = SamplingMetadata(
        temperature=temp, all_greedy=bool((temp == 0).all()), all_random=bool((temp > 0).all()),
        top_p=top_p if bool((top_p < 1).any()) else None, top_k=top_k if bool((top_k < V).any()) else None,
        generators={i: torch.Generator().manual_seed(s) for i, s in gen_seeds.items()},
        max_num_logprobs=None, no_penalties=not penalties,
        prompt_token_ids=torch.randint(0, V, (B, 5), generator=g),
        frequency_penalties=torch.rand(B, generator=g) * 2 - 0.5 if penalties else zero,
        presence_penalties=torch.rand(B, generator=g) * 2 - 0.5 if penalties else zero,
        repetition_penalties=torch.rand(B, generator=g) * 1.5 + 0.5 if penalties else zero + 1,
        output_token_ids=out_tokens, allowed_token_ids_mask=allowed, bad_words_token_ids=bad,
        logitsprocs=LogitsProcessors(procs), spec_token_ids=[[] for _ in range(B)])
    deferred = torch.arange(B) if _pick(g, (False, True)) else (torch.rand(B, generator=g) < 0.6).nonzero().squeeze(1)
    return Batch(modes, md, grammar, deferred, gen_seeds)


def _sample(sampler, logits: torch.Tensor, batch: Batch, seed: int):
    """vLLM's draw on ``logits`` from a fixed RNG state: (tokens, the global RNG's next draw,
    each generator's next draw)."""
    torch.manual_seed(seed)
    for i, s in batch.gen_seeds.items():
        batch.md.generators[i].manual_seed(s)
    out = sampler(logits=logits, sampling_metadata=batch.md).sampled_token_ids[:, 0]
    return out, torch.rand(2), [torch.rand(2, generator=batch.md.generators[i]) for i in sorted(batch.gen_seeds)]


def check_sampler(head, case: Case, batch: Batch, seed: int, adapter=None) -> SamplerOutcome:
    """vLLM's ``Sampler`` with the hook on ``batch.deferred`` (certified or filled densely in the
    sampler) against the same ``Sampler`` on the dense head's logits (grammar ``-inf`` on both).
    ``adapter``: the head's :class:`~vllm_csv.sampling.head_adapter.HeadAdapter`, where the caller
    keeps one across checks as the plugin's layer does (default: one built for this check)."""
    from vllm.v1.sample.sampler import Sampler

    from ..head import hidden_rows
    from ..sampling.head_adapter import HeadAdapter
    from ..vllm_plugin import patches, step as csv_step

    patches.install_samplers()
    sampler = Sampler()
    adapter = HeadAdapter(head) if adapter is None else adapter  # (the plugin's layer builds one per head)
    dense = dense_reference(case)
    grammar = batch.grammar
    # (a copy: on fp32 logits vLLM's sampler works in place on its input)
    want = _sample(sampler, dense.clone() if grammar is None else dense.masked_fill(grammar, -math.inf), batch, seed)
    logits = dense.clone()
    rows = batch.deferred
    logits[rows] = csv_step.PLACEHOLDER
    if grammar is not None:  # vLLM's apply_grammar_bitmask runs on the head's output, placeholders included
        logits.masked_fill_(grammar, -math.inf)
    tally = Tally()
    step = hand_off(sampler, csv_step.Deferred(  # (as the plugin's layer)
        logits, hidden_rows(case.hidden, rows), rows, [batch.modes[i] for i in rows.tolist()], adapter,
        lambda: dense_reference(case), tally.account()))
    try:
        got = _sample(sampler, logits, batch, seed)
    finally:
        step.handoff = None
    st = tally.seen[0] if tally.seen else csv_step.DeferredStats()
    wrong = int((got[0] != want[0]).sum())
    out_of_step = int(not torch.equal(got[1], want[1]) or
                      any(not torch.equal(a, b) for a, b in zip(got[2], want[2])))
    return SamplerOutcome(case.hidden.shape[0], sum(st.certified.values()), wrong, out_of_step, dict(st.certified))


def run_sampler_case(family: str, seed: int, dtype: torch.dtype, screen: str,
                     every_row: bool = False, greedy_apart: bool = False) -> SamplerOutcome:
    """One case of ``family`` drawn from ``seed``, its rows sampled as :func:`draw_batch` draws;
    ``every_row``: every row deferred (where all certify, the hook's tokens are the draw);
    ``greedy_apart``: every row but the greedy ones deferred (the greedy rows carry the dense
    values, as a greedy row the head certified or left dense; where the deferred rows all certify
    and no processor touches the greedy rows, the hook draws the batch itself)."""
    from ..errors import CSVError

    g = torch.Generator().manual_seed(seed)
    case = FAMILIES[family](g, dtype)
    batch = draw_batch(g, case.hidden.shape[0], case.weight.shape[0])
    if every_row:
        batch.deferred = torch.arange(case.hidden.shape[0])
    if greedy_apart:
        batch.deferred = torch.tensor([i for i, m in enumerate(batch.modes) if m != "greedy"], dtype=torch.long)
    try:
        head = make_head(case, screen)
    except CSVError:  # a screen may refuse a head (e.g. fp16 overflow): that is no wrong row
        return SamplerOutcome(case.hidden.shape[0], 0, 0, 0)
    return check_sampler(head, case, batch, seed)
