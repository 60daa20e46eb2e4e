"""One place for each shared fact (issue 43): the defaults, reasons and modes every layer uses
are the vocabulary's."""

import argparse

from vllm_csv import vocabulary as voc
from vllm_csv.head import FALLBACK_REASONS, HeadConfig
from vllm_csv.index import DEFAULT_CLUSTER_FRACTION
from vllm_csv.metrics import MODES
from vllm_csv.ops.step import REASONS


def test_defaults_come_from_the_vocabulary():
    from vllm_csv.vllm_plugin.cli_args import add_csv_args
    from vllm_csv.vllm_plugin.config import CSVDecodeConfig

    from vllm_csv.screens import DEFAULT_SCREEN

    cfg, head = CSVDecodeConfig(), HeadConfig()
    assert head.budget == cfg.budget == voc.DEFAULT_BUDGET
    assert head.max_topk == cfg.max_topk == voc.DEFAULT_MAX_TOPK
    assert head.screen == cfg.screen == DEFAULT_SCREEN and head.off_switch == cfg.off_switch
    assert cfg.head_config() == head
    assert DEFAULT_CLUSTER_FRACTION == voc.CLUSTER_FRACTION
    p = argparse.ArgumentParser()
    add_csv_args(p)
    text = " ".join(p.format_help().split())
    assert f"(default {voc.DEFAULT_BUDGET})" in text and f"(default {voc.DEFAULT_MAX_TOPK})" in text
    assert f"(default {voc.CLUSTER_FRACTION} V)" in text and "(default: None)" not in text


def test_reasons_and_modes_are_the_vocabulary():
    assert FALLBACK_REASONS is voc.FALLBACK_REASONS and REASONS is voc.KERNEL_REASONS and MODES is voc.MODES
    assert set(r for r in voc.KERNEL_REASONS if r) <= set(voc.FALLBACK_REASONS)
    assert [voc.reason_of(c, f, b) for c, f, b in ((1, 0, 1), (0, 0, 1), (0, 1, 1), (0, 1, 0))] == [
        None, "nonfinite", "budget", "uncertified"]
