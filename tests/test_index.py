"""Index build, round trip, fingerprint checks, corrupt files, the CLI."""

import json
import logging
import subprocess
import sys
import tempfile

import pytest
import torch
from safetensors.torch import save_file

from vllm_csv import CSVError, CSVIndex, build_index, fingerprint_weights
from vllm_csv.index import FORMAT_VERSION, tensors_digest
from vllm_csv.cli import main
from vllm_csv.hf_head import load_lm_head


@pytest.fixture
def head():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1009, 24, generator=g), torch.randn(1009, generator=g)


@pytest.mark.parametrize("method", ["torch", "sklearn"])
def test_radii_and_bias_bound_every_row(head, method):
    W, b = head
    idx = build_index(W, b, 15, method=method, progress=False)
    c = idx.cluster_of()
    assert idx.num_clusters <= 15 and int(idx.sizes.sum()) == W.shape[0]
    dist = (W.double() - idx.centroids.double()[c]).norm(dim=1)
    assert (dist <= idx.radii.double()[c]).all()
    assert (b.double() <= idx.bias_max.double()[c]).all()
    assert (W.double().norm(dim=1) <= idx.row_norm_max.double()[c]).all()


def test_round_trip_and_fingerprint(head, tmp_path):
    W, b = head
    idx = build_index(W, b, 20, progress=False)
    p = idx.save(tmp_path / "i.safetensors")
    back = CSVIndex.load(p, expect_fingerprint=fingerprint_weights(W, b))
    for name in ("perm", "offsets", "centroids", "radii", "bias_max", "row_norm_max"):
        assert torch.equal(getattr(back, name), getattr(idx, name))
    W2 = W.clone()
    W2[3, 4] += 1e-3
    with pytest.raises(CSVError, match="built for other weights"):
        CSVIndex.load(p, expect_fingerprint=fingerprint_weights(W2, b))
    assert fingerprint_weights(W, None) != fingerprint_weights(W, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wrong", ["radii", "bias_max", "row_norm_max", None])
def test_a_file_whose_numbers_do_not_bound_its_weights_is_refused(head, tmp_path, wrong, dtype):
    """The fingerprint says which weights a file was built for, not that its numbers are right for
    them: a file with the right fingerprint and a radius, bias maximum or row-norm maximum below
    what the rows need (written by another tool, a bug, an edit; saved with a fresh digest) is
    refused when a ball screen takes it (found by review: such a file certified wrong tokens);
    the file ``build_index`` writes passes, in fp32 and bf16."""
    from vllm_csv import CertifiedHead, HeadConfig

    W, b = head[0].to(dtype), head[1].to(dtype)
    idx = build_index(W, b, 20, progress=False)
    if wrong is not None:
        t = getattr(idx, wrong).clone()
        t[int(torch.argmax(idx.sizes))] -= 1e-3 * (t.abs().max() + 1)  # one cluster's number, below its rows
        setattr(idx, wrong, t)
    back = CSVIndex.load(idx.save(tmp_path / "i.safetensors"), expect_fingerprint=fingerprint_weights(W, b))
    if wrong is None:
        CertifiedHead(W, b, config=HeadConfig(screen="ball"), index=back)
    else:
        with pytest.raises(CSVError, match="do not bound this head's rows"):
            CertifiedHead(W, b, config=HeadConfig(screen="ball"), index=back)


def test_corrupt_and_inconsistent_files(head, tmp_path):
    W, b = head
    p = build_index(W, b, 10, progress=False).save(tmp_path / "i.safetensors")
    raw = p.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CSVError, match="corrupt"):
        CSVIndex.load(tmp_path / "trunc.safetensors")
    with pytest.raises(CSVError, match="not found"):
        CSVIndex.load(tmp_path / "missing.safetensors")
    t = CSVIndex.load(p)
    bad = {"perm": t.perm.flip(0)[:-1], "offsets": t.offsets, "centroids": t.centroids, "radii": t.radii,
           "bias_max": t.bias_max, "row_norm_max": t.row_norm_max}
    save_file(bad, str(tmp_path / "bad.safetensors"),
              metadata={"format_version": FORMAT_VERSION, "fingerprint": "x", "digest": tensors_digest(bad)})
    with pytest.raises(CSVError, match="inconsistent"):
        CSVIndex.load(tmp_path / "bad.safetensors")
    save_file({"perm": t.perm}, str(tmp_path / "v0.safetensors"), metadata={"format_version": "0"})
    with pytest.raises(CSVError, match="format version"):
        CSVIndex.load(tmp_path / "v0.safetensors")


