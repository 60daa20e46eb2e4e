"""The ``csv_decode`` section of vLLM's ``additional_config``, validated with pydantic.

``vllm serve --enable-csv-decode --csv-screen int8`` and
``--additional-config '{"csv_decode": {"enabled": true, "screen": "int8"}}'`` and
``vllm.LLM(..., additional_config={"csv_decode": {...}})`` all end up here.

:class:`CSVDecodeConfig` is the one place for each setting's default, validation and
description: the ``--csv-*`` flags of ``vllm serve`` and their help are generated from its
fields (:mod:`.cli_args`). A field's flag is ``--csv-<name>`` (underscores as dashes) unless its
``json_schema_extra`` names another (``"flag"``), or ``None`` for a setting with no flag; a
default that is not a value (``None``: decided at start-up) is shown as its ``"default_text"``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from ..errors import CSVError
from ..head import HeadConfig
from ..screens import DEFAULT_SCREEN, SCREENS
from ..vocabulary import CLUSTER_FRACTION, DEFAULT_BUDGET, DEFAULT_MAX_TOPK

SECTION = "csv_decode"


class CSVDecodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description="Compute exact logits on a certified sub-vocabulary; dense otherwise.",
                          json_schema_extra={"flag": "--enable-csv-decode"})
    screen: Literal[SCREENS] = Field(
        DEFAULT_SCREEN, description="Bound used to prune the vocabulary; auto: int8 with our AVX512-VNNI kernel or "
        "FBGEMM on x86 CPUs, plus int4 for one-row batches on VNNI CPUs and large heads; cuBLASLt on CUDA; "
        "fp16 on CPUs without FBGEMM.")
    index: str | None = Field(None, min_length=1, description="Index file for --csv-screen ball.",
                              json_schema_extra={"default_text": "cache"})
    clusters: int | None = Field(None, ge=1, description="Clusters when building an index.",
                                 json_schema_extra={"default_text": f"{CLUSTER_FRACTION} V"})
    budget: float = Field(DEFAULT_BUDGET, gt=0.0, le=1.0,
                          description="Max share of the vocabulary scored exactly before the dense path: per row in "
                          "the head, per batch (its rows' scored columns together) in the sampler.")
    max_topk: int = Field(DEFAULT_MAX_TOPK, ge=1, le=1024,
                          description="Largest top_k certified in the LM head; larger ones are certified in the "
                          "sampler where it is vLLM-CPU's, dense elsewhere.")
    off_switch: bool = Field(True, description="Adaptive off-switch: steps run dense while CSV would cost "
                             "more than 2% more head time than dense (vllm_csv.off_switch).",
                             json_schema_extra={"flag": None})

    def head_config(self) -> HeadConfig:
        return HeadConfig(screen=self.screen, budget=self.budget,
                          max_topk=self.max_topk, off_switch=self.off_switch)


def _extra(info: FieldInfo) -> dict[str, Any]:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def flag_of(name: str) -> str | None:
    """The ``vllm serve`` flag of config field ``name`` (None: no flag)."""
    extra = _extra(CSVDecodeConfig.model_fields[name])
    return extra["flag"] if "flag" in extra else "--csv-" + name.replace("_", "-")


def default_text(name: str) -> str:
    """Field ``name``'s default as the help and the README show it."""
    info = CSVDecodeConfig.model_fields[name]
    if "default_text" in _extra(info):
        return _extra(info)["default_text"]
    if isinstance(info.default, bool):
        return "on" if info.default else "off"
    return str(info.default)


def from_additional_config(additional) -> CSVDecodeConfig:
    """Parse ``additional_config[SECTION]``; a bad value raises one clear :class:`CSVError`.
    ``additional`` that is not a mapping (vLLM also allows an object of its own there) holds
    no section: CSV off."""
    if not isinstance(additional, dict):
        return CSVDecodeConfig()
    raw = additional.get(SECTION)
    if raw is None:
        raw = {}
    if isinstance(raw, CSVDecodeConfig):
        return raw
    if not isinstance(raw, dict):
        raise CSVError(f"invalid csv_decode configuration: {SECTION} must be an object of settings "
                       f"(e.g. {{\"enabled\": true}}), got {raw!r}")
    try:
        return CSVDecodeConfig.model_validate(raw)
    except ValidationError as e:
        errs = "; ".join(f"{'.'.join(map(str, x['loc'])) or SECTION}: {x['msg']}" for x in e.errors())
        raise CSVError(f"invalid csv_decode configuration: {errs}") from None
