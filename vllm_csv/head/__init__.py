"""The certified LM head (issue 43: split into one module per idea).

* :mod:`.types`: :class:`HeadConfig`, :class:`StepStats`, :class:`TopKResult`, :class:`Selection`,
  :class:`Intervals`, :class:`Scores`, :class:`RowSplit`;
* :mod:`.error_model`: :class:`ErrorModel`, how wide each token's interval is and why;
* :mod:`.bounds`: the intervals and the exact scores, as functions of explicit state;
* :mod:`.certificate`: the top-k certificate, pure functions;
* :mod:`.selection`: the single-rank selection strategies (two-sided, one-sided, fused GPU);
* :mod:`.backend`: torch reference, CPU kernels or CUDA, bound when a head is built;
* :mod:`.runtime`: a step's policy (row split, dense merge, the step's account);
* :mod:`.selector`: the public interfaces :class:`Bounds` and :class:`Selector`;
* :mod:`.certified`: :class:`CertifiedHead`, which binds them.

``from vllm_csv.head import CertifiedHead, HeadConfig, StepStats, ...`` keeps working.
"""

from ..vocabulary import FALLBACK_REASONS
from .backend import Backend, backend_for
from .certified import CertifiedHead
from .error_model import ErrorModel
from .runtime import hidden_rows, row_split, time_call
from .selector import Bounds, Selector
from .types import HeadConfig, Intervals, RowSplit, Scores, Selection, StepStats, TopKResult

__all__ = ["FALLBACK_REASONS", "Backend", "Bounds", "CertifiedHead", "ErrorModel", "HeadConfig", "Intervals",
           "RowSplit", "Scores", "Selection", "Selector", "StepStats", "TopKResult", "backend_for", "hidden_rows",
           "row_split", "time_call"]
