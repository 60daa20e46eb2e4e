"""The --csv-* flags on vLLM's own `vllm serve` parser, and their mapping to additional_config."""

import argparse

import pytest

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
    assert apply_csv_args(argparse.Namespace(), {"x": 1}) == {"x": 1}
    assert check_vllm_version("0.32.0") is None and check_vllm_version("0.32.1+cpu") is None
    assert "supports vLLM 0.32" in check_vllm_version("0.33.0")


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
