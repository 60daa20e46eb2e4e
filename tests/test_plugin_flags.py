"""The --csv-* flags on vLLM's own `vllm serve` parser, and their mapping to additional_config."""

import argparse

import pytest
import torch

pytest.importorskip("vllm")

from vllm_csv.errors import CSVError  # noqa: E402
from vllm_csv.vllm_plugin import check_vllm_version, register  # noqa: E402
from vllm_csv.vllm_plugin.cli_args import apply_csv_args  # noqa: E402
from vllm_csv.vllm_plugin.config import from_additional_config  # noqa: E402


@pytest.fixture(scope="module")
def serve_parser():
    register()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def engine_args(parser, argv):
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.from_cli_args(parser.parse_args(argv))


def test_flags_map_to_additional_config(serve_parser):
    ea = engine_args(serve_parser, ["--model", "m", "--enable-csv-decode", "--csv-screen", "int4",
                                    "--csv-budget", "0.1"])
    cfg = from_additional_config(ea.additional_config)
    assert (cfg.enabled, cfg.screen, cfg.budget) == (True, "int4", 0.1)
    ea = engine_args(serve_parser, ["--model", "m"])
    assert "csv_decode" not in (ea.additional_config or {})


def test_additional_config_json_is_the_same_thing(serve_parser):
    ea = engine_args(serve_parser, ["--model", "m", "--additional-config",
                                    '{"csv_decode": {"enabled": true, "screen": "ball", "clusters": 12}}'])
    cfg = from_additional_config(ea.additional_config)
    assert (cfg.enabled, cfg.screen, cfg.clusters) == (True, "ball", 12)


