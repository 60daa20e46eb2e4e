"""The exactness checks must be able to fail: break a bound on purpose and watch them catch it.

A screen whose error radius is understated certifies candidate sets that miss the true
top-1 on near-ties; the same comparison with the dense head that the real tests use
must then find wrong tokens, while the intact head finds none.
"""

import torch

from vllm_csv import CertifiedHead, HeadConfig, build_index


def wrong_tokens(head, W, h, batch=None):
    """Count rows whose certified top-1 differs from the dense argmax (rows run in
    batches of ``batch``: a batch scores the union of its rows' candidates)."""
    batch = batch or h.shape[0]
    ids = torch.cat([head.topk(h[i : i + batch], 1, values=False).ids for i in range(0, h.shape[0], batch)])
    res = head.topk(h, 1, values=False)
    dense = torch.nn.functional.linear(h, W).argmax(1)
    return int((ids[:, 0] != dense).sum()), res


def shrink_radius(head, factor):
    """Make the screen report ``factor`` times its proven radius."""
    honest = head.screen.center_radius

    def broken(h, **kw):
        out = honest(h, **kw)
        out.radius = out.radius * factor
        out.rel *= factor
        if out.n is not None:
            out.n = out.n * factor
        return out

    head.screen.center_radius = broken


def near_tie_batch(V=4096, d=64, B=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, d, generator=g)
    h = torch.randn(B, d, generator=g)
    return W, h


def test_understated_int8_radius_is_caught():
    W, h = near_tie_batch()
    head = CertifiedHead(W, config=HeadConfig(screen="int8", budget=1.0))
    assert wrong_tokens(head, W, h)[0] == 0
    shrink_radius(head, 0.0)  # drop the quantisation error term
    head.errors.acc_err.zero_()
    wrong, res = wrong_tokens(head, W, h)
    assert wrong > 0  # certified rows with a token the dense head would not pick


def test_understated_fp16_error_is_caught():
    """fp16 rounds its output to nearest, which keeps the order of near-ties, so a shrunken
    radius alone rarely misleads it; a copy of ``W`` 100 times cruder than its radius does."""
    W, h = near_tie_batch(B=2048, seed=3)
    head = CertifiedHead(W, config=HeadConfig(screen="fp16", budget=1.0))
    assert wrong_tokens(head, W, h)[0] == 0
    noise = torch.randn(W.shape, generator=torch.Generator().manual_seed(0))
    head.screen.w16 = (W + 100 * head.screen.radius[:, None] * noise / noise.norm(dim=1, keepdim=True)).half()
    assert wrong_tokens(head, W, h)[0] > 0


def test_understated_ball_radius_is_caught():
    W, h = near_tie_batch(V=2048, B=64, seed=1)
    idx = build_index(W, num_clusters=64, progress=False)
    head = CertifiedHead(W, config=HeadConfig(screen="ball", budget=1.0), index=idx)
    assert wrong_tokens(head, W, h, batch=1)[0] == 0
    shrink_radius(head, 0.2)  # a ball too small to contain its cluster
    assert wrong_tokens(head, W, h, batch=1)[0] > 0
