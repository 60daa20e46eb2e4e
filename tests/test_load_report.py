"""benchmarks/load.py's memory report: growth over the run and over its second half."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_rss_growth_tells_a_filling_pool_from_a_leak():
    import load

    filling = [(0.0, 1000.0), (10.0, 1080.0), (20.0, 1100.0), (30.0, 1100.0), (40.0, 1101.0)]
    leaking = [(0.0, 1000.0), (10.0, 1025.0), (20.0, 1050.0), (30.0, 1075.0), (40.0, 1100.0)]
    f, g = load.rss_growth(filling), load.rss_growth(leaking)
    assert f["rss_growth"] == 0.101
    assert g["rss_growth"] == 0.1
    assert f["rss_growth_second_half"] == round(1101 / 1100 - 1, 4)
    assert g["rss_growth_second_half"] == round(1100 / 1050 - 1, 4)
    assert f["rss_mb_series"] == filling