@pytest.mark.parametrize("argv,msg", [
    (["--csv-screen", "bogus"], "invalid choice"),
    (["--csv-epsilon", "0.01"], "unrecognized arguments"),  # removed: serving is exact only
    (["--csv-budget", "0"], "budget"),
    (["--csv-max-topk", "0"], "max_topk"),
    (["--csv-index", ""], "index"),  # (was the cache, silently)
    (["--additional-config", '{"csv_decode": true}'], "must be an object"),  # (was a TypeError's traceback)
])
def test_bad_flags_exit_with_one_clear_line(serve_parser, argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        engine_args(serve_parser, ["--model", "m", "--enable-csv-decode", *argv])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_config_validation_and_version_check():
    with pytest.raises(CSVError, match="screen"):
        from_additional_config({"csv_decode": {"enabled": True, "screen": "x"}})
    with pytest.raises(CSVError, match="unknown_key"):
        from_additional_config({"csv_decode": {"unknown_key": 1}})
    assert from_additional_config(None).enabled is False
    # vLLM allows an object of its own as additional_config: no section there, CSV off (was an
    # AttributeError at every LogitsProcessor's construction); a section that is not an object
    # is an error, not silently off
    assert from_additional_config(object()).enabled is False
    for bad in (True, 0, [], "on"):
        with pytest.raises(CSVError, match="must be an object"):
            from_additional_config({"csv_decode": bad})
    assert apply_csv_args(argparse.Namespace(), {"x": 1}) == {"x": 1}
    assert check_vllm_version("0.32.0") is None and check_vllm_version("0.32.1+cpu") is None
    assert "supports vLLM 0.32.x, 0.33.x;" in check_vllm_version("0.34.0")  # (0.33: tests/test_vllm033.py)


@pytest.mark.parametrize("damage,msg", [("missing", "not found"), ("garbage", "not a safetensors file"),
                                        ("flipped", "do not match the digest"), (None, None)])
def test_deleted_or_damaged_index_stops_serve_with_one_line(serve_parser, tmp_path, capsys, damage, msg):
    """``--csv-index`` is loaded in the API server, before any engine process starts: a file
    deleted or damaged before a restart is one line and exit code 2, not the worker's traceback
    relayed through the engine core and the API server."""
    import torch

    from vllm_csv import build_index

    p = tmp_path / "i.safetensors"
    build_index(torch.randn(300, 16, generator=torch.Generator().manual_seed(0)), None, 5, progress=False).save(p)
    if damage == "missing":
        p.unlink()
    elif damage == "garbage":
        p.write_bytes(b"not an index")
    elif damage == "flipped":
        raw = bytearray(p.read_bytes())
        raw[-3] ^= 0x10
        p.write_bytes(bytes(raw))
    argv = ["--model", "m", "--csv-screen", "ball", "--csv-index", str(p)]
    if damage is None:
        assert from_additional_config(engine_args(serve_parser, argv).additional_config).index == str(p)
        return
    with pytest.raises(SystemExit) as e:
        engine_args(serve_parser, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("vllm serve: error: CSV index ") and str(p) in err[0] and msg in err[0], err


def test_a_tensor_parallel_index_is_checked_by_its_shards_files(serve_parser, tmp_path, capsys):
    """With ``--tensor-parallel-size N`` the ranks read ``PATH``'s shard files (what ``vllm-csv
    build-index --tensor-parallel-size N`` writes, and nothing at ``PATH``): the API server checks
    those (found by review: it loaded ``PATH`` itself, so the documented workflow could not start);
    a missing shard file is still one line."""
    import torch

    from vllm_csv import build_index
    from vllm_csv.cache import shard_index_path

    p = tmp_path / "head.safetensors"
    for r in range(2):
        build_index(torch.randn(300, 16, generator=torch.Generator().manual_seed(r)), None, 5,
                    progress=False).save(shard_index_path(p, r, 2))
    argv = ["--model", "m", "--csv-screen", "ball", "--csv-index", str(p), "--tensor-parallel-size", "2"]
    assert from_additional_config(engine_args(serve_parser, argv).additional_config).index == str(p)
    shard_index_path(p, 1, 2).unlink()
    with pytest.raises(SystemExit) as e:
        engine_args(serve_parser, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "tp2-rank1" in err[0], err


# The flags of vllm serve as users and tests/e2e know them: name -> (namespace attribute, config key).
SERVE_FLAGS = {"--enable-csv-decode": ("enable_csv_decode", "enabled"), "--csv-screen": ("csv_screen", "screen"),
               "--csv-index": ("csv_index", "index"), "--csv-clusters": ("csv_clusters", "clusters"),
               "--csv-budget": ("csv_budget", "budget"), "--csv-max-topk": ("csv_max_topk", "max_topk")}


def csv_group(parser):
    return next(g for g in parser._action_groups if g.title == "CSV-Decode (vllm-csv)")


def test_flags_are_generated_from_the_config_fields(serve_parser):
    """Every config field but the off-switch has its flag, under the names, types and choices
    users know; nothing is written twice (issue 43)."""
    from vllm_csv.screens import SCREENS
    from vllm_csv.vllm_plugin.cli_args import flags
    from vllm_csv.vllm_plugin.config import CSVDecodeConfig

    assert set(CSVDecodeConfig.model_fields) - set(flags()) == {"off_switch"}
    assert {f: (n, n) for n, f in flags().items()} == {f: (k, k) for f, (_, k) in SERVE_FLAGS.items()}
    acts = {a.option_strings[0]: a for a in csv_group(serve_parser)._group_actions}
    assert set(acts) == set(SERVE_FLAGS)
    assert {f: a.dest for f, a in acts.items()} == {f: d for f, (d, _) in SERVE_FLAGS.items()}
    assert all(a.default is None for a in acts.values())  # None: not given
    assert {f: a.type for f, a in acts.items()} == {"--enable-csv-decode": None, "--csv-screen": None,
                                                   "--csv-index": None, "--csv-clusters": int,
                                                   "--csv-budget": float, "--csv-max-topk": int}
    assert tuple(acts["--csv-screen"].choices) == SCREENS
    assert acts["--enable-csv-decode"].nargs == 0 and acts["--enable-csv-decode"].const is True  # store_true
    assert all(a.choices is None for f, a in acts.items() if f != "--csv-screen")


def test_generated_help_lists_every_field_with_the_models_default(serve_parser):
    """The help ``vllm serve --help=csv`` prints (vLLM's own formatter): each field's description
    and the model's default, once (no argparse "(default: None)")."""
    import re

    from vllm_csv.vllm_plugin.cli_args import flags
    from vllm_csv.vllm_plugin.config import CSVDecodeConfig, default_text

    lines = {}
    for action in csv_group(serve_parser)._group_actions:
        fmt = serve_parser.formatter_class(prog="vllm serve")
        fmt.add_argument(action)
        lines[action.option_strings[0]] = " ".join(fmt.format_help().split())
    assert set(lines) == set(flags().values())
    for name, flag in flags().items():
        info, line = CSVDecodeConfig.model_fields[name], lines[flag]
        assert info.description.rstrip(".") in line and "(default: " not in line, line
        shown = re.fullmatch(r".*\(default ([^()]*)\)\.", line).group(1)
        assert shown == default_text(name)
        if isinstance(info.default, bool):
            assert shown == ("on" if info.default else "off")
        elif info.default is None:  # decided at start-up: the text the field carries
            assert shown == info.json_schema_extra["default_text"]
        else:
            assert type(info.default)(shown) == info.default == getattr(CSVDecodeConfig(), name)


def test_readme_flag_table_is_the_config():
    """The README's serving table names each flag's key and default as the model has them."""
    from pathlib import Path

    from vllm_csv.vllm_plugin.cli_args import flags
    from vllm_csv.vllm_plugin.config import default_text

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = [[c.strip().strip("`") for c in ln.strip("|").split("|")] for ln in readme.splitlines()
            if ln.startswith("| `--")]
    assert {r[0]: (r[1], r[2]) for r in rows} == {f: (n, default_text(n)) for n, f in flags().items()}


def test_any_csv_flag_enables_and_errors_are_one_line():
    ns = argparse.Namespace
    assert apply_csv_args(ns(csv_budget=0.1), None) == {"csv_decode": {
        "enabled": True, "screen": "auto", "budget": 0.1, "max_topk": 64, "off_switch": True}}
    assert from_additional_config(apply_csv_args(ns(enable_csv_decode=True), None)).enabled
    assert from_additional_config(apply_csv_args(ns(csv_index="f"), None)).enabled
    # the JSON's own "enabled" wins over the implied one; flags override its other keys
    out = apply_csv_args(ns(csv_max_topk=8), {"csv_decode": {"enabled": False, "max_topk": 4}, "x": 1})
    assert out["x"] == 1 and (out["csv_decode"]["enabled"], out["csv_decode"]["max_topk"]) == (False, 8)
    for bad, key in ((ns(csv_budget=2.0), "budget"), (ns(csv_clusters=0), "clusters"),
                     (ns(csv_max_topk=2000), "max_topk")):
        with pytest.raises(CSVError) as e:
            apply_csv_args(bad, None)
        assert "\n" not in str(e.value) and str(e.value).startswith(f"invalid csv_decode configuration: {key}: ")


def test_the_plugins_variables_are_declared_to_vllm(monkeypatch):
    """vLLM warns of (or, failing on environment validation, refuses) any VLLM_* variable it does
    not know: VLLM_CSV_CPU_ISA and the plugin's other variables are declared when it registers."""
    from vllm import envs
    from vllm.platforms import current_platform

    from vllm_csv import vllm_plugin

    monkeypatch.setattr(envs, "environment_variables", dict(envs.environment_variables))
    monkeypatch.setenv("VLLM_CSV_CPU_ISA", "avx2")
    monkeypatch.setenv("VLLM_CSV_CPU_KERNELS", "1")
    with pytest.raises(ValueError, match="VLLM_CSV_"):
        current_platform.validate_environ(True)
    vllm_plugin.declare_env()
    current_platform.validate_environ(True)
    assert envs.VLLM_CSV_CPU_ISA == "avx2"


@pytest.mark.parametrize("what", ["--logits-processors", "plugin", "none"])
def test_custom_logits_processors_keep_the_dense_head(what, monkeypatch, caplog):
    """vLLM builds every installed logits-processor plugin (entry point group
    ``vllm.logits_processors``) into every V1 batch, asked for or not, beside ``--logits-processors``:
    they may act on any row (driven by ``extra_args``, which no sampling field shows), so either
    keeps vLLM's own layer, with a warning. Found by review: with a plugin installed, a greedy row
    certified ``k = 1`` came out as token 0 once the plugin banned its argmax."""
    import importlib.metadata
    import logging
    from types import SimpleNamespace

    import torch
    import vllm.config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from vllm_csv.vllm_plugin.logits_processor import CSVLogitsProcessor

    eps = [SimpleNamespace(name="ban_ids")] if what == "plugin" else []
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: eps if group == "vllm.logits_processors" else [])
    mc = SimpleNamespace(logits_processors=["pkg.mod:Ban"] if what == "--logits-processors" else None,
                         dtype=torch.bfloat16, served_model_name="m", model="m")
    vc = SimpleNamespace(additional_config={"csv_decode": {"enabled": True}}, model_config=mc)
    with vllm.config.set_current_vllm_config(vllm.config.VllmConfig()):  # (vLLM's own op reads it)
        monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: vc)  # (the plugin's read)
        with caplog.at_level(logging.WARNING):
            layer = CSVLogitsProcessor(64)
    if what == "none":
        assert type(layer) is CSVLogitsProcessor and "CSV-Decode is off" not in caplog.text
    else:
        assert type(layer) is LogitsProcessor
        assert ("logits-processor plugins installed (ban_ids)" if what == "plugin" else
                "custom --logits-processors") in caplog.text


def test_another_plugins_logits_processor_leaves_csv_uninstalled(monkeypatch, caplog):
    """vLLM allows one out-of-tree ``LogitsProcessor`` (``register_oot`` asserts on a second): with
    another plugin's already registered, CSV installs nothing, with one warning, instead of the
    AssertionError that stopped every vLLM process (found by review)."""
    import logging

    from vllm.model_executor import custom_op

    from vllm_csv.vllm_plugin import patches

    class Other(torch.nn.Module):
        pass

    monkeypatch.setitem(custom_op.op_registry_oot, "LogitsProcessor", Other)
    monkeypatch.setattr(patches, "_engine_args", lambda: pytest.fail("installed"))
    with caplog.at_level(logging.WARNING):
        patches.install(lambda r: 64)
    assert "another plugin already replaces" in caplog.text


def test_a_plugin_loaded_later_replaces_csvs_logits_processor(monkeypatch, caplog):
    """The other order (found by review): vllm-csv registered first, another plugin's
    ``register_oot`` of ``LogitsProcessor`` replaces CSV's with one warning, in both of vLLM's
    forms (a call, a decorator), instead of failing vLLM's duplicate-name assert."""
    import logging

    from vllm.model_executor import custom_op
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from vllm_csv.vllm_plugin import patches
    from vllm_csv.vllm_plugin.logits_processor import CSVLogitsProcessor

    base = custom_op.PluggableLayer
    monkeypatch.setattr(base, "register_oot", base.__dict__["register_oot"])  # (restored after the test)
    for form in ("call", "decorator"):
        monkeypatch.setitem(custom_op.op_registry_oot, "LogitsProcessor", CSVLogitsProcessor)
        patches._yield_to_later_plugins()
        patches._yield_to_later_plugins()  # (once)

        class Other(torch.nn.Module):
            pass

        caplog.clear()
        with caplog.at_level(logging.WARNING):
            if form == "call":
                LogitsProcessor.register_oot(Other)
            else:
                LogitsProcessor.register_oot()(Other)
        assert custom_op.op_registry_oot["LogitsProcessor"] is Other
        assert caplog.text.count("another plugin replaces") == 1
