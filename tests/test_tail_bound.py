"""benchmarks/tail_bound.py's survivors (vllm_csv/testing/tail_bound.py) are a sound bound: the true top token always survives; no
dimension multiplied keeps everything, all of them only the top."""

import torch

from vllm_csv.testing import tail_bound


def test_the_top_token_always_survives():
    g = torch.Generator().manual_seed(3)
    W = torch.randn(512, 64, generator=g, dtype=torch.float64)
    h = torch.randn(16, 64, generator=g, dtype=torch.float64)
    top = (h @ W.T).argmax(dim=1)
    shares = []
    for k in range(0, 65, 8):
        keep = tail_bound.surviving(h, W, k)
        assert keep.gather(1, top[:, None]).all()
        shares.append(tail_bound.survivors(h, W, k))
    assert shares[0] == 1.0 and shares[-1] == 1 / 512
    assert all(a >= b for a, b in zip(shares, shares[1:]))  # more dimensions, tighter bounds
