"""CSV metrics written by one process (a worker) are read by another (the API server)."""

import os
import subprocess
import sys
import textwrap

import pytest

from prometheus_client import CollectorRegistry, generate_latest, multiprocess


def test_worker_metrics_reach_a_multiprocess_registry(tmp_path):
    worker = textwrap.dedent("""
        from vllm_csv.head import StepStats
        from vllm_csv.metrics import CSVMetrics
        m = CSVMetrics("demo", {"screen": "int8", "vocab_size": 1000, "hidden_size": 64})
        s = StepStats(rows=4, csv_rows=3, certified=2, scored=[3, 40], seconds=0.002, screen="int8")
        s.fallbacks["budget"] = 1
        m.record(s, dense_seconds=0.009, modes={"greedy": 1, "sampling": 1})  # warm-up of batch size 4
        m.record(s, dense_seconds=0.005, modes={"greedy": 1, "sampling": 1})
        m.record(StepStats(rows=2, csv_rows=0, seconds=0.001))
        off = StepStats(rows=2, csv_rows=2, seconds=0.004, screen="int8")  # CSV off: dense, not a CSV step
        off.fallbacks["off_switch"] = 2
        m.record(off, dense_seconds=0.009)  # estimate above its own dense run: noise, not time saved
    """)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", worker], env=env, check=True)
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    text = generate_latest(reg).decode()
    assert 'csv_decode_rows_total{model_name="demo"} 12.0' in text
    assert 'csv_decode_csv_rows_total{model_name="demo"} 8.0' in text
    assert 'csv_decode_rows_certified_total{mode="greedy",model_name="demo"} 2.0' in text
    assert 'csv_decode_rows_certified_total{mode="sampling",model_name="demo"} 2.0' in text
    assert 'csv_decode_fallbacks_total{model_name="demo",reason="budget"} 2.0' in text
    assert 'csv_decode_steps_total{model_name="demo"} 3.0' in text
    assert 'csv_decode_scored_tokens_bucket{le="4.0",model_name="demo"} 2.0' in text
    assert 'csv_decode_scored_tokens_count{model_name="demo"} 4.0' in text
    assert "csv_decode_head_seconds_saved_total" in text
    # the head speed-up of the steps that ran CSV: dense estimate / CSV time, the warm-up and off steps left out
    assert 'csv_decode_head_seconds_csv_total{model_name="demo"} 0.002' in text
    assert 'csv_decode_head_seconds_dense_estimate_total{model_name="demo"} 0.005' in text
    assert 'screen="int8"' in text and "csv_decode_info" in text
    # what `vllm-csv serve` prints after its request, read back from the same page
    from vllm_csv.serve import parse_csv_metrics, summary

    m = parse_csv_metrics(text)
    assert m["csv_decode_head_seconds_saved_total"] == pytest.approx(0.007 + 0.003)
    assert m["csv_decode_rows_certified_total"] == 4.0  # summed over the mode label
    assert summary(m) == ("4 of 12 rows certified (33.3%); on the steps that ran CSV the head took 2.0 ms "
                          "against 5.0 ms dense (measured in place): 2.50x; 2 rows dense by the off-switch")
    assert summary({}) == "no rows yet; no step ran CSV (0 rows dense by the off-switch)"


def test_no_metrics_until_a_head_exists():
    code = "import prometheus_client, vllm_csv.metrics; print(any('csv_decode' in n for n in " \
           "prometheus_client.REGISTRY._names_to_collectors))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_tensor_parallel_ranks_count_once(tmp_path):
    """Two TP ranks record the same global decision: the unlabelled families count it once
    (rank 0), the ``rank``-labelled counters once per rank."""
    worker = textwrap.dedent("""
        import sys
        from vllm_csv.head import StepStats
        from vllm_csv.metrics import CSVMetrics
        m = CSVMetrics("demo", {"screen": "int8", "vocab_size": 1000, "hidden_size": 64}, rank=int(sys.argv[1]))
        m.record(StepStats(rows=4, csv_rows=3, certified=2, scored=[3, 40], seconds=0.002, screen="int8"))
    """)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    for rank in (0, 1):
        subprocess.run([sys.executable, "-c", worker, str(rank)], env=env, check=True)
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    text = generate_latest(reg).decode()
    assert 'csv_decode_rows_total{model_name="demo"} 4.0' in text
    assert 'csv_decode_rows_certified_total{mode="top_k",model_name="demo"} 2.0' in text
    assert 'csv_decode_scored_tokens_count{model_name="demo"} 2.0' in text
    for rank in (0, 1):
        assert f'csv_decode_rank_rows_certified_total{{model_name="demo",rank="{rank}"}} 2.0' in text
        assert f'csv_decode_rank_rows_total{{model_name="demo",rank="{rank}"}} 4.0' in text


