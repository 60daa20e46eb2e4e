"""The certificate loops' records (:mod:`.rounds`, :mod:`.rows_v2`, :mod:`.sharded_rows`,
:mod:`.verify_v2`): the state a loop starts from and tightens (:class:`Screened`), its result
(:class:`RowsResult`) and the map it applies to bounds (:data:`Process`). Types only: no loop
logic and no call into the rest of the package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class RowsResult:
    """A loop's result for its ``R`` rows (``S``: the columns scored)."""

    values: torch.Tensor  # [R, V] model dtype: exact on S, -inf elsewhere and on masked tokens
    certified: torch.Tensor  # [R] bool
    winner: torch.Tensor  # [R] int64, the certified token (meaningful where certified)
    reason: list[str | None]  # None if certified, else "uncertified" / "budget" / "nonfinite"
    scored: int  # |S| (shared by the rows)


@dataclass
class Screened:
    """Rows' bounds and scored set: as the screen gives them (:func:`~.scoring.screen`, nothing
    scored yet), or as a loop left them, for a loop that goes on from there instead of screening
    and scoring the rows again (:mod:`.verify_v2`'s draws start from its acceptance rounds'):
    ``lo, hi [R, V]`` float32 (tightened where scored; ``lo`` all ``-inf`` for a one-sided
    screen), ``hnorm``, ``finite [R]`` bool, ``one_sided``, ``values [R, V]`` in the model
    dtype, exact on the columns ``scored [V]`` bool, ``-inf`` elsewhere. A loop tightens and
    fills it in place."""

    lo: torch.Tensor
    hi: torch.Tensor
    hnorm: torch.Tensor
    finite: torch.Tensor
    one_sided: bool
    values: torch.Tensor
    scored: torch.Tensor

    def rows(self, idx: torch.Tensor) -> Screened:
        """The state of rows ``idx`` alone, copied (a loop tightens and fills its state in place)."""
        return Screened(self.lo[idx], self.hi[idx], self.hnorm[idx], self.finite[idx], self.one_sided,
                        self.values[idx], self.scored.clone())


# (lo, hi, rows) -> (ylo, yhi): a map from the head's values to the draw's inputs (certify_rows' process)
Process = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