def flip_bit(path, offset_from_end: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(raw))


def test_damaged_tensor_bytes_are_refused(head, tmp_path):
    """A bit flipped in the tensors' bytes (the end of the file) leaves a readable file that
    may pass the consistency checks with an unsound bound: the digest refuses it."""
    W, b = head
    p = build_index(W, b, 10, progress=False).save(tmp_path / "i.safetensors")
    CSVIndex.load(p)
    for offset in (1, 7, 41):
        q = tmp_path / f"flip{offset}.safetensors"
        q.write_bytes(p.read_bytes())
        flip_bit(q, offset)
        with pytest.raises(CSVError, match="do not match the digest"):
            CSVIndex.load(q)


def test_index_at_start_up_deleted_or_damaged(head, tmp_path, monkeypatch, caplog):
    """``index_loader``: a given file that is missing or damaged stops start-up with a CSVError;
    a cached one is rebuilt (one warning) and written back."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm_csv.cache import index_path
    from vllm_csv.vllm_plugin.index_loader import load_or_build_index

    W, b = head
    monkeypatch.setenv("VLLM_CSV_CACHE", str(tmp_path / "cache"))
    given = build_index(W, b, 10, progress=False).save(tmp_path / "given.safetensors")
    cfg = SimpleNamespace(index=str(given), clusters=None)
    assert load_or_build_index(W, b, cfg).fingerprint == fingerprint_weights(W, b)
    flip_bit(given, 3)
    with pytest.raises(CSVError, match="corrupt"):
        load_or_build_index(W, b, cfg)
    given.unlink()
    with pytest.raises(CSVError, match="not found"):
        load_or_build_index(W, b, cfg)

    cfg = SimpleNamespace(index=None, clusters=10)
    built = load_or_build_index(W, b, cfg)  # no cache yet: built and cached
    cached = index_path(fingerprint_weights(W, b), 10)
    assert cached.is_file()
    for damage in ("flip", "garbage", "delete"):
        if damage == "flip":
            flip_bit(cached, 5)
        elif damage == "garbage":
            cached.write_bytes(b"not an index")
        else:
            cached.unlink()
        caplog.clear()
        again = load_or_build_index(W, b, cfg)
        assert torch.equal(again.radii, built.radii) and CSVIndex.load(cached).fingerprint == built.fingerprint
        assert (damage == "delete") != any("unusable" in r.getMessage() for r in caplog.records), damage


def test_a_head_does_not_read_its_index_file_again(head, tmp_path):
    """The index is read once, at start-up: deleting or overwriting the file while serving
    changes nothing."""
    from vllm_csv import CertifiedHead, HeadConfig

    W, b = head
    p = build_index(W, b, 10, progress=False).save(tmp_path / "i.safetensors")
    h = CertifiedHead(W, b, config=HeadConfig(screen="ball", budget=1.0, off_switch=False), index=CSVIndex.load(p))
    x = torch.randn(6, W.shape[1], generator=torch.Generator().manual_seed(1)) * 4
    k = torch.ones(6, dtype=torch.long)
    before, _ = h.sampler_logits(x, k)
    p.write_bytes(b"garbage")
    after, _ = h.sampler_logits(x, k)
    p.unlink()
    last, stats = h.sampler_logits(x, k)
    assert torch.equal(before, after) and torch.equal(before, last) and stats.certified > 0
    assert torch.equal(last.argmax(1), (x @ W.T + b).argmax(1))


def test_bad_input_to_build(head):
    W, b = head
    with pytest.raises(CSVError, match="between 1"):
        build_index(W, b, 5000, progress=False)
    W = W.clone()
    W[0, 0] = float("nan")
    with pytest.raises(CSVError, match="NaN"):
        build_index(W, progress=False)


def write_model(d, W, b=None, tied=False, extra=None, arch=None):
    """A checkpoint; with a bias, by default a GPT-J's (the architecture whose vLLM model adds it)."""
    d.mkdir(parents=True, exist_ok=True)
    arch = arch or ("GPTJForCausalLM" if b is not None else "LlamaForCausalLM")
    (d / "config.json").write_text(json.dumps({"architectures": [arch], "vocab_size": W.shape[0],
                                               "tie_word_embeddings": tied}))
    t = {"model.embed_tokens.weight": W.clone(), "model.norm.weight": torch.ones(W.shape[1])}
    if not tied:
        t["lm_head.weight"] = W.clone() * 2
    if b is not None:
        t["lm_head.bias"] = b
    t.update(extra or {})
    save_file(t, str(d / "model.safetensors"))
    return d