def test_metrics_go_to_ray_under_ray():
    """In a Ray process (local ``ray.init``) every CSV metric is a ``ray.util.metrics`` one
    (vLLM's Ray wrappers) and recording works; outside Ray, prometheus-client's. Reading the
    values back needs Ray's metrics agent (``ray[default]``), not checked here. Skipped where
    Ray (with ``ray.serve``, which vLLM's wrappers import) is not installed."""

    pytest.importorskip("ray.serve")
    code = textwrap.dedent("""
        import ray
        from vllm_csv.metrics import CSVMetrics, ray_active
        assert not ray_active()
        ray.init(num_cpus=1, include_dashboard=False)
        assert ray_active()
        from ray.util import metrics as ray_metrics
        from vllm_csv.head import StepStats
        m = CSVMetrics("demo", {"screen": "int8", "vocab_size": 1000, "hidden_size": 64}, rank=0)
        for f in CSVMetrics._families.values():
            assert isinstance(f.metric, ray_metrics.Metric), type(f)
        m.record(StepStats(rows=4, csv_rows=3, certified=2, scored=[3, 40], seconds=0.002, screen="int8"),
                 dense_seconds=0.005)
        ray.shutdown()
        print("ray metrics ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=180, capture_output=True, text=True)
    assert "ray metrics ok" in out.stdout


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


def test_unusable_multiprocess_dir_is_replaced_with_one_warning(tmp_path):
    """PROMETHEUS_MULTIPROC_DIR set to a path that cannot hold files (here under a regular file,
    which even root cannot write): the API server's set-up swaps in a fresh directory with one
    warning, and metrics created afterwards (vLLM's and CSV's) work there."""
    (tmp_path / "a_file").write_text("")
    bad = str(tmp_path / "a_file" / "prom")
    code = """
        import os
        from prometheus_client import Counter
        from vllm_csv.head import StepStats
        from vllm_csv.metrics import CSVMetrics, ensure_multiprocess_dir
        path = ensure_multiprocess_dir()
        assert path and os.environ["PROMETHEUS_MULTIPROC_DIR"] == path != %r, path
        Counter("vllm_like_total", "a metric of vLLM's own").inc()
        CSVMetrics("demo", {"screen": "int8"}).record(StepStats(rows=2, csv_rows=2, certified=1, seconds=0.001))
        print(sorted(os.listdir(path)))
    """ % bad
    r = _run(code, {"PROMETHEUS_MULTIPROC_DIR": bad})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "counter_" in r.stdout
    warnings = [ln for ln in r.stderr.splitlines() if "is unusable" in ln]
    assert len(warnings) == 1 and "Not a directory" in warnings[0], r.stderr[-3000:]
    good = tmp_path / "good"
    good.mkdir()
    r = _run("from vllm_csv.metrics import ensure_multiprocess_dir; print(ensure_multiprocess_dir())",
             {"PROMETHEUS_MULTIPROC_DIR": str(good)})
    assert r.returncode == 0 and r.stdout.strip() == str(good) and "unusable" not in r.stderr, r.stderr


def test_no_directory_at_all_turns_multiprocess_metrics_off(tmp_path):
    (tmp_path / "a_file").write_text("")
    code = """
        import os, tempfile
        from prometheus_client import Counter, REGISTRY, values
        def refuse(*a, **k):
            raise OSError(28, "No space left on device")
        tempfile.mkdtemp = refuse
        from vllm_csv.metrics import ensure_multiprocess_dir
        assert ensure_multiprocess_dir() is None
        assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ and values.ValueClass is values.MutexValue
        c = Counter("vllm_like_total", "a metric of vLLM's own")
        c.inc()
        print(REGISTRY.get_sample_value("vllm_like_total"))
    """
    r = _run(code, {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "a_file" / "prom")})
    assert r.returncode == 0 and r.stdout.strip() == "1.0", r.stderr[-3000:]
    assert sum("metrics of the engine processes, CSV-Decode's included, are off" in ln
               for ln in r.stderr.splitlines()) == 1, r.stderr[-3000:]


def test_worker_that_cannot_create_metric_files_serves_without_metrics(tmp_path):
    """The directory vanished between the API server's check and the worker's first head:
    ``create_metrics`` returns None with one warning instead of failing the start-up."""
    code = """
        from vllm_csv.metrics import create_metrics
        print(create_metrics("demo", {"screen": "int8"}))
    """
    r = _run(code, {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "gone")})
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stderr[-3000:]
    assert sum("CSV-Decode metrics are off in this process" in ln for ln in r.stderr.splitlines()) == 1, r.stderr


def test_batched_updates_equal_prometheus_own_and_reach_it_within_the_flush_interval():
    """record() adds a step up in process; the flusher thread writes it within FLUSH_SECONDS, and
    the per-bucket histogram update writes exactly what prometheus-client's observe() would
    (values on bucket bounds, between them, beyond the last, negative, NaN-free)."""
    code = """
        import time
        from prometheus_client import CollectorRegistry, Histogram
        from vllm_csv import metrics
        from vllm_csv.head import StepStats
        reg = CollectorRegistry()
        a = Histogram("a", "x", buckets=metrics.SCORED_BUCKETS, registry=reg)
        b = Histogram("b", "x", buckets=metrics.SCORED_BUCKETS, registry=reg)
        vals = [0, 1, 1.5, 2, 3, 4, 64, 65, 262144, 262145, 1e9, -3, 16, 16, 16]
        for v in vals:
            a.observe(v)
        metrics._observe_all(b, vals)
        got = {f.name: [(x.name[1:], x.labels, x.value) for x in f.samples if not x.name.endswith("_created")]
               for f in reg.collect()}
        assert got["a"] == got["b"] and len(got["a"]) == len(metrics.SCORED_BUCKETS) + 3, got
        m = metrics.CSVMetrics("demo", {"screen": "int8", "vocab_size": 1000, "hidden_size": 64})
        m.record(StepStats(rows=4, csv_rows=3, certified=2, scored=[3, 40], seconds=0.002, screen="int8"))
        assert m.rows._value.get() == 0.0  # added up in process, not yet written
        time.sleep(metrics.FLUSH_SECONDS * 5)
        assert m.rows._value.get() == 4.0 and m.scored._sum.get() == 43.0
        print("ok")
    """
    out = _run(code, {})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
