"""The adaptive off-switch: CSV never costs more than 2% over the dense head, up to one step."""

import torch

from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.off_switch import OffSwitch


def run(sw, csv_seconds, steps, batch=8, dense=1.0, alone=None):
    """Drive ``steps`` steps as the head does (dense steps are timed in place and reported);
    ``alone`` is what the dense head measures stand-alone (default: ``dense``). Returns
    (tried steps, total head time)."""
    tried, total = 0, 0.0
    for i in range(steps):
        if sw.allow(batch, lambda: dense if alone is None else alone):
            t = csv_seconds(i) if callable(csv_seconds) else csv_seconds
            sw.observe(batch, t)
            tried, total = tried + 1, total + t
        else:
            sw.observe_dense(batch, dense)
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
    assert sw.times_tripped == 0 and tried + sw.probes == 1000 and total == tried * 0.5 + sw.probes
    assert 1000 // 33 - 1 <= sw.probes <= 1000 // 32 + 1  # probes: 1 step in 32, after the first


def test_no_probes_when_disabled():
    sw = OffSwitch(probe_every=0)
    tried, total = run(sw, 0.5, 1000)
    assert tried == 1000 and sw.probes == 0 and total == 500


def test_in_place_probes_correct_a_wrong_stand_alone_estimate():
    """The dense head timed alone looks 2x slower than it runs in place (warm caches are not
    the serving loop's): CSV at 1.1x the in-place dense time must still be turned off, and the
    run stays within the promise. Without probes the wrong estimate keeps CSV on."""
    steps = 3000
    sw = OffSwitch(tolerance=0.02)
    tried, total = run(sw, 1.1, steps, alone=2.0)
    assert sw.dense_seconds[8] == 1.0 and sw.times_tripped >= 1
    assert total <= steps * 1.02 + 2 * 0.1 + (2.0 - 1.0), total  # + one step, the warm-up, the first guess
    blind = OffSwitch(tolerance=0.02, probe_every=0)
    _, blind_total = run(blind, 1.1, steps, alone=2.0)
    assert blind_total > steps * 1.09  # the failure the probes exist for


def test_in_place_estimate_is_the_median_of_recent_dense_steps():
    sw = OffSwitch()
    sw.allow(1, lambda: 5.0)
    for t in (1.0, 9.0, 2.0, 3.0, 100.0):
        sw.observe_dense(1, t)
    assert sw.dense_seconds[1] == 3.0
    for _ in range(10):
        sw.observe_dense(1, 4.0)
    assert sw.dense_seconds[1] == 4.0  # only the last WINDOW samples count


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
    head.off_switch.probe_every = 0  # (and keep pretending: no in-place dense sample)
    reasons = []
    for _ in range(4):
        logits, stats = head.sampler_logits(h, torch.ones(4, dtype=torch.long))
        reasons.append(stats.fallbacks["off_switch"])
        assert torch.equal(logits.argmax(1), (h @ W.T).argmax(1))
    assert reasons == [0, 0, 4, 4] and head.off_switch.times_tripped == 1  # the first step is a warm-up


def test_head_probe_is_a_dense_step_timed_in_place():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(2048, 32, generator=g)
    h = torch.randn(4, 32, generator=g)
    head = CertifiedHead(W, config=HeadConfig(budget=1.0))
    sw = head.off_switch
    sw.dense_seconds[4] = 1e9  # a stand-alone guess far off: the in-place sample replaces it
    off = []
    for _ in range(3):
        logits, stats = head.sampler_logits(h, torch.ones(4, dtype=torch.long))
        off.append(stats.fallbacks["off_switch"])
        assert torch.equal(logits.argmax(1), (h @ W.T).argmax(1))
    assert off == [0, 4, 0] and sw.probes == 1  # warm-up, probe, CSV
    assert 0 < sw.dense_seconds[4] < 1.0


def test_first_step_of_a_batch_size_is_not_charged():
    sw = OffSwitch(probe_every=0)
    assert sw.allow(1, lambda: 1.0)
    sw.observe(1, 500.0)  # cold first call
    assert sw.excess == 0.0 and sw.allow(1, lambda: 1.0)
    sw.observe(1, 0.5)
    assert sw.excess == -0.5
