"""The adaptive off-switch: CSV never costs more than 2% over the dense head, up to one step."""

import torch

from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.off_switch import OffSwitch


def run(sw, csv_seconds, steps, batch=8, dense=1.0):
    """Drive ``steps`` steps; returns (tried steps, total head time)."""
    tried, total = 0, 0.0
    for i in range(steps):
        if sw.allow(batch, lambda: dense):
            t = csv_seconds(i) if callable(csv_seconds) else csv_seconds
            sw.observe(batch, t)
            tried, total = tried + 1, total + t
        else:
            total += dense
    return tried, total


def test_slow_csv_costs_at_most_tolerance_plus_one_step():
    for r in (1.01, 1.5, 3.0, 20.0):
        sw = OffSwitch(tolerance=0.02)
        steps = 5000
        tried, total = run(sw, r, steps)
        assert total <= steps * 1.02 + 2 * (r - 1), (r, total)  # one step, plus the warm-up step
        assert tried >= 1 and (r < 1.02 or sw.times_tripped >= 1)
        if r >= 3:  # retried about every (r - 1) / 0.02 steps, not never
            assert abs(tried - steps * 0.02 / (r - 1)) <= 3, (r, tried)


def test_fast_csv_is_never_stopped():
    sw = OffSwitch()
    tried, total = run(sw, 0.5, 1000)
    assert tried == 1000 and sw.times_tripped == 0 and total == 500


def test_banked_savings_are_capped():
    """Fast for a long time, then 10x slower: only ``credit_steps`` of savings get spent."""
    sw = OffSwitch(tolerance=0.02, credit_steps=64)
    run(sw, 0.5, 10_000)
    before = sw.excess
    tried, _ = run(sw, 10.0, 1000)
    assert before == -64.0
    assert tried <= (64 + 0.02 * 11_000) / 9 + 2


def test_head_reports_off_switch_rows_and_stays_exact():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(2048, 32, generator=g)
    h = torch.randn(4, 32, generator=g)
    head = CertifiedHead(W, config=HeadConfig(budget=1.0))
    head.off_switch.dense_seconds[4] = 1e-9  # pretend the dense head is instantaneous: CSV is slower
    reasons = []
    for _ in range(4):
        logits, stats = head.sampler_logits(h, torch.ones(4, dtype=torch.long))
        reasons.append(stats.fallbacks["off_switch"])
        assert torch.equal(logits.argmax(1), (h @ W.T).argmax(1))
    assert reasons == [0, 0, 4, 4] and head.off_switch.times_tripped == 1  # the first step is a warm-up


def test_first_step_of_a_batch_size_is_not_charged():
    sw = OffSwitch()
    assert sw.allow(1, lambda: 1.0)
    sw.observe(1, 500.0)  # cold first call
    assert sw.excess == 0.0 and sw.allow(1, lambda: 1.0)
    sw.observe(1, 0.5)
    assert sw.excess == -0.5
