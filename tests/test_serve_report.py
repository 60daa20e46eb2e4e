"""The serving benchmark's summary of several server pairs (vllm_csv/testing/serve_bench.py, run by
benchmarks/serve.py): medians of per-pair ratios."""

from vllm_csv.testing import serve_bench as serve


def _pair(dense: float, csv: float, identical: bool = True, certified: float = 10.0) -> dict:
    return {"workloads": {"greedy": {"dense_tokens_per_s": dense, "csv_tokens_per_s": csv,
                                     "speedup": round(csv / dense, 3), "identical_outputs": identical}},
            "rows_total": 100.0, "csv_rows": 80.0, "certified_by_mode": {"greedy": certified},
            "fallbacks": {"off_switch": 70.0 - certified}, "csv_metrics": {}}


def test_pairs_give_the_median_ratio_and_sum_the_counts():
    # a slow pair (both servers slow: drift) does not move the median ratio; pooled tokens/s would
    pairs = [_pair(1000.0, 990.0), _pair(600.0, 600.0), _pair(1000.0, 1010.0, identical=False)]
    s = serve.combine(pairs)
    g = s["workloads"]["greedy"]
    assert g["speedup"] == 1.0
    assert g["speedup_by_pair"] == [0.99, 1.0, 1.01]
    assert g["dense_tokens_per_s"] == 1000.0 and g["csv_tokens_per_s"] == 990.0
    assert g["identical_outputs"] is False  # one pair differed: reported, not averaged away
    assert s["rows_total"] == 300.0 and s["csv_rows"] == 240.0
    assert s["certified_by_mode"] == {"greedy": 30.0} and s["fallbacks"] == {"off_switch": 180.0}
    assert s["certified_share_of_csv_rows"] == 30.0 / 240.0
    assert "1.0x (pairs: 0.99x, 1.0x, 1.01x)" in serve.markdown(dict(s, csv_head_ms_mean=None,
                                                                   head_seconds_saved_total=None), "m", "x")


