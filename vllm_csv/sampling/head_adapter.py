"""The sampler's view of a certified head: its public bounds (:class:`~vllm_csv.head.selector.Bounds`:
``intervals``, ``score``) carried through the engine's soft-cap and scale, so that the sampling
certificate compares what vLLM's sampler reads; and the exact scores of chosen columns written
into a certificate loop's state (:meth:`HeadAdapter.score_columns`).
"""

from __future__ import annotations

import math

import torch

from ..ops.masks import MaskOps, mask_ops
from ..ops.noise import DrawOps, draw_ops


class HeadAdapter:
    """Bounds on the values the dense head hands to vLLM's sampler, after soft-cap and scale.

    The head bounds the dense engine's pre-transform logit ``zt`` (model dtype); vLLM then
    applies ``f`` (soft-cap, scale) op by op in the model dtype. Those ops are monotone up to
    ``tanh``'s last ulps, so the bounds carried through the engine's own ops with the ``tanh``
    output stepped outwards (:meth:`~vllm_csv.dense_engine.DenseEngine.bound`) bound what the
    engine hands the sampler, rounding, underflow and overflow included. Without a transform
    the engine hands ``zt`` itself to the sampler and no margin is added.
    """

    def __init__(self, head):
        """``head``: a :class:`~vllm_csv.head.selector.Bounds` (a :class:`~vllm_csv.head.CertifiedHead`,
        or a sharded head's ``local``)."""
        self.head = head
        self.vocab_size = head.vocab_size
        self.dtype = head.dtype
        self.budget_columns = head.config.budget_columns(head.vocab_size)  # a batch's rounds together
        self._identity = head.softcap is None and head.scale == 1.0
        # the draw certificate's passes over these bounds, bound once: the CPU kernels where they
        # run on the head's device, else the torch references (certificate.certify_draw's ops)
        self.draw: DrawOps = draw_ops(head.weight)
        # and the masks' passes (min-p's, top-k's and top-p's, the rounds' top-k of a row): the same
        self.masks: MaskOps = mask_ops(head.weight)

    # ---- bounds after the transform --------------------------------------------------
    def _post(self, lo: torch.Tensor | None, hi: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Bounds carried through the engine's own soft-cap and scale in the model dtype, op by
        op (:meth:`~vllm_csv.dense_engine.DenseEngine.bound`: rounding, underflow and overflow
        included), not in fp32."""
        if self._identity:
            return lo, hi
        fh = self.head.engine.bound(hi, up=True)
        return (None if lo is None else self.head.engine.bound(lo, up=False)), fh

    def intervals(self, hidden: torch.Tensor):
        """``(lo, hi, hnorm, finite)``: ``lo, hi [B, V]`` float32 bound the value the dense head
        hands to the sampler for every token (``lo`` is None for one-sided screens);
        ``finite [B]`` says which rows have usable bounds."""
        # the tight screen at every batch size: the draw and min-p / top-k / top-p compare the
        # bounds of many tokens, not one winner's against the rest (on the demo head, int4 at
        # one row left 15% of top-k 20 rows uncertified, int8 none)
        lo, hi, hnorm, finite = self.head.intervals(hidden, tight=True)
        lo, hi = self._post(lo, hi)
        return lo, hi, hnorm, finite

    def score(self, hidden: torch.Tensor, ids: torch.Tensor, hnorm: torch.Tensor):
        """``(values, lower, upper)`` on columns ``ids``: ``values [B, n]`` (model dtype) is
        what the certified row hands to the sampler, ``lower <= dense <= upper`` (float32)
        bound what the dense head would have handed it, and ``values`` lies in between."""
        z, lower, upper = self.head.score(hidden, ids, hnorm)
        values = self.head.engine.transform(z)
        lower, upper = self._post(lower, upper)
        lower = torch.minimum(lower, values.float())  # both come from the same rounding; keep it explicit
        upper = torch.maximum(upper, values.float())
        return values, lower, upper


    def score_columns(self, hidden: torch.Tensor, hnorm: torch.Tensor, ids: torch.Tensor, values: torch.Tensor,
                      lo: torch.Tensor, hi: torch.Tensor, scored: torch.Tensor,
                      masked: torch.Tensor | None = None) -> None:
        """Score the columns ``ids`` exactly into a loop's state, in place: their values
        (:meth:`score`) into ``values [R, V]``, their bounds into ``lo, hi [R, V]`` (both bounds
        hold: the tighter is kept, so bounds only tighten, which
        :func:`~.certificate.ruled_out` relies on), and mark them ``scored [V]``. The tokens of
        ``masked`` (``[R, V]`` bool, set to ``-inf`` upstream: the grammar bitmask) keep ``-inf``
        bounds (the exact score of a token the grammar removed is not what the sampler sees)."""
        v, lower, upper = self.score(hidden, ids, hnorm)
        values[:, ids] = v
        lo[:, ids] = torch.maximum(lo[:, ids], lower)
        hi[:, ids] = torch.minimum(hi[:, ids], upper)
        if masked is not None:
            m = masked[:, ids]
            lo[:, ids] = lo[:, ids].masked_fill(m, -math.inf)
            hi[:, ids] = hi[:, ids].masked_fill(m, -math.inf)
        scored[ids] = True
