"""The head's public interfaces (issue 43): ``CertifiedHead`` and ``ShardedHead`` implement
``Selector``, the single-rank head ``Bounds``; no product module reaches into another object's
privates; the backend is bound once, and the torch reference and the CPU kernels give the same
bits."""

import ast
from pathlib import Path

import pytest
import torch

from vllm_csv.testing.heads import hidden_near_rows, peaked_head
from vllm_csv import CertifiedHead, HeadConfig
from vllm_csv.head import Bounds, Selector, certificate
from vllm_csv.sharded import Shard, ShardedHead

ROOT = Path(__file__).resolve().parents[1] / "vllm_csv"
# the head and the modules that hold one: no `x._y` on an object other than self/cls
CHECKED = [*sorted((ROOT / "head").glob("*.py")), ROOT / "sharded.py", ROOT / "gpu" / "step.py",
           ROOT / "sampling" / "head_adapter.py", ROOT / "sampling" / "sharded_rows.py"]


class Solo:
    rank, size = 0, 1

    def all_gather(self, x):
        return x[None]


def test_heads_implement_the_interfaces():
    W, _ = peaked_head(700, 24, seed=1)
    head = CertifiedHead(W, config=HeadConfig(off_switch=False))
    sharded = ShardedHead(W, None, Shard(0, 1, 0, 700, 700), Solo(), config=HeadConfig(screen="int8", off_switch=False))
    assert isinstance(head, Selector) and isinstance(head, Bounds)
    assert isinstance(sharded, Selector) and isinstance(sharded.local, Bounds)


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_reach(path):
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and node.attr != "_replace":  # (NamedTuple's public API)
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls", "torch", "ops"):
                continue
            if isinstance(owner, ast.Attribute) and owner.attr == "ops":  # torch.ops namespaces
                continue
            bad.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert not bad, bad


def _run(head, h, k, temp=None):
    sel = head.select(h, k, k >= 2, temp)
    out, st = head.sampler_logits(h, k, temperature=temp)
    return sel, out, st


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backends_give_the_same_bits(dtype, monkeypatch):
    """The same head on the CPU kernels and on the torch reference (bound at construction):
    the same certified rows, ids and value bits."""
    from vllm_csv.ops import build

    if build.load_ops() is None:
        pytest.skip("CPU kernels not built")
    W, g = peaked_head(3001, 40, seed=3, dtype=dtype)
    h = hidden_near_rows(W, 12, g, scale=3.0).to(dtype)
    k = torch.tensor([1, 2, 3, 1, 5, 1, 1, 2, 1, 4, 1, 1])
    temp = torch.tensor([0, 0.7, 1.5, 0, 2.0, 0, 0, 0.3, 0, 1.0, 0, 0], dtype=torch.float32)
    fast = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    monkeypatch.setitem(build._state, "ops", None)
    ref = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=0.5, off_switch=False))
    assert (fast.backend.name, ref.backend.name) == ("cpu", "torch")
    monkeypatch.undo()  # the kernels back: each head keeps the backend it was built with
    for t in (None, temp):
        (sa, oa, sta), (sb, ob, stb) = _run(fast, h, k, t), _run(ref, h, k, t)
        assert torch.equal(sa.certified, sb.certified) and sa.certified.any()
        assert torch.equal(oa.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           ob.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        assert sta.certified == stb.certified and sta.fallbacks == stb.fallbacks


def test_certificate_is_pure():
    """The certificate reads only its arguments: a plain comparison, on any tensors."""
    from vllm_csv.dense_engine import DenseEngine

    eng = DenseEngine(torch.float32, None, 1.0)
    z = torch.tensor([[3.0, 1.0, 2.0]])
    lower, upper = z - 0.1, z + 0.1
    ok, in_top = certificate.certify(eng, z, lower, upper, torch.tensor([1]), torch.tensor([1.5]),
                                     torch.tensor([True]), torch.arange(3))
    assert ok.tolist() == [False]  # values asked for, but not known bit for bit
    ok, in_top = certificate.certify(eng, z, z, z, torch.tensor([2]), torch.tensor([1.5]),
                                     torch.tensor([True]), torch.arange(3))
    assert ok.tolist() == [True] and in_top.tolist() == [[True, False, True]]


@pytest.mark.parametrize("screen", ["int8", "int4", "fp16"])
def test_an_empty_batch_is_the_dense_heads_empty_answer(screen):
    """``topk`` and ``sampler_logits`` on ``B = 0`` rows answer as the dense head does (``[0, k]``,
    ``[0, V]``); ``topk`` stopped on ``k.max()`` of an empty tensor."""
    W, _ = peaked_head(1000, 64, seed=1, dtype=torch.bfloat16)
    head = CertifiedHead(W, config=HeadConfig(screen=screen, off_switch=False))
    h = torch.zeros(0, 64, dtype=torch.bfloat16)
    for k in (1, 5):
        res = head.topk(h, k)
        assert res.ids.shape == res.values.shape == (0, k) and res.certified.numel() == res.scored.numel() == 0
    logits, _ = head.sampler_logits(h, torch.zeros(0, dtype=torch.long))
    assert logits.shape == (0, 1000)
