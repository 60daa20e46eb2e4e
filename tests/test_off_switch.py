"""The adaptive off-switch: CSV stops while it is slower than the dense head, then retries."""

import torch

from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.off_switch import OffSwitch


def test_trips_after_a_slow_window_and_recovers():
    sw = OffSwitch(window=4, tolerance=0.0, cooldown=3)
    dense = lambda: 1.0  # noqa: E731
    for _ in range(3):
        assert sw.allow()
        sw.observe(8, 1.5, dense)
    assert sw.allow()
    sw.observe(8, 1.5, dense)  # window full, mean ratio 1.5 > 1
    assert sw.times_tripped == 1
    assert [sw.allow() for _ in range(4)] == [False, False, False, True]


def test_fast_steps_never_trip():
    sw = OffSwitch(window=4, cooldown=3)
    for _ in range(20):
        assert sw.allow()
        sw.observe(1, 0.5, lambda: 1.0)
    assert sw.times_tripped == 0


def test_head_reports_off_switch_rows_and_stays_exact():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(2048, 32, generator=g)
    h = torch.randn(4, 32, generator=g)
    head = CertifiedHead(W, config=HeadConfig(budget=1.0))
    head.off_switch = OffSwitch(window=2, cooldown=5)
    head.off_switch.dense_seconds[4] = 1e-9  # pretend the dense head is instantaneous: CSV is slower
    reasons = []
    for _ in range(4):
        logits, stats = head.sampler_logits(h, torch.ones(4, dtype=torch.long))
        reasons.append(stats.fallbacks["off_switch"])
        assert torch.equal(logits.argmax(1), (h @ W.T).argmax(1))
    assert reasons == [0, 0, 4, 4]
