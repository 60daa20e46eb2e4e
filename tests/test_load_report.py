"""The load benchmark's memory report (vllm_csv/testing/load_bench.py, run by benchmarks/load.py):
growth over the run and over its second half."""

from vllm_csv.testing import load_bench as load


def test_rss_growth_tells_a_filling_pool_from_a_leak():
    filling = [(0.0, 1000.0), (10.0, 1080.0), (20.0, 1100.0), (30.0, 1100.0), (40.0, 1101.0)]
    leaking = [(0.0, 1000.0), (10.0, 1025.0), (20.0, 1050.0), (30.0, 1075.0), (40.0, 1100.0)]
    f, g = load.rss_growth(filling), load.rss_growth(leaking)
    assert f["rss_growth"] == 0.101
    assert g["rss_growth"] == 0.1
    assert f["rss_growth_second_half"] == round(1101 / 1100 - 1, 4)
    assert g["rss_growth_second_half"] == round(1100 / 1050 - 1, 4)
    assert f["rss_mb_series"] == filling
