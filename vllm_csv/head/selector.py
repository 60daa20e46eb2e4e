"""The certified head's public interfaces: what the sampler, the sharded head and the plugin
may call. Nobody outside a class reaches into its privates (issue 43).

* :class:`Bounds`: every token's interval and exact scores of a few, over one head's
  vocabulary (:class:`~vllm_csv.head.CertifiedHead`; under tensor parallelism each rank's
  ``ShardedHead.local``, over its shard). :class:`~vllm_csv.sampling.head_adapter.HeadAdapter`
  carries them through the engine's soft-cap and scale for the sampler.
* :class:`Selector`: a batch's certified top-k (:meth:`Selector.select`) and what a step
  needs around it (:func:`vllm_csv.head.runtime.sampler_logits`, the plugin).
  :class:`~vllm_csv.head.CertifiedHead` and :class:`~vllm_csv.sharded.ShardedHead` implement it.
  A sharded head has no global :class:`Bounds`: a token's bounds live on the rank that holds
  it, and the sampler combines the ranks' bounds in its own collectives
  (:mod:`vllm_csv.sampling.sharded_rows`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..dense_engine import DenseEngine, EngineProbe
from .backend import Backend
from .types import HeadConfig, Intervals, Scores, Selection, StepStats


@runtime_checkable
class Bounds(Protocol):
    """Bounds of the dense engine's rounded pre-transform logits ``zt [B, V]``."""

    vocab_size: int
    dtype: torch.dtype
    engine: DenseEngine
    config: HeadConfig

    def intervals(self, hidden: torch.Tensor, tight: bool = False) -> Intervals:
        """``(lo, hi, hnorm, ok)``: ``lo <= zt <= hi`` ``[B, V]`` fp32 on rows ``ok [B]`` (``lo``
        None for one-sided screens), ``hnorm [B]`` ``||h||`` rounded up. ``tight``: the screen's
        tight copy at every batch size (the sampler compares many tokens' bounds)."""

    def score(self, hidden: torch.Tensor, ids: torch.Tensor, hnorm: torch.Tensor) -> Scores:
        """``(z, lower, upper)`` ``[B, S]`` on columns ``ids [S]``: ``z`` (model dtype) what a
        certified row returns, ``lower <= zt <= upper`` (fp32), usually one value in bf16/fp16."""


@runtime_checkable
class Selector(Protocol):
    """A certified top-k over the (global) vocabulary ``V``."""

    vocab_size: int
    hidden_size: int
    dtype: torch.dtype
    engine: DenseEngine
    engine_probe: EngineProbe
    config: HeadConfig
    backend: Backend
    screen_name: str
    screen_backend: str | None
    off_switch: object | None  # the plugin's off-switch, carried for it (never consulted by the head)
    last_certified: torch.Tensor | None  # [B] bool (host) of the last sampler_logits step

    @property
    def max_certified_k(self) -> int:
        """The largest ``k`` certified; rows above it are dense (``unsupported``)."""

    def arithmetic_ok(self) -> bool:
        """The dense engine's arithmetic is, now, the one the bounds assume."""

    @property
    def can_exclude(self) -> bool:
        """Whether :meth:`select` (and :meth:`sampler_logits`) take ``exclude``."""

    def select(self, hidden: torch.Tensor, k: torch.Tensor, need_values: torch.Tensor,
               temp: torch.Tensor | None = None, exclude: torch.Tensor | None = None) -> Selection:
        """Certify rows ``hidden [B, d]`` for their ``k [B]`` (``need_values [B]``: their values
        are read; ``temp [B]``: sampled rows' temperatures, 0 greedy, None all greedy;
        ``exclude [n]``: tokens left out of the certificate, where :attr:`can_exclude`: a
        certified row's top-k is that of the other tokens, and it holds ``-inf`` on them)."""

    def output(self, exact: torch.Tensor) -> torch.Tensor:
        """``[B, V]``: the engine's soft-cap and scale of a selection's ``exact``, ``-inf`` kept."""

    def sampler_logits(self, hidden: torch.Tensor, topk: torch.Tensor, dense_fn=None, t0: float | None = None,
                       temperature: torch.Tensor | None = None, use_switch: bool = False,
                       exclude: torch.Tensor | None = None) -> tuple[torch.Tensor, StepStats]:
        """One step: certified rows' logits, every other row ``dense_fn``'s."""
