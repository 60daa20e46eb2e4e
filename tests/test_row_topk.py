"""``row_topk`` (csrc/cpu/topk_cpu.cpp) against ``torch.topk``: the same values on rows of many
shapes and adversarial contents (ties, flat rows, -inf / +inf / NaN, signed zeros, k = 0, 1, n),
columns that hold those values, distinct, equal values' columns ascending."""

import math

import pytest
import torch

from vllm_csv.ops.build import load_ops
from vllm_csv.ops.topk import row_topk, row_topk_ref

pytestmark = pytest.mark.skipif(load_ops() is None, reason="CPU kernels not built")


def rows(g, R, n, kind):
    x = torch.randn(R, n, generator=g)
    if kind == "ties":
        x = (x * 3).round()
    elif kind == "flat":
        x = torch.full((R, n), 1.5)
    elif kind == "neginf":
        x[torch.rand(R, n, generator=g) < 0.9] = -math.inf
    elif kind == "allneginf":
        x = torch.full((R, n), -math.inf)
    elif kind == "nan":
        x[torch.rand(R, n, generator=g) < 0.01] = math.nan
        x[torch.rand(R, n, generator=g) < 0.01] = math.inf
    elif kind == "manynan":
        x[torch.rand(R, n, generator=g) < 0.5] = math.nan
    elif kind == "zeros":
        x = torch.where(torch.rand(R, n, generator=g) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
        x[:, ::7] = -1.0
    elif kind == "ascending":
        x = torch.arange(n, dtype=torch.float32).repeat(R, 1)  # every block enters: the buffer's worst case
    return x


def check(x, k):
    got, want = row_topk(x, k), row_topk_ref(x, k)
    assert got.values.shape == want.values.shape and got.indices.dtype == torch.long
    # the same values, ranked alike (NaN first), -0.0 == +0.0
    assert torch.equal(got.values.isnan(), want.values.isnan())
    fin = ~want.values.isnan()
    assert torch.equal(got.values[fin], want.values[fin])
    # the columns hold those values, each once per row
    assert torch.equal(x.gather(1, got.indices).isnan(), got.values.isnan())
    assert torch.equal(x.gather(1, got.indices)[fin], got.values[fin])
    assert all(len(set(r)) == k for r in got.indices.tolist())
    # equal values: columns ascending
    same = (got.values[:, 1:] == got.values[:, :-1]) | (got.values[:, 1:].isnan() & got.values[:, :-1].isnan())
    assert bool((got.indices[:, 1:] > got.indices[:, :-1])[same].all())


@pytest.mark.parametrize("kind", ["randn", "ties", "flat", "neginf", "allneginf", "nan", "manynan", "zeros",
                                  "ascending"])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 255, 1000, 65536])
def test_row_topk_equals_torch_topk(kind, n):
    g = torch.Generator().manual_seed(n)
    x = rows(g, 5, n, kind)
    for k in sorted({0, 1, min(2, n), min(21, n), min(63, n), min(300, n), n}):
        check(x, k)


def test_row_topk_refuses_bad_input():
    x = torch.randn(3, 10)
    with pytest.raises(RuntimeError, match="outside"):
        load_ops().row_topk(x, 11)
    with pytest.raises(RuntimeError, match="float32"):
        load_ops().row_topk(x.double(), 2)
    assert torch.equal(row_topk(x.double(), 2).values, x.double().topk(2, dim=1).values)  # the reference then


def test_row_topk_of_a_strided_view():
    x = torch.randn(8, 200)[:, ::2]
    check(x, 7)
