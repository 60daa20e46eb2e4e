"""The ``csv_decode`` section of vLLM's ``additional_config``, validated with pydantic.

``vllm serve --enable-csv-decode --csv-screen int8`` and
``--additional-config '{"csv_decode": {"enabled": true, "screen": "int8"}}'`` and
``vllm.LLM(..., additional_config={"csv_decode": {...}})`` all end up here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import CSVError
from ..head import HeadConfig
from ..screens import DEFAULT_SCREEN, SCREENS
from ..vocabulary import CLUSTER_FRACTION, DEFAULT_BUDGET, DEFAULT_MAX_TOPK

SECTION = "csv_decode"


class CSVDecodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    screen: Literal[SCREENS] = DEFAULT_SCREEN
    index: str | None = Field(None, description="index file (screen 'ball'); default: the cache")
    clusters: int | None = Field(None, ge=1, description=f"clusters when building an index (default {CLUSTER_FRACTION} V)")
    budget: float = Field(DEFAULT_BUDGET, gt=0.0, le=1.0, description="max share of V scored, then dense: per row in the head, "
                          "per batch (the rows' scored columns together) in the sampler")
    max_topk: int = Field(DEFAULT_MAX_TOPK, ge=1, le=1024, description="largest top_k certified; larger goes dense")
    off_switch: bool = True

    def head_config(self) -> HeadConfig:
        return HeadConfig(screen=self.screen, budget=self.budget,
                          max_topk=self.max_topk, off_switch=self.off_switch)


def from_additional_config(additional: dict | None) -> CSVDecodeConfig:
    """Parse ``additional_config[SECTION]``; a bad value raises one clear :class:`CSVError`."""
    raw = (additional or {}).get(SECTION) or {}
    if isinstance(raw, CSVDecodeConfig):
        return raw
    try:
        return CSVDecodeConfig.model_validate(raw)
    except ValidationError as e:
        errs = "; ".join(f"{'.'.join(map(str, x['loc'])) or SECTION}: {x['msg']}" for x in e.errors())
        raise CSVError(f"invalid csv_decode configuration: {errs}") from None
