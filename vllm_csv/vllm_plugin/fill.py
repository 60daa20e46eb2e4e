"""Writing a step's deferred rows into the logits, for the V1 and V2 sampler hooks alike: the
certified rows' exact values, the dense head's values on every other row, the grammar's ``-inf`` kept.

Structured output (the grammar bitmask), as read in vLLM 0.32.0. The V1 runner
(``GPUModelRunner``; ``CPUModelRunner`` inherits ``execute_model`` and ``sample_tokens``
unchanged) computes the head's logits in ``execute_model`` (``model.compute_logits``: our
layer, which leaves the placeholders) and keeps that tensor in ``execute_model_state``;
``sample_tokens(grammar_output)`` then calls
``vllm.v1.structured_output.utils.apply_grammar_bitmask`` on it, in place, and right after
``_sample`` → ``Sampler.forward`` (this wrapper); nothing else writes the logits in between.
``apply_grammar_bitmask`` reorders the scheduler's bitmask rows to the batch's rows (with
speculative decoding, ``1 + num_spec`` rows a request: CSV plans no rows then) and calls
xgrammar's ``apply_token_bitmask_inplace`` on the structured requests' rows only, which sets
each token the grammar forbids to exactly ``-inf`` and leaves every other value unchanged (on
the CPU a bf16 tensor goes through an fp32 copy and back: an exact round trip). It covers
``min(V, 32 * bitmask width)`` tokens; tokens past the bitmask stay unmasked, in the dense path
and here alike. A request in its reasoning phase (a reasoning parser, ``enable_in_reasoning``
off) or whose grammar has terminated gets the full mask (every token allowed): its row has no
``-inf`` and is certified over the whole vocabulary, as the dense sampler draws it. Since the
placeholders are finite, a ``-inf`` in a deferred row at sampler time is exactly a token the
bitmask removed: it gets ``-inf`` bounds (it cannot win, and a certified row keeps it at
``-inf``), and a row left dense gets the dense head's values with the same ``-inf`` written
back, which is what xgrammar would have written. The head's own certificate (top-1, top-k)
does not know the mask, which comes after it: the plan never certifies a structured row in the
head (:func:`~.plan.plan_row`), greedy included. The engine core may delay a step's
``sample_tokens`` until the previous step's tokens reached the grammar (async scheduling), but
each worker still runs ``execute_model(N)``, ``sample_tokens(N)``, ``execute_model(N + 1)`` in
that order, so the hand-off the layer leaves on its :class:`~.step.Step` is the step's own
(:meth:`~.step.Step.take_handoff` checks the
shape). The V2 runner (``GPUModelRunner.sample``) applies the bitmask the same way: to the
head's output, in place, right before its ``Sampler.__call__`` (wrapped: :mod:`.v2.sampler`), with its own copy
of xgrammar's kernel (``_apply_grammar_bitmask_kernel``: exactly ``-inf`` where the grammar
forbids, nothing else written; ``min_tokens`` with a grammar is dense there too, its
``restore_when_all_masked``): :func:`.v2.sampler.resolve` reads and keeps the ``-inf`` as above.
"""

from __future__ import annotations

import math

import torch
from vllm.logger import init_logger

from .. import clock
from ..ops.bools import all_, any_, flat_nonzero, neg_inf_rows
from .step import Deferred, DeferredStats

logger = init_logger("vllm.csv_decode")
_logged: set[str] = set()  # fallback reasons already logged (once per process each)


def grammar_mask(d: Deferred, logits: torch.Tensor, dev_rows: torch.Tensor,
                  every_row: bool = False) -> torch.Tensor | None:
    """``[R, V]`` bool: the tokens the grammar bitmask set to ``-inf`` on the deferred rows (the
    placeholders are finite: module docstring, "structured output"); None where no row has one.
    The runner (V1 or V2) applies it to the rows of structured requests only, each labelled
    ``structured`` (:func:`~.plan.row_mode`): without one, no ``[R, V]`` scan for it. So does
    a model that sets tokens to ``-inf`` after the head (``d.suppressed``), on every row.
    ``every_row``: ``dev_rows`` is ``0 .. B - 1``."""
    if "structured" not in d.modes and d.suppressed is None:
        return None
    masked = (logits if every_row else logits[dev_rows]) == -math.inf
    return masked if bool(any_(masked)) else None


