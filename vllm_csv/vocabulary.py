"""The project's vocabulary: one place for each name and default that several modules share
(issue 43). Strings, not enums, since the metrics, the step accounts and the JSON records key on
them.

* :data:`FALLBACK_REASONS`: why a row took the dense path (the metrics' ``reason`` label);
  :data:`KERNEL_REASONS`: the selection kernels' outcome codes, in order (the CPU step's
  ``finish_selection``, the GPU step's ``certify_rows``); :func:`reason_of`: the one rule that
  names a row's outcome (:func:`reasons`: of each row of a batch).
* :data:`MODES`: the sampling modes a step's rows are counted under.
* Defaults: :data:`DEFAULT_BUDGET`, :data:`DEFAULT_MAX_TOPK`, :data:`CLUSTER_FRACTION`
  (``HeadConfig``, the plugin's config model, and the index builder read them; the CLI's flags
  and help are generated from the config model).
* :data:`SAMPLING_EPS`: vLLM's threshold below which a temperature means greedy.
"""

from __future__ import annotations

UNCERTIFIED, BUDGET, UNSUPPORTED, NONFINITE, OFF_SWITCH, ARITHMETIC = (
    "uncertified", "budget", "unsupported", "nonfinite", "off_switch", "arithmetic")
FALLBACK_REASONS = (UNCERTIFIED, BUDGET, UNSUPPORTED, NONFINITE, OFF_SWITCH, ARITHMETIC)
KERNEL_REASONS = (None, NONFINITE, BUDGET, UNCERTIFIED)  # outcome codes 0 (certified), 1, 2, 3

# (spec_greedy: a greedy request's rows in a speculative step, its verification rows and bonus
# row, vllm_plugin/v1/spec.py and v2/spec.py; spec_sampling: a sampled request's rows there, V2's
# verification certified, vllm_plugin/v2/verify.py; draft: a V1 speculative drafter head's rows)
MODES = ("greedy", "top_k", "sampling", "top_p", "min_p", "processed", "structured", "spec_greedy", "spec_sampling",
         "draft")

DEFAULT_BUDGET = 0.05  # max share of V scored exactly before the dense path
DEFAULT_MAX_TOPK = 64  # largest top_k certified
CLUSTER_FRACTION = 0.015  # clusters of a built index: C = 0.015 V, as in the paper
SAMPLING_EPS = 1e-5  # vLLM: a temperature below this is greedy


def reason_of(certified: bool, finite: bool, over_budget: bool) -> str | None:
    """A row's outcome: None if certified, else ``nonfinite`` (inputs or bounds unusable), else
    ``budget`` (too many candidates), else ``uncertified``."""
    return None if certified else (NONFINITE if not finite else (BUDGET if over_budget else UNCERTIFIED))


def reasons(certified, finite, over_budget) -> list[str | None]:
    """:func:`reason_of` of each row of ``[R]`` bool tensors ``certified``, ``finite``,
    ``over_budget`` (one host transfer each)."""
    return [reason_of(c, f, b) for c, f, b in zip(certified.tolist(), finite.tolist(), over_budget.tolist())]
