"""vLLM's top-k on bounds: the tokens ``apply_top_k_only`` certainly keeps or drops.

Bounds in and out as :mod:`vllm_csv.sampling.nucleus` says (dropped: ``-inf`` on both sides;
undecided: ``ylo = -inf``).

top-k (``apply_top_k_only``, or the sorted ``apply_top_k_top_p_pytorch`` when a top-p is set;
both after min-p, and top-p's softmax runs over what top-k kept): token ``i`` is kept iff
``y_i >= y_(k)``, the ``k``-th largest value of the row (ties at it kept), i.e. iff fewer than
``k`` tokens have ``y_j > y_i``. Pure fp32 comparisons of the values the bounds bound: no
margin. Certainly dropped when ``yhi_i < L_k``, the ``k``-th largest ``ylo`` (``k`` tokens are
then certainly above it); certainly kept when ``ylo_i >= H_k`` with ``H_k`` the ``k``-th largest
``yhi`` of the *other* tokens (at most ``k - 1`` of them can then be above it): ``H_k`` of the
row if ``yhi_i < H_k``, else ``H_(k+1)`` (``i`` holds one of the first ``k`` places). Each bound
holds for every ``y`` in the box, ``-inf`` included, so min-p before it and top-p after it
compose as the masks do. (Not under tensor parallelism: block tokens are not counted.)
"""

from __future__ import annotations

import torch

from ...ops.gather import put_rows, rows_of
from ...ops.masks import PER_CALL, MaskOps


def has_top_k(top_k: torch.Tensor, V: int) -> torch.Tensor:
    """``[R]`` bool: the rows with a top-k (``0 < k < V``; a min-p may come before it and a top-p
    after it)."""
    return (top_k > 0) & (top_k < V)


def top_k_bounds(ylo: torch.Tensor, yhi: torch.Tensor, top_k: torch.Tensor,
                 ops: MaskOps = PER_CALL) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply top-k to bounds; see the module docstring.

    Parameters
    ----------
    ylo, yhi : torch.Tensor
        ``[R, V]`` float32 bounds of the values vLLM's top-k sees (after temperature and min-p).
    top_k : torch.Tensor
        ``[R]`` int64, ``k >= V`` (vLLM's "no top-k") or ``k <= 0``: off.
    ops : MaskOps, optional
        The passes bound once (:attr:`.HeadAdapter.masks`); default: each call picks kernel or
        reference.

    Returns
    -------
    (ylo, yhi): certainly dropped tokens ``-inf`` on both sides, undecided ones ``ylo = -inf``.
    """
    R, V = ylo.shape
    on = has_top_k(top_k, V)
    if not bool(on.any()):
        return ylo, yhi
    rows = on.nonzero().squeeze(1)
    k = top_k[rows].long().to(ylo.device)[:, None]  # [r, 1], 1 <= k < V
    lo, hi = rows_of(ylo, rows), rows_of(yhi, rows)
    kmax = int(k.max())
    new_lo, new_hi = ops.top_k_cut(lo, hi, *_top_k_levels(lo, hi, k, kmax, ops.row_topk))
    return put_rows(ylo, rows, new_lo), put_rows(yhi, rows, new_hi)


def _top_k_levels(lo: torch.Tensor, hi: torch.Tensor, k: torch.Tensor, kmax: int, row_topk=PER_CALL.row_topk):
    """``(H_k, H_(k+1), L_k)``, ``[r]`` float32 each, of bounds ``lo, hi`` (``[r, V]``; ``k`` ``[r, 1]``
    int64 in ``[1, V)``): token ``i`` is certainly kept if ``lo_i`` is at least the ``k``-th
    largest upper bound of the *other* tokens, which is ``H_(k+1)`` if ``hi_i >= H_k`` (``i`` is
    among the ``k`` highest) and ``H_k`` otherwise; certainly dropped if ``hi_i < L_k``
    (:func:`~vllm_csv.ops.masks.top_k_cut` applies them; ``row_topk``: :func:`~vllm_csv.ops.topk.row_topk`
    or the one bound)."""
    lk = row_topk(lo, kmax).values.gather(1, k - 1)  # L_k
    h = row_topk(hi, kmax + 1).values  # kmax + 1 <= V
    return h.gather(1, k - 1)[:, 0], h.gather(1, k)[:, 0], lk[:, 0]  # H_k, H_(k+1), L_k