def upstream_mask(d: Deferred, logits: torch.Tensor, dev_rows: torch.Tensor,
                  every_row: bool = False) -> tuple[torch.Tensor | None, bool]:
    """``(masked, holds)``: :func:`grammar_mask` and :func:`suppression_holds`, for the sampler
    hooks. Where the model suppresses tokens and no deferred row has a grammar (the usual step
    of such a model), one pass: each row's count of ``-inf`` (:func:`~vllm_csv.ops.bools.neg_inf_rows`)
    equals the number of suppressed tokens and they are all ``-inf`` there (a gather), so the
    row's ``-inf`` are exactly those; ``masked`` is then the suppressed tokens broadcast over the
    rows (``[R, V]``, stride 0 over rows: the same tokens on every row, read as such by
    :func:`~vllm_csv.sampling.scoring.screen_bounds`). Otherwise (a check that fails: the rows go
    dense with the model's ``-inf`` kept, as :func:`finish` writes them) the mask as read."""
    s = d.suppressed
    if s is not None and "structured" not in d.modes:
        x = logits if every_row else logits[dev_rows]
        ids = flat_nonzero(s)
        if bool(all_(neg_inf_rows(x) == ids.numel())) and bool(all_(x[:, ids.to(x.device)] == -math.inf)):
            return s.to(x.device)[None].expand(x.shape[0], -1), True
    masked = grammar_mask(d, logits, dev_rows, every_row)
    return masked, suppression_holds(d, masked)


def suppression_holds(d: Deferred, masked: torch.Tensor | None) -> bool:
    """Whether the model set exactly its suppressed tokens (``d.suppressed``, seen at the
    channel's first call: :func:`~.step.suppressed_tokens`) to ``-inf`` on every deferred row
    this step: no others on a row without structured output (a grammar adds its own on the
    others). True where the model suppresses nothing. Otherwise the model's change is not the
    fixed mask the rows are certified over, and they go dense."""
    s = d.suppressed
    if s is None:
        return True
    if masked is None:
        return False
    structured = [i for i, m in enumerate(d.modes) if m == "structured"]
    if not structured:  # (the usual step: one pass, exactly those tokens on every row)
        return not bool(any_(masked != s))
    plain = [i for i, m in enumerate(d.modes) if m != "structured"]
    # a grammar's row: at least those tokens (a suppressed token left finite fails)
    return not bool(any_(s & ~masked[structured])) and not (plain and bool(any_(masked[plain] != s)))


def write_certified(logits: torch.Tensor, dev_rows: torch.Tensor, res, st: DeferredStats,
           every_row: bool = False) -> torch.Tensor:
    """The certified rows of ``res`` (a ``RowsResult``) into ``logits``; the reasons of the others
    into ``st``. Returns ``certified`` on the host. ``every_row``: ``dev_rows`` is ``0 .. B - 1``."""
    certified = res.certified.cpu()
    if every_row and bool(certified.all()):
        logits.copy_(res.values)  # the whole batch: one pass (the dtype cast included)
    elif bool(certified.any()):
        idx = dev_rows[certified.to(logits.device)]
        logits[idx] = res.values[certified.to(logits.device)].to(logits.dtype)
    for r in res.reason:
        if r is not None:
            st.fallbacks[r] = st.fallbacks.get(r, 0) + 1
    st.scored = res.scored
    return certified


def finish(d: Deferred, logits: torch.Tensor, dev_rows: torch.Tensor, certified: torch.Tensor,
            masked: torch.Tensor | None, st: DeferredStats, why: str | None, t0: float) -> None:
    """The rows left uncertified get the dense head's values (with the grammar's ``-inf``);
    ``st`` counts the certified rows by mode, or all of them unsupported (``why``)."""
    if why is not None:
        if why not in _logged:
            _logged.add(why)
            logger.info("CSV-Decode: rows to certify in the sampler take the dense path: %s", why)
        st.fallbacks["unsupported"] = len(d.modes)
    if not bool(certified.all()):
        dense_rows = dev_rows[~certified.to(logits.device)]
        # the dense head on the whole batch: bit for bit what vLLM computes without CSV
        dense = d.dense()[dense_rows].to(logits.dtype)
        logits[dense_rows] = dense if masked is None else dense.masked_fill(masked[~certified.to(logits.device)], -math.inf)
    for m, c in zip(d.modes, certified.tolist()):
        if c:
            st.certified[m] = st.certified.get(m, 0) + 1
    st.seconds = d.seconds + clock.now() - t0