def test_interleaved_rounds_alternate_and_give_the_median_ratio(monkeypatch):
    """--interleave: both servers up at once, rounds in ABBA order, the speed-up the median of the
    rounds' ratios (a slow round, both sides slow, does not move it), outputs compared."""
    import contextlib
    from types import SimpleNamespace

    calls = []
    clock = [0.0]
    slow = {2}  # the machine drifts during the third round: both servers slow there

    @contextlib.contextmanager
    def fake_server(model, csv, args):
        def complete(params):
            r = sum(1 for c in calls if c[1]) // 2  # rounds done (two turns a round)
            calls.append((csv, True))
            clock[0] += (1.0 if csv else 1.25) * (3.0 if r in slow else 1.0)  # CSV 1.25x dense
            return {"choices": [{"index": 0, "text": "same"}], "usage": {"completion_tokens": 100}}
        yield complete, f"csv={csv}"

    monkeypatch.setattr(serve, "server", fake_server)
    monkeypatch.setattr(serve, "csv_metrics", lambda base: {})
    monkeypatch.setattr(serve, "spec_metrics", lambda base: {})
    monkeypatch.setattr(serve.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(serve.time, "sleep", lambda s: None)
    args = SimpleNamespace(mixed=False, workloads=["greedy"], rounds=4, pause=0.0, per_turn=1, csv_first=False)
    s = serve.run_interleaved("m", args)
    g = s["workloads"]["greedy"]
    assert [c for c, _ in calls] == [False, True, True, False, False, True, True, False]
    assert g["speedup_by_round"] == [1.25] * 4 and g["speedup"] == 1.25
    assert g["identical_outputs"] is True
    assert g["dense_tokens_per_s"] == round(400 / (1.25 * 6), 1)


def test_server_flags_control_and_order():
    """--control makes the CSV side a second plain server (no CSV flag, its own port); --csv-first
    gives the CSV server the first port; any CSV flag goes to the CSV server only."""
    from types import SimpleNamespace

    def args(**k):
        return SimpleNamespace(**dict(dict(port=8110, csv_first=False, control=False, screen="int8",
                                           no_off_switch=True), **k))

    assert serve.server_flags(False, args()) == (8110, [])
    port, flags = serve.server_flags(True, args())
    assert port == 8111 and flags[:3] == ["--enable-csv-decode", "--csv-screen", "int8"]
    assert '"off_switch": false' in flags[-1]
    assert serve.server_flags(True, args(control=True)) == (8111, [])
    assert serve.server_flags(True, args(csv_first=True))[0] == 8110
    assert serve.server_flags(False, args(csv_first=True)) == (8111, [])


def test_speculative_counters_are_read_with_the_acceptance_rate():
    from vllm_csv.serve import parse_spec_metrics

    text = "\n".join([
        '# TYPE vllm:spec_decode_num_drafts_total counter',
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0',
        'vllm:generation_tokens_total{model_name="m"} 99.0'])
    m = parse_spec_metrics(text)
    assert m["spec_decode_num_drafts"] == 10 and m["spec_decode_num_draft_tokens"] == 30
    assert m["spec_decode_num_accepted_tokens"] == 12 and m["spec_decode_num_accepted_tokens_per_pos"] == 12
    assert m["acceptance_rate"] == 0.4 and "generation_tokens" not in str(m)
    assert parse_spec_metrics("vllm:generation_tokens_total 5.0") == {}


def test_dense_server_is_vllm_alone():
    """The dense server does not load the plugin (its baseline is vLLM's own), unless
    --dense-plugin; under --control both servers are alike; the environment names every other
    installed general plugin, never this one."""
    from types import SimpleNamespace

    from vllm_csv.serve import PLUGIN_ENTRY_POINT, without_plugin

    def args(**k):
        return SimpleNamespace(**dict(dict(control=False, dense_plugin=False), **k))

    assert not serve.loads_plugin(False, args()) and serve.loads_plugin(True, args())
    assert not serve.loads_plugin(True, args(control=True)) and not serve.loads_plugin(False, args(control=True))
    assert serve.loads_plugin(False, args(dense_plugin=True)) and serve.loads_plugin(True, args(dense_plugin=True, control=True))
    env = without_plugin({"A": "1"})
    assert env["A"] == "1" and env["VLLM_PLUGINS"]
    assert PLUGIN_ENTRY_POINT not in env["VLLM_PLUGINS"].split(",")
    from importlib.metadata import entry_points

    assert PLUGIN_ENTRY_POINT in {e.name for e in entry_points(group="vllm.general_plugins")}  # installed as named


def test_warmup_rounds_run_first_and_are_left_out_of_the_counts(monkeypatch):
    """--warmup-rounds: each server runs them before the timed rounds (untimed, outputs not
    compared); CSV's counts and vLLM's speculative counters are those of the timed rounds alone
    (the end's less the warm-up's), the whole run's certified share reported beside."""
    import contextlib
    from types import SimpleNamespace

    calls, clock = [], [0.0]
    counts = {True: 0, False: 0}  # requests served so far, per server

    @contextlib.contextmanager
    def fake_server(model, csv, args):
        def complete(params):
            calls.append(csv)
            counts[csv] += 1
            clock[0] += 1.0
            return {"choices": [{"index": 0, "text": "same"}], "usage": {"completion_tokens": 100}}
        yield complete, csv

    def metrics(csv):  # 10 rows a request; the first two requests' rows all dense (warm-up)
        n = counts[csv]
        return {"csv_decode_info{screen=\"int8\"}": 1.0, "csv_decode_rows_total": 10.0 * n,
                "csv_decode_csv_rows_total": 10.0 * n,
                'csv_decode_rows_certified_total{mode="greedy"}': 10.0 * max(0, n - 2),
                "csv_decode_rows_certified_total": 10.0 * max(0, n - 2)}

    monkeypatch.setattr(serve, "server", fake_server)
    monkeypatch.setattr(serve, "csv_metrics", metrics)
    monkeypatch.setattr(serve, "spec_metrics", lambda csv: {"spec_decode_num_draft_tokens": 3.0 * counts[csv],
                                                           "spec_decode_num_accepted_tokens": 1.0 * counts[csv] ** 2,
                                                           "acceptance_rate": counts[csv] / 3.0})
    monkeypatch.setattr(serve.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(serve.time, "sleep", lambda s: None)
    args = SimpleNamespace(mixed=False, workloads=["greedy"], rounds=4, pause=0.0, per_turn=1, csv_first=False,
                           warmup_rounds=2)
    s = serve.run_interleaved("m", args)
    assert calls[:4] == [False, False, True, True]  # the warm-up rounds, each server's in turn
    assert s["rows_total"] == 40.0 and s["certified_share_of_all_rows"] == 1.0  # the timed rounds alone
    assert s["certified_share_with_warmup"] == 40.0 / 60.0 and s["warmup_rounds"] == 2
    assert s["csv_metrics"]['csv_decode_info{screen="int8"}'] == 1.0
    spec = s["spec_decode"]["csv"]
    assert spec["spec_decode_num_draft_tokens"] == 12.0 and spec["acceptance_rate"] == round((36 - 4) / 12.0, 4)
    assert "after 2 untimed warm-up rounds per server" in serve.markdown(
        dict(s, csv_head_ms_mean=None, head_seconds_saved_total=None), "m", "x")
    args.warmup_rounds = 0  # without: the end's counts, warm-up requests and all
    counts.update({True: 0, False: 0})
    plain = serve.run_interleaved("m", args)
    assert plain["rows_total"] == 40.0 and plain["certified_share_of_all_rows"] == 20.0 / 40.0
    assert "warmup_rounds" not in plain and "certified_share_with_warmup" not in plain
