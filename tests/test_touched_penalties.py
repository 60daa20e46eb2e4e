"""vLLM's penalties on the tokens they touch only (vllm_csv/vllm_plugin/penalties.py) give the
values of vLLM's full call (``apply_all_penalties``) on every column, on one tensor and on a pair
(a row's lower and upper bounds, one stacked call): prompts padded with V, outputs with repeats and
``-1`` placeholders, values at +-0, +-inf, NaN and large, every penalty sign; and they stand aside
where they do not apply."""

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1.sample.ops.penalties import apply_all_penalties  # noqa: E402

from vllm_csv.vllm_plugin.penalties import TouchedPenalties  # noqa: E402


def _md(g, R, V, P=9, penalties=True):
    prompt = torch.randint(0, V, (R, P), generator=g)
    prompt[::3, 5:] = V  # vLLM's padding
    outputs = [torch.randint(0, V, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(R)]
    outputs[1] = outputs[1] + outputs[1][:3] + [-1, -1]  # repeats; async placeholders
    outputs[2] = []
    pres = torch.rand(R, generator=g) * 4 - 2
    freq = torch.rand(R, generator=g) * 4 - 2
    rep = torch.rand(R, generator=g) * 1.9 + 0.05
    pres[0], freq[0], rep[0] = 0.0, 0.0, 1.0  # a row without penalties
    return SimpleNamespace(no_penalties=not penalties, prompt_token_ids=prompt, output_token_ids=outputs,
                           presence_penalties=pres, frequency_penalties=freq, repetition_penalties=rep)


def _logits(g, R, V, md):
    x = torch.randn(R, V, generator=g) * 5
    touched = torch.cat([md.prompt_token_ids[md.prompt_token_ids < V],
                         torch.tensor([t for o in md.output_token_ids for t in o if t >= 0], dtype=torch.long)])
    # special values on touched tokens and elsewhere
    for cols in (touched[:12], torch.randint(0, V, (12,), generator=g)):
        x[:, cols[0:2]] = 0.0
        x[:, cols[2:4]] = -0.0
        x[:, cols[4:6]] = math.inf
        x[:, cols[6:8]] = -math.inf
        x[:, cols[8:10]] = math.nan
        x[:, cols[10:12]] = 3e38
    return x


def _full(x, md):
    return apply_all_penalties(x.clone(), md.prompt_token_ids, md.presence_penalties, md.frequency_penalties,
                               md.repetition_penalties, md.output_token_ids)


def _same(got, want):
    return torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(
        got.nan_to_num(nan=7.0), want.nan_to_num(nan=7.0))  # -0.0 == 0.0: the same value


@pytest.mark.parametrize("seed,R,V", [(0, 8, 1000), (1, 3, 65536), (2, 16, 5000)])
def test_touched_penalties_equal_vllms_full_call(seed, R, V):
    g = torch.Generator().manual_seed(seed)
    md = _md(g, R, V)
    x = _logits(g, R, V, md)
    pen = TouchedPenalties(md, V)
    assert pen.usable
    want = _full(x, md)
    got = x.clone()
    pen.apply(got)
    assert _same(got, want)
    assert not _same(want, x)  # the penalties did something
    # a pair (lower and upper bounds: different values on the same rows), one stacked call
    x2 = _logits(g, R, V, md)
    lo, hi = x.clone(), x2.clone()
    pen.apply(lo, hi)
    assert _same(lo, want) and _same(hi, _full(x2, md))


def test_a_wrong_renumbering_is_caught():
    """Broken: each row counted with another row's outputs (the renumbered ids in the wrong rows)."""
    g = torch.Generator().manual_seed(3)
    R, V = 8, 1000
    md = _md(g, R, V)
    x = _logits(g, R, V, md)
    pen = TouchedPenalties(md, V)
    pen.output = torch.roll(pen.output, 1, 0)
    got = x.clone()
    pen.apply(got)
    assert not _same(got, _full(x, md))


def test_not_used_where_it_does_not_apply():
    g = torch.Generator().manual_seed(4)
    assert not TouchedPenalties(_md(g, 4, 1000, penalties=False), 1000).usable  # no penalties
    md = _md(g, 4, 1000)
    md.frequency_penalties[2] = math.nan
    assert not TouchedPenalties(md, 1000).usable  # not finite: vLLM's own call
    assert not TouchedPenalties(_md(g, 64, 300, P=40), 300).usable  # most of the vocabulary touched