def test_hf_head_loader(head, tmp_path):
    W, b = head
    h = load_lm_head(write_model(tmp_path / "m", W, b))
    assert torch.equal(h.weight, W * 2) and torch.equal(h.bias, b) and h.source == "lm_head.weight"
    h = load_lm_head(write_model(tmp_path / "tied", W, tied=True))
    assert torch.equal(h.weight, W) and h.bias is None
    with pytest.raises(CSVError, match="quantized"):
        load_lm_head(write_model(tmp_path / "q", W, extra={"lm_head.weight_scale": torch.ones(1)}))
    with pytest.raises(CSVError, match="not found"):
        load_lm_head(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CSVError, match="config.json"):
        load_lm_head(tmp_path / "empty")
    bad = write_model(tmp_path / "corrupt", W)
    (bad / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(CSVError, match="corrupt"):
        load_lm_head(bad)


def test_a_bias_vllm_does_not_add_is_not_indexed(head, tmp_path):
    """PhiMoE and Moondream 3 checkpoints hold an ``lm_head.bias`` their vLLM model does not
    pass to the head: ``build-index`` indexes the head vLLM serves, without it, so the server
    accepts the file (found by review: the index held the bias, the worker refused it and told
    the user to rebuild it, which wrote the same file again)."""
    W, b = head
    h = load_lm_head(write_model(tmp_path / "phimoe", W, b, arch="PhiMoEForCausalLM"))
    assert torch.equal(h.weight, W * 2) and h.bias is None
    out = tmp_path / "x.safetensors"
    assert main(["build-index", str(tmp_path / "phimoe"), "--clusters", "12", "--output", str(out), "--quiet"]) == 0
    CSVIndex.load(out, expect_fingerprint=fingerprint_weights(W * 2, None))


def test_a_bias_the_transformers_backend_adds_is_indexed_with_bias_yes(head, tmp_path, monkeypatch):
    """vLLM's Transformers backend adds ``lm_head.bias`` whatever the architecture: ``build-index
    --bias yes`` indexes it, and an index built without it (``auto``) is refused at start-up with
    that flag named (found by review: the message said to rebuild, which wrote the same file)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm_csv.vllm_plugin.index_loader import load_or_build_index

    W, b = head
    m = write_model(tmp_path / "m", W, b, arch="SomeNewForCausalLM")
    assert load_lm_head(m).bias is None and torch.equal(load_lm_head(m, "yes").bias, b)
    assert load_lm_head(write_model(tmp_path / "g", W, b), "no").bias is None
    out = tmp_path / "x.safetensors"
    assert main(["build-index", str(m), "--clusters", "12", "--output", str(out), "--quiet"]) == 0
    with pytest.raises(CSVError, match="--bias yes"):
        load_or_build_index(W * 2, b, SimpleNamespace(index=str(out), clusters=None))
    assert main(["build-index", str(m), "--clusters", "12", "--output", str(out), "--quiet", "--bias", "yes"]) == 0
    assert load_or_build_index(W * 2, b, SimpleNamespace(index=str(out), clusters=None)).fingerprint == \
        fingerprint_weights(W * 2, b)
    with pytest.raises(CSVError) as e:  # (another head altogether: no bias hint)
        load_or_build_index(W * 3, b, SimpleNamespace(index=str(out), clusters=None))
    assert "--bias" not in str(e.value)


def test_cli_build_index(head, tmp_path, capsys):
    W, b = head
    m = write_model(tmp_path / "m", W, b)
    out = tmp_path / "idx" / "x.safetensors"
    assert main(["build-index", str(m), "--clusters", "12", "--output", str(out), "--quiet"]) == 0
    idx = CSVIndex.load(out, expect_fingerprint=fingerprint_weights(W * 2, b))
    assert idx.num_clusters <= 12
    assert "12 clusters" in capsys.readouterr().err or idx.num_clusters < 12
    # An fp32 checkpoint served in bf16: the index of the weights as served
    assert main(["build-index", str(m), "--clusters", "12", "--output", str(out), "--quiet", "--dtype", "bfloat16"]) == 0
    CSVIndex.load(out, expect_fingerprint=fingerprint_weights((W * 2).bfloat16(), b.bfloat16()))
    with pytest.raises(CSVError, match="built for other weights"):
        CSVIndex.load(out, expect_fingerprint=fingerprint_weights(W * 2, b))


def test_cli_build_index_per_tp_shard(head, tmp_path, capsys):
    """``--tensor-parallel-size 2``: one file per shard (vLLM's layout), named as the server reads
    them, each fingerprinted on its shard's real rows."""
    from vllm_csv.cache import shard_index_path
    from vllm_csv.sharded import Shard

    W, b = head
    m = write_model(tmp_path / "m", W, b)
    out = tmp_path / "x.safetensors"
    assert main(["build-index", str(m), "--clusters", "4", "--output", str(out), "--quiet",
                 "--tensor-parallel-size", "2"]) == 0
    printed = capsys.readouterr().out.split()
    V = W.shape[0]
    for r in range(2):
        sh = Shard.vllm_layout(V, r, 2)
        rows = slice(sh.start, sh.start + sh.real)
        path = shard_index_path(out, r, 2)
        assert str(path) in printed
        idx = CSVIndex.load(path, expect_fingerprint=fingerprint_weights((W * 2)[rows], b[rows]))
        assert idx.vocab_size == sh.real
    assert not out.exists()


def test_cli_errors_are_one_line_and_leave_no_file(head, tmp_path):
    W, b = head
    m = write_model(tmp_path / "m", W, b)
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "file").write_text("")  # a path under a regular file is unwritable, even for root
    cases = [[str(tmp_path / "missing")], [str(m), "--clusters", "0"],
             [str(m), "--output", str(ro / "file" / "x.safetensors")]]
    for args in cases:
        r = subprocess.run([sys.executable, "-m", "vllm_csv.cli", "build-index", *args, "--quiet"],
                           capture_output=True, text=True)
        assert r.returncode == 1, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("vllm-csv: error:"), r.stderr
        assert "Traceback" not in r.stderr
    assert [p.name for p in ro.iterdir()] == ["file"]


def test_cli_serve_arguments(monkeypatch):
    """`vllm-csv serve [MODEL] [--once] [-- vllm serve flags]`: flags after MODEL are ours,
    everything after `--` is vLLM's (before, `serve MODEL --once` sent `--once` to vLLM)."""
    from vllm_csv import cli

    seen = []
    monkeypatch.setattr("vllm_csv.serve.serve", lambda model, host, port, once, extra, timeout:
                        seen.append((model, once, extra)) or 0)
    assert cli.main(["serve", "M", "--once"]) == 0
    assert cli.main(["serve", "--once", "--", "--dtype", "bfloat16"]) == 0
    assert cli.main(["serve", "M", "--", "--once"]) == 0
    assert seen == [("M", True, []), (None, True, ["--dtype", "bfloat16"]), ("M", False, ["--once"])]
    with pytest.raises(SystemExit):
        cli.main(["build-index", "X", "--", "--y"])


def test_serve_forwards_output_and_drops_only_teardown_noise():
    """The main job copies the server's output; triton's nanobind leak lists (printed by a
    process at exit, whoever stopped it) are counted, not printed; once it has asked the
    server to stop, so is the resource tracker's report; anything else (an error) still shows."""
    import io

    from vllm_csv.serve import _Forward

    tracker = "/usr/lib/python3.12/multiprocessing/resource_tracker.py:279: UserWarning: resource_tracker: There appear to be 1 leaked semaphore objects\n"
    lines = ["INFO started\n", "nanobind: leaked 3 types!\n", ' - leaked type "x"\n', "ERROR real problem\n",
             "INFO - leaked objects are not ours\n", tracker,
             "See https://nanobind.readthedocs.io/en/latest/refleaks.html\n"]
    kept = ["INFO started\n", "ERROR real problem\n", "INFO - leaked objects are not ours\n"]
    out = io.StringIO()
    f = _Forward(iter(lines), out)
    f.close()
    assert out.getvalue() == "".join(kept + [tracker]) and f.dropped == 3  # while serving
    out = io.StringIO()
    f = _Forward(iter([]), out)
    f.thread.join()
    f.stream, f.stop = iter(lines), True
    f._run()
    assert out.getvalue() == "".join(kept) and f.dropped == 4



# vLLM 0.32's shutdown race report, as the API server logged it after a `vllm-csv serve --once`.
_RACE = [f"(APIServer pid=1) ERROR 11-23 17:04:38 [async_llm.py:906] {t}\n" for t in (
    "AsyncLLM output_handler failed.", "Traceback (most recent call last):",
    '  File "vllm/v1/engine/core_client.py", line 1235, in get_output_async',
    "    raise self._format_exception(outputs) from None",
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.")]


def _forward_after_stop(lines):
    import io

    from vllm_csv.serve import _Forward

    out = io.StringIO()
    f = _Forward(iter([]), out)
    f.thread.join()
    f.stream, f.stop = iter(lines), True
    f._run()
    return out.getvalue(), f


@pytest.mark.parametrize("after", [["(APIServer pid=1) INFO [launcher.py:279] engine client stopped\n"], []])
def test_serve_counts_vllms_shutdown_race_after_the_stop_only(after):
    """Once the wrapper has asked the server to stop, vLLM's known shutdown race report
    (`output_handler failed` ending in EngineDeadError, vllm-project/vllm#48745) is counted, the
    lines around it are printed; the same report while serving is printed, and so is an
    `output_handler failed` ending in any other error, or one cut off before its end."""
    import io

    from vllm_csv.serve import _Forward

    head = ["(APIServer pid=1) INFO [core_client.py:777] MPClient: complete\n"]
    text, f = _forward_after_stop(head + _RACE + after)
    assert text == "".join(head + after) and f.race == 1
    other = [line.replace("vllm.v1.engine.exceptions.EngineDeadError", "ValueError") for line in _RACE]
    text, f = _forward_after_stop(head + other + after)
    assert text == "".join(head + other + after) and f.race == 0
    text, f = _forward_after_stop(head + _RACE[:-1])
    assert text == "".join(head + _RACE[:-1]) and f.race == 0
    out = io.StringIO()
    _Forward(iter(_RACE + after), out).close()
    assert out.getvalue() == "".join(_RACE + after)


def test_a_cache_that_cannot_be_written_keeps_the_built_index(head, tmp_path, monkeypatch, caplog):
    """A cache directory that cannot be written (read-only, a file in its place), or a process
    with no home directory: the index built at start-up is used all the same, one warning, no
    stop (found by review: the save's CSVError stopped the server; ``Path.home()``'s
    RuntimeError too)."""
    pytest.importorskip("vllm")
    from pathlib import Path
    from types import SimpleNamespace

    from vllm_csv.cache import cache_root
    from vllm_csv.vllm_plugin.index_loader import load_or_build_index

    W, b = head
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("VLLM_CSV_CACHE", str(tmp_path / "a_file" / "cache"))
    with caplog.at_level(logging.WARNING):
        idx = load_or_build_index(W, b, SimpleNamespace(index=None, clusters=10))
    assert idx.fingerprint == fingerprint_weights(W, b)
    assert any("not cached" in r.getMessage() for r in caplog.records)
    monkeypatch.delenv("VLLM_CSV_CACHE")

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert cache_root().parent == Path(tempfile.gettempdir())


def test_an_index_rebuilt_while_serving_is_not_cached(head, tmp_path, monkeypatch):
    """Weights written while serving (RLHF) rebuild the index (screen ``ball``) without writing it
    to the cache, which would keep one file per weight version (found by review)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm_csv.vllm_plugin.index_loader import load_or_build_index

    W, b = head
    monkeypatch.setenv("VLLM_CSV_CACHE", str(tmp_path / "cache"))
    cfg = SimpleNamespace(index=None, clusters=10)
    load_or_build_index(W, b, cfg, cache=False)
    assert not list(tmp_path.rglob("*.safetensors"))
    load_or_build_index(W, b, cfg)
    assert len(list(tmp_path.rglob("*.safetensors"))) == 1
