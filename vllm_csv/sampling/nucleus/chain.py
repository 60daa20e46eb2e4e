"""vLLM's three masks chained in its order (min-p, top-k, top-p) on bounds, on chosen rows:
what each round of :mod:`~vllm_csv.sampling.rounds` applies after ``process``.
"""

from __future__ import annotations

import torch

from ...ops.masks import PER_CALL, MaskOps
from .min_p import has_min_p, min_p_bounds
from .top_k import has_top_k, top_k_bounds
from .top_p import has_top_p, top_p_bounds
from .top_p_queries import TopPQueries


def all_off(min_p: torch.Tensor | None, top_k: torch.Tensor | None, top_p: torch.Tensor | None, V: int) -> bool:
    """Whether min-p, top-k and top-p (``[R]`` each, as :func:`~.min_p.min_p_bounds`,
    :func:`~.top_k.top_k_bounds`, :func:`~.top_p.top_p_bounds` take them; None: not given) are off on every row:
    then the map from the head's values to the draw's inputs is per token."""
    return not any(bool(on(x).any()) for x, on in ((min_p, has_min_p), (top_k, lambda k: has_top_k(k, V)),
                                                  (top_p, has_top_p)) if x is not None)


class Masks:
    """vLLM's min-p, top-k and top-p on bounds (in that order), on chosen rows.

    Parameters
    ----------
    min_p, top_k, top_p : torch.Tensor, optional
        ``[R]`` each (float32, int64, float32; ``0``, ``k <= 0`` or ``k >= V``, ``1``: off; None:
        not given), the rows' masks.
    V : int
        The vocabulary's size.
    ops : MaskOps, optional
        The masks' passes over the bounds, bound once (:attr:`.HeadAdapter.masks`); default: each
        call picks kernel or reference.
    """

    def __init__(self, min_p: torch.Tensor | None, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                 V: int, ops: MaskOps = PER_CALL):
        self.min_p, self.top_k, self.top_p, self.V, self.ops = min_p, top_k, top_p, V, ops
        self.top_k_on = not all_off(None, top_k, None, V)  # some row has a top-k / a top-p
        self.top_p_on = not all_off(None, None, top_p, V)
        self.off = not self.top_k_on and not self.top_p_on and all_off(min_p, None, None, V)

    def round_bounds(self, ylo: torch.Tensor, yhi: torch.Tensor, rows: torch.Tensor, last: TopPQueries | None = None,
                     asked: torch.Tensor | None = None):
        """A round's bounds after the three masks on the rows ``rows`` (``[R]`` bool): min-p and
        top-k (:meth:`before_top_p`), then top-p deciding the tokens ``asked`` only where some row
        has one (:meth:`top_p_queries`, ``last`` as there; :meth:`.TopPQueries.bounds`), else
        every token (:meth:`top_p_of`).

        Returns
        -------
        ``(ylo, yhi, queries)``: the masked bounds and the round's :class:`~.top_p_queries.TopPQueries`
        (None where no row has a top-p).
        """
        ylo, yhi = self.before_top_p(ylo, yhi, rows)
        queries = self.top_p_queries(ylo, yhi, rows, last)
        ylo, yhi = self.top_p_of(ylo, yhi, rows) if queries is None else queries.bounds(asked)
        return ylo, yhi, queries

    def before_top_p(self, ylo: torch.Tensor, yhi: torch.Tensor, rows: torch.Tensor):
        """min-p and top-k on the rows ``rows`` (``[R]`` bool); the other rows' bounds are
        returned unmasked (their decisions are not read)."""
        if self.off:
            return ylo, yhi
        if self.min_p is not None:
            ylo, yhi = min_p_bounds(ylo, yhi, torch.where(rows, self.min_p, 0.0), ops=self.ops)
        if self.top_k is not None:
            ylo, yhi = top_k_bounds(ylo, yhi, torch.where(rows, self.top_k, self.V), self.ops)
        return ylo, yhi

    def top_p_of(self, ylo: torch.Tensor, yhi: torch.Tensor, rows: torch.Tensor):
        """Then top-p, every token decided (:func:`~.top_p.top_p_bounds`)."""
        if self.off or self.top_p is None:
            return ylo, yhi
        return top_p_bounds(ylo, yhi, torch.where(rows, self.top_p, 1.0))

    def top_p_queries(self, ylo: torch.Tensor, yhi: torch.Tensor, rows: torch.Tensor,
                      last: TopPQueries | None = None) -> TopPQueries | None:
        """Top-p deciding chosen tokens only (:class:`~.top_p_queries.TopPQueries`), where some row of
        ``rows`` has one; None otherwise. ``last``: the previous round's, narrowed to these
        bounds where they lie within its own (:meth:`~.top_p_queries.TopPQueries.narrowed`: bounds
        only tighten from round to round, and the check costs two comparisons where a new list
        costs a top-K and two exp passes)."""
        if self.off or self.top_p is None:
            return None
        p = torch.where(rows, self.top_p, 1.0)
        if not bool((p < 1.0).any()):
            return None
        q = None if last is None else last.narrowed(ylo, yhi, p)
        return q if q is not None else TopPQueries(ylo, yhi, p, self.ops)
