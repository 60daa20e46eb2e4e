"""The certified head's records: its configuration, a step's account, and what each stage
returns (issue 43: the types apart from the code that fills them).

* :class:`HeadConfig`: what a head is built with (the public API; the plugin's config model
  makes one, :meth:`vllm_csv.vllm_plugin.config.CSVDecodeConfig.head_config`).
* :class:`Intervals`, :class:`Scores`: the bounds interface's answers
  (:class:`~vllm_csv.head.selector.Bounds`).
* :class:`Selection`: a batch's certificate (:meth:`~vllm_csv.head.selector.Selector.select`).
* :class:`TopKResult`, :class:`StepStats`: what :meth:`CertifiedHead.topk` and
  :meth:`CertifiedHead.sampler_logits` hand back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..errors import CSVError
from ..fp import FP32_UNIT_ROUNDOFF
from ..screens import DEFAULT_SCREEN, SCREENS
from ..vocabulary import DEFAULT_BUDGET, DEFAULT_MAX_TOPK, FALLBACK_REASONS


@dataclass
class HeadConfig:
    """How a certified head is built.

    Attributes
    ----------
    screen : str
        One of :data:`vllm_csv.screens.SCREENS` (``auto`` by default).
    budget : float
        Max share of ``V`` scored exactly before the dense path: per row in the head, per batch
        (its rows' scored columns together) in the sampler's rounds
        (:meth:`budget_columns`).
    epsilon : float, optional
        Accepted and validated for callers of the old API; no effect. (The epsilon-softmax mode
        it configured, ``CertifiedHead.softmax_eps``, was reached by no serving flag and was
        removed in issue 43.)
    max_topk : int
        The largest ``k`` certified (:attr:`CertifiedHead.max_certified_k`).
    unit_roundoff : float
        The accumulation precision assumed of the dense GEMM (fp32's by default).
    off_switch : bool
        Whether the head carries an :class:`~vllm_csv.off_switch.OffSwitch` (its ``off_switch``
        attribute) for the plugin's step, which alone asks and feeds it; the head never
        consults it (issue 43).
    gpu_fused : bool
        CUDA: the fused Triton step (:mod:`vllm_csv.gpu`) where it applies.
    """

    screen: str = DEFAULT_SCREEN
    budget: float = DEFAULT_BUDGET
    epsilon: float | None = None
    max_topk: int = DEFAULT_MAX_TOPK
    unit_roundoff: float = FP32_UNIT_ROUNDOFF
    off_switch: bool = True
    gpu_fused: bool = True

    def __post_init__(self):
        if self.screen not in SCREENS:
            raise CSVError(f"unknown screen {self.screen!r}; choose one of {', '.join(SCREENS)}")
        if not 0.0 < self.budget <= 1.0:
            raise CSVError(f"budget must be in (0, 1], got {self.budget}")
        if self.epsilon is not None and not 0.0 < self.epsilon < 1.0:
            raise CSVError(f"epsilon must be in (0, 1), got {self.epsilon}")
        if not 1 <= self.max_topk:
            raise CSVError(f"max_topk must be >= 1, got {self.max_topk}")

    def budget_columns(self, vocab_size: int, at_least: int = 1) -> int:
        """The budget in columns of a ``vocab_size`` vocabulary: ``ceil(budget V)``, at least
        ``at_least`` (a head's rows: the largest ``k`` asked for; the sampler's rounds: one)."""
        return max(at_least, math.ceil(self.budget * vocab_size))


@dataclass
class StepStats:
    """The account of one :meth:`~vllm_csv.head.CertifiedHead.sampler_logits` step (host
    numbers; the plugin's metrics read it)."""

    rows: int = 0
    csv_rows: int = 0
    certified: int = 0
    fallbacks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FALLBACK_REASONS, 0))
    scored: list[int] = field(default_factory=list)  # tokens scored exactly, per certified row
    seconds: float = 0.0
    screen: str = ""


@dataclass
class TopKResult:
    """What :meth:`~vllm_csv.head.CertifiedHead.topk` returns, every tensor ``[B, ...]``."""

    ids: torch.Tensor  # [B, k] int64, descending by value, ties by the lowest id
    values: torch.Tensor  # [B, k] transformed logits (model dtype); the dense bits when asked for
    certified: torch.Tensor  # [B] bool
    fallback: torch.Tensor  # [B] bool (dense path)
    scored: torch.Tensor  # [B] int64, tokens whose logits were computed exactly


@dataclass
class Selection:
    """A batch's certificate, before the transform and the dense merge.

    Attributes
    ----------
    exact : torch.Tensor
        ``[B, V]`` model dtype, pre-transform: the values of each certified row's top-k ``T``,
        ``-inf`` elsewhere (rows that are not certified hold no meaning).
    scored : torch.Tensor
        ``[B]`` int64: tokens scored exactly.
    certified : torch.Tensor
        ``[B]`` bool.
    reason : list of (str or None)
        Per row: None if certified, else a fallback reason (:data:`FALLBACK_REASONS`).
    top1 : torch.Tensor, optional
        ``[B]`` int64 where every row asked ``k = 1``: a certified row's token (its only finite
        column in ``exact``, the dense argmax); other rows' entries hold no meaning. None where
        the strategy does not give it.
    """

    exact: torch.Tensor
    scored: torch.Tensor
    certified: torch.Tensor
    reason: list[str | None]
    top1: torch.Tensor | None = None


class Intervals(NamedTuple):
    """Bounds of the dense engine's rounded pre-transform logit of every token
    (:meth:`~vllm_csv.head.selector.Bounds.intervals`)."""

    lo: torch.Tensor | None  # [B, V] fp32; None for one-sided screens
    hi: torch.Tensor  # [B, V] fp32
    hnorm: torch.Tensor  # [B] fp32, ||h|| rounded up (0 on rows that are not ok)
    ok: torch.Tensor  # [B] bool: the row may be certified


class Scores(NamedTuple):
    """Exact scores of some columns (:meth:`~vllm_csv.head.selector.Bounds.score`)."""

    z: torch.Tensor  # [B, S] model dtype: what a certified row hands on
    lower: torch.Tensor  # [B, S] fp32: lower <= the dense engine's value
    upper: torch.Tensor  # [B, S] fp32: ... <= upper


class RowSplit(NamedTuple):
    """What a step's per-row ``k`` (:meth:`CertifiedHead.sampler_logits`'s ``topk``) asks of the
    head: one place for the rule, read by the head and by the plugin's off-switch branch."""

    ks: list[int]  # per row: k > 0 certify the top-k, 0 dense (negative: decided elsewhere, the sampler)
    rows: list[int]  # the rows certified in the head: 0 < k <= max_certified_k
    csv_rows: int  # rows asking for the head's certificate (k > 0)
    kind: str  # the off-switch's ledger: "top1" (every such row reads an argmax), else "topk"
