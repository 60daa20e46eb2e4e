"""min-p / top-p keep-drop decisions from bounds never contradict vLLM's own masks."""

import math

import pytest
import torch

from vllm_csv.ops import build
from vllm_csv.ops.masks import PER_CALL, top_p_sums, top_p_sums_ref, unlisted_masses, unlisted_masses_ref
from vllm_csv.sampling.nucleus import min_p as min_p_mask, top_k as top_k_mask, top_p as top_p_mask
from vllm_csv.sampling.nucleus import top_p_queries as queries
from vllm_csv.sampling.nucleus.min_p import min_p_bounds
from vllm_csv.sampling.nucleus.top_p import top_p_bounds
from vllm_csv.testing.heads import peaked_rows

pytest.importorskip("vllm")
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch  # noqa: E402


def vllm_min_p(y, min_p):
    probs = torch.softmax(y, dim=-1)
    return ~(probs < probs.amax(-1, keepdim=True) * min_p[:, None])


def rows(seed, R=64, V=2048):
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1e-3, 0.3, 1.0, 3.0, 30.0])[torch.arange(R) % 5][:, None]
    y = torch.randn(R, V, generator=g) * scale
    y[:, :7] = y[:, 7:14]  # exact ties
    y[::4, 100:400] = -math.inf  # masked tokens
    return y, g


def decisions(lo, hi, y):
    """(certainly kept, certainly dropped); masked tokens (-inf in y) are left out."""
    return torch.isfinite(lo), ~torch.isfinite(hi) & torch.isfinite(y)


@pytest.mark.parametrize("width", [0.0, 1e-4, 0.05])
def test_top_p_decisions_are_sound(width):
    y, g = rows(0)
    p = torch.rand(y.shape[0], generator=g) * 0.98 + 0.01
    kept = torch.isfinite(apply_top_k_top_p_pytorch(y.clone(), None, p))
    lo, hi = top_p_bounds(y - width, y + width, p)
    k, d = decisions(lo, hi, y)
    assert not (k & ~kept).any() and not (d & kept).any()
    if width == 0.0:
        assert (k | d | ~torch.isfinite(y)).float().mean() > 0.99  # nearly everything decided


@pytest.mark.parametrize("width", [0.0, 1e-4, 0.05])
def test_min_p_decisions_are_sound(width):
    y, g = rows(1)
    mp = torch.rand(y.shape[0], generator=g) * 0.5
    mp[::7] = 0.0
    kept = vllm_min_p(y, mp)
    lo, hi = min_p_bounds(y - width, y + width, mp)
    k, d = decisions(lo, hi, y)
    assert not (k & ~kept).any() and not (d & kept).any()
    if width == 0.0:
        assert (k | d | ~torch.isfinite(y)).float().mean() > 0.99


def test_a_negative_margin_is_caught(monkeypatch):
    """Broken bound: the top-p margin made negative (-0.02): wrong decisions appear."""
    monkeypatch.setattr(top_p_mask, "gamma", lambda n: -0.01)
    y, g = rows(2, R=256)
    p = torch.rand(y.shape[0], generator=g) * 0.98 + 0.01
    kept = torch.isfinite(apply_top_k_top_p_pytorch(y.clone(), None, p))
    k, d = decisions(*top_p_bounds(y, y, p), y)
    assert (k & ~kept).any() or (d & kept).any()


@pytest.mark.parametrize("width", [0.0, 1e-3, 0.3])
def test_top_p_tail_is_dropped_as_a_block_soundly(width, monkeypatch):
    """The tail path (most of V dropped as one block) decides like vLLM's full sort, and as much
    as the full computation (TAIL_SCAN = 0: every token decided on its own)."""
    y, g = peaked_rows(3)
    p = torch.rand(y.shape[0], generator=g) * 0.98 + 0.01
    p[::6] = 0.999
    kept = torch.isfinite(apply_top_k_top_p_pytorch(y.clone(), None, p))
    lo, hi = top_p_bounds(y - width, y + width, p)
    k, d = decisions(lo, hi, y)
    assert not (k & ~kept).any() and not (d & kept).any()
    monkeypatch.setattr(top_p_mask, "TAIL_SCAN", 0)  # no tail: the full computation on every token
    k0, d0 = decisions(*top_p_bounds(y - width, y + width, p), y)
    assert not (k0 & ~kept).any() and not (d0 & kept).any()
    assert not (k0 & ~k).any()  # tokens kept for sure stay kept for sure (|ylo - t| is far)
    assert (d | k).sum() >= 0.999 * (d0 | k0).sum()


def test_a_wrong_tail_bound_is_caught(monkeypatch):
    """Broken bound: the tail's mass bound ignoring the rest of the row (A_j >= 1): kept tokens
    are dropped as part of the tail."""
    monkeypatch.setattr(top_p_mask, "_tail_bound", lambda n, h, tot: n / n)
    y, g = peaked_rows(4)
    p = torch.rand(y.shape[0], generator=g) * 0.98 + 0.01
    kept = torch.isfinite(apply_top_k_top_p_pytorch(y.clone(), None, p))
    k, d = decisions(*top_p_bounds(y, y, p), y)
    assert (d & kept).any()


def _part_case(seed, shift):
    """Rows (dense near their maximum, and peaked), asymmetric bounds, min-p, and the first half
    of the columns as the part one rank sees; the other half moved by ``shift`` (so the row's
    maximum may lie outside the part)."""
    y, g = rows(seed, R=64, V=4096)
    y[::2] = peaked_rows(seed, R=32, V=4096)[0]
    y[:, 2048:] += shift
    w1 = torch.rand(y.shape, generator=g) * 0.3
    w2 = torch.rand(y.shape, generator=g) * 0.3
    mp = torch.rand(y.shape[0], generator=g) * 0.5
    mp[::5] = 0.0
    return y, (y - w1)[:, :2048], (y + w2)[:, :2048], mp


@pytest.mark.parametrize("shift", [-8.0, 0.0, 3.0, 30.0])
def test_min_p_drops_on_part_are_sound(shift):
    """Tokens a rank drops from its part alone are dropped by vLLM's min-p on the whole row,
    wherever the row's maximum lies; and the rule drops most of what the whole row's bounds drop."""
    y, lo, hi, mp = _part_case(5, shift)
    kept = vllm_min_p(y, mp)[:, :2048]
    d = min_p_mask.min_p_drops_on_part(lo, hi, mp)
    assert not (d & kept).any()
    assert not d[mp == 0].any()
    whole = ~torch.isfinite(min_p_bounds(torch.cat([lo, y[:, 2048:]], 1), torch.cat([hi, y[:, 2048:]], 1), mp)[1])
    if shift <= 0:  # the part holds the maximum: as much as the whole row's bounds
        assert d.sum() >= 0.95 * whole[:, :2048].sum() > 0


def test_min_p_drops_on_part_with_a_wrong_maximum_are_caught():
    """Broken bound: the part's maximum taken over its *upper* bounds (not a lower bound on the
    row's maximum: the rule's premise): tokens that vLLM keeps are dropped."""
    y, lo, hi, mp = _part_case(6, -8.0)
    kept = vllm_min_p(y, mp)[:, :2048]
    assert (min_p_mask.min_p_drops_on_part(hi, hi, mp) & kept).any()


def test_a_negative_min_p_margin_is_caught(monkeypatch):
    """Broken bound: min-p's margin made negative: the part rule drops tokens vLLM keeps."""
    monkeypatch.setattr(min_p_mask, "_min_p_margin", lambda y_abs, m_abs: torch.full_like(y_abs, -0.05))
    y, _, _, mp = _part_case(7, -8.0)
    kept = vllm_min_p(y, mp)[:, :2048]
    part = y[:, :2048]
    assert (min_p_mask.min_p_drops_on_part(part, part, mp) & kept).any()


@pytest.mark.parametrize("finite_cols", [40, 256, 300, 1500])
def test_top_p_on_live_columns_decides_as_on_the_whole_row(finite_cols, monkeypatch):
    """Rows that are ``-inf`` but for a few columns (tensor parallelism's gathered rows), some of
    those ``-inf`` in some rows too: deciding on the live columns only (fewer, more or many more
    than TAIL_SCAN of them, or exactly as many) gives bit for bit what deciding on every column gives."""
    from vllm_csv.sampling.outside import Outside

    y, g = peaked_rows(9, R=32, V=8192)
    cols = torch.randperm(8192, generator=g)[:finite_cols]
    dead = torch.ones_like(y, dtype=torch.bool)
    dead[:, cols] = torch.rand(32, finite_cols, generator=g) < 0.2
    dead[:4, cols] = False  # rows with every live column finite (at 256: the tail scan sees them all)
    p_broad = 0.999  # rows 0-3: broad nuclei, so the scan finds no tail and the grid below it runs
    lo = (y - torch.rand(y.shape, generator=g) * 0.2).masked_fill(dead, -math.inf)
    hi = (y + torch.rand(y.shape, generator=g) * 0.2).masked_fill(dead, -math.inf)
    p = torch.rand(32, generator=g) * 0.9 + 0.05
    p[:4] = p_broad
    L = 5
    hb = torch.rand(32, L, generator=g).double() * 4 - 2
    outside = Outside(hi=hb, noisy=hb + 3, lel=hb - 1.5, leh=hb - 1.0, absmax=hb.abs() + 1, lo=hb - 0.7)
    got = [top_p_bounds(lo, hi, p), top_p_bounds(lo, hi, p, outside)]
    monkeypatch.setattr(top_p_mask, "COMPACT_BELOW", 0.0)  # never compact
    want = [top_p_bounds(lo, hi, p), top_p_bounds(lo, hi, p, outside)]
    for a, b in zip(got, want):
        for x, z in zip(a[:2], b[:2]):
            assert torch.equal(x, z)
    assert torch.equal(got[1][2].hi, want[1][2].hi)
    assert torch.isfinite(got[0][0]).any() and (~torch.isfinite(got[0][1]) & ~dead).any()  # decides both ways


def vllm_top_k(y, k, p=None):
    """vLLM's kept set under top-k (and top-p): its sort-free path (top-k only, CPU) and its
    sorted path (the one it takes with a top-p), which must agree on top-k alone."""
    sorted_path = torch.isfinite(apply_top_k_top_p_pytorch(y.clone(), k.clone(), p, allow_cpu_sync=False))
    if p is None:
        assert torch.equal(sorted_path, torch.isfinite(apply_top_k_top_p_pytorch(y.clone(), k.clone(), None,
                                                                                   allow_cpu_sync=True)))
    return sorted_path


def top_k_rows(seed, R=96, V=1024):
    """Rows with exact ties (values on a coarse grid, as bf16 logits are), masked tokens, and top-k
    from 1 to V (V: vLLM's "no top-k"), most of them small."""
    y, g = rows(seed, R, V)
    y[1::3] = (y[1::3] * 4).round() / 4  # many ties, also at the k-th value
    k = torch.randint(1, 80, (R,), generator=g)
    k[::5] = torch.randint(1, V + 1, (R // 5 + (R % 5 > 0),), generator=g)
    k[::11] = V
    return y, k, g


@pytest.mark.parametrize("width", [0.0, 1e-4, 0.05, "random"])
def test_top_k_decisions_are_sound(width):
    """Every keep / drop decision of ``top_k_bounds`` holds for vLLM's top-k on the row inside the
    bounds, ties at the k-th value included, for boxes centred on it and for lopsided ones (some
    with ``ylo = -inf``)."""
    for seed in range(3):
        y, k, g = top_k_rows(10 + seed)
        if width == "random":
            a = torch.rand(y.shape, generator=g) * (torch.rand(y.shape, generator=g) < 0.5)
            b = torch.rand(y.shape, generator=g) * (torch.rand(y.shape, generator=g) < 0.5)
            lo, hi = y - a, y + b
            lo[torch.rand(y.shape, generator=g) < 0.02] = -math.inf
        else:
            lo, hi = y - width, y + width
        kept = vllm_top_k(y, k)
        kl, kh = top_k_mask.top_k_bounds(lo, hi, k)
        kd, dd = decisions(kl, kh, y)
        assert not (kd & ~kept).any() and not (dd & kept).any()
        if width == 0.0:  # exact values: every finite token is decided
            assert bool((kd | dd | ~torch.isfinite(y)).all())
        assert torch.equal(kl[k == y.shape[1]], lo[k == y.shape[1]])  # no top-k: untouched


def test_top_k_then_top_p_decisions_are_sound():
    """top-k, then top-p over what it kept (vLLM's sorted path): the two bounds composed never
    contradict it."""
    y, k, g = top_k_rows(7)
    p = torch.rand(y.shape[0], generator=g) * 0.98 + 0.01
    kept = vllm_top_k(y, k, p)
    for width in (0.0, 1e-3, 0.05):
        lo, hi = top_k_mask.top_k_bounds(y - width, y + width, k)
        kd, dd = decisions(*top_p_bounds(lo, hi, p), y)
        assert not (kd & ~kept).any() and not (dd & kept).any()


def test_a_top_k_cut_that_counts_the_token_itself_is_caught(monkeypatch):
    """Broken bound: every token kept at ``H_(k+1)`` (right only for the tokens among the first
    ``k`` upper bounds): on exact values the (k+1)-th token is then kept, wrongly unless tied."""
    def broken(lo, hi, k, kmax, row_topk=None):
        h = hi.topk(kmax + 1, dim=1).values
        hk1 = h.gather(1, k)[:, 0]
        return hk1, hk1, lo.topk(kmax, dim=1).values.gather(1, k - 1)[:, 0]
    monkeypatch.setattr(top_k_mask, "_top_k_levels", broken)
    y, k, _ = top_k_rows(3)
    kept = vllm_top_k(y, k)
    kd, dd = decisions(*top_k_mask.top_k_bounds(y, y, k), y)
    assert (kd & ~kept).any() or (dd & kept).any()


def _bisected(lo, el, eh, tot_h, need, upper):
    """The bisection ``_grid_tail`` replaced (``BISECT_STEPS`` halvings), for comparison."""
    fin = lo > -math.inf
    a = lo.masked_fill(~fin, math.inf).amin(1) - 1.0
    b, good = upper.clone(), torch.full_like(a, -math.inf)
    for _ in range(top_p_mask.BISECT_STEPS):
        m = torch.where(good > -math.inf, (good + b) / 2, torch.where(torch.isfinite(a), (a + b) / 2, a))
        above = lo >= m[:, None]
        ok = (top_p_mask._tail_bound((el * above).sum(1, keepdim=True), (eh * above).sum(1, keepdim=True), tot_h)
              > need).squeeze(1) & torch.isfinite(m)
        good, b = torch.where(ok, m, good), torch.where(ok, b, m)
    return good


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0, 1e5])
def test_grid_tail_threshold_holds_over_the_exact_tail(scale):
    """The tail threshold below the scan: where one is found, the tail bound computed exactly
    over every token with ylo >= t exceeds what is needed, and t is below the scan's last
    value; it is found on most broad rows (ties, masked tokens and a NaN row included)."""
    g = torch.Generator().manual_seed(17)
    R, V = 24, 6000
    lo = (torch.randn(R, V, generator=g, dtype=torch.float64) * scale)
    lo[1::4] = (lo[1::4] * 8).round() / 8  # ties
    lo[2::4, ::3] = -math.inf  # masked
    lo[5, 9] = math.nan
    hi = lo + torch.rand(R, V, generator=g, dtype=torch.float64) * 0.05 * min(scale, 1.0)
    hi = hi.masked_fill(lo == -math.inf, -math.inf)
    c = hi.nan_to_num(nan=-math.inf).amax(1, keepdim=True)
    el, eh = torch.exp(lo - c).nan_to_num(0.0), torch.exp(hi - c).nan_to_num(0.0)
    tot_h = eh.sum(1, keepdim=True)
    need = torch.full((R, 1), 0.9995, dtype=torch.float64)
    upper = lo.nan_to_num(nan=-math.inf).topk(256, dim=1).values[:, -1]
    t = top_p_mask._grid_tail(lo, el, eh, tot_h, need, upper)
    found = t > -math.inf
    assert int(found.sum()) >= R // 2, int(found.sum())
    # as many rows as the bisection it replaces (BISECT_STEPS halvings of the same interval)
    assert int(found.sum()) >= int((_bisected(lo, el, eh, tot_h, need, upper) > -math.inf).sum())
    for r in found.nonzero().squeeze(1).tolist():
        above = lo[r] >= t[r]
        n, h = el[r][above].sum(), eh[r][above].sum()
        assert float(top_p_mask._tail_bound(n, h, tot_h[r, 0])) > float(need[r, 0])
        assert float(t[r]) < float(upper[r])


def _asked(y, g, share):
    only = torch.rand(y.shape, generator=g) < share
    only[::3] = False  # rows asking for their likely winners only
    return only


@pytest.mark.parametrize("width", [0.0, 1e-3, 0.3, "random"])
@pytest.mark.parametrize("listed", [8, 256])
def test_top_p_queries_are_sound(width, listed, monkeypatch):
    """Top-p deciding chosen tokens only (TopPQueries) never contradicts vLLM's top-p, with a
    list far shorter than the rows' nuclei (8: most sums bounded through the unlisted mass) and
    the default one; asked tokens and undecided ones alike (undecided: ylo = -inf, yhi kept)."""
    from vllm_csv.sampling.nucleus.top_p_queries import TopPQueries

    monkeypatch.setattr(queries, "QUERY_LIST", listed)
    for y, g in (rows(11), peaked_rows(12)):
        R, V = y.shape
        p = torch.rand(R, generator=g) * 0.98 + 0.01
        p[::7] = 1.0  # off
        if width == "random":
            lo = y - torch.rand(y.shape, generator=g) * 0.5
            hi = y + torch.rand(y.shape, generator=g) * 0.5
        else:
            lo, hi = y - width, y + width
        lo[5], hi[5, 3] = math.nan, math.nan  # a NaN row: nothing decided
        hi[6, 9] = math.inf
        kept = torch.isfinite(apply_top_k_top_p_pytorch(y.clone(), None, p))
        kept[p == 1.0] = torch.isfinite(y[p == 1.0])  # off here (vLLM's p = 1 drops tokens of probability 0)
        q = TopPQueries(lo, hi, p)
        for only in (None, _asked(y, g, 0.01), _asked(y, g, 0.3)):
            olo, ohi = q.bounds(only)
            k, d = decisions(olo, ohi, y)
            k[5:7] = d[5:7] = False  # (NaN, +inf: checked below)
            assert not (k & ~kept).any() and not (d & kept).any()
            assert torch.equal(ohi[p == 1.0], hi[p == 1.0]) and torch.equal(olo[p == 1.0], lo[p == 1.0])
            for i in (5, 6):  # a NaN / +inf bound: nothing decided
                if p[i] < 1.0:
                    assert (olo[i] == -math.inf).all() and torch.equal(ohi[i].nan_to_num(), hi[i].nan_to_num())
            if only is not None:
                asked = only & (p < 1.0)[:, None]
                assert k[p < 1.0].any() and (listed < 256 or (d & asked).any())  # decides (both ways)


@pytest.mark.parametrize("listed", [8, 256])
def test_top_p_queries_on_a_subset_of_rows_equal_those_rows(listed, monkeypatch):
    """TopPQueries.bounds(..., subset): each subset row's bounds are that row of the whole result,
    bit for bit (asked tokens, settled ones, a row over QUERY_MAX decided in full, NaN / +inf
    rows), for single rows, several, and every query row."""
    from vllm_csv.sampling.nucleus.top_p_queries import TopPQueries

    monkeypatch.setattr(queries, "QUERY_LIST", listed)
    for y, g in (rows(13), peaked_rows(14)):
        R, V = y.shape
        p = torch.rand(R, generator=g) * 0.98 + 0.01
        p[::7] = 1.0  # off: not query rows
        lo = y - torch.rand(y.shape, generator=g) * 0.3
        hi = y + torch.rand(y.shape, generator=g) * 0.3
        lo[5], hi[5, 3] = math.nan, math.nan
        hi[6, 9] = math.inf
        q = TopPQueries(lo, hi, p)
        on = (p < 1.0).nonzero().squeeze(1)
        subsets = [on[:1], on[-1:], on[1::2], on]
        for only in (None, _asked(y, g, 0.01), _asked(y, g, 0.3)):
            settle = None if only is None else only & (torch.rand(y.shape, generator=g) < 0.5)
            if only is not None:
                only[on[0]] = True  # a row asking for every token: over QUERY_MAX, decided in full
            whole = q.bounds(only, settle)
            for sub in subsets:
                part = q.bounds(only, settle, sub)
                assert part[0].shape == (sub.numel(), V)
                for a, b in zip(part, whole):  # (bit for bit; NaN where the whole has NaN)
                    torch.testing.assert_close(a, b[sub], rtol=0, atol=0, equal_nan=True)
        with pytest.raises(ValueError, match="no top-p"):
            q.bounds(None, None, torch.tensor([0]))  # row 0: top-p off, no queries


@pytest.mark.parametrize("width", [0.0, 0.05])
def test_top_p_queries_decide_as_the_full_computation(width, monkeypatch):
    """Every asked token is decided as the full computation decides it (no tail: TAIL_SCAN = 0),
    with a list holding every token (each asked token's sums are the whole row's) and with a
    list of 8 (then each token's whole-row sums, wherever the list leaves undecided a token that
    exact sums might decide); nothing is decided that the full computation does not. Through the
    kernel and through its torch reference alike."""
    from vllm_csv.sampling.nucleus.top_p_queries import TopPQueries

    y, g = peaked_rows(13, R=24, V=2048)
    y[::2] = rows(13, R=12, V=2048)[0]
    p = torch.rand(y.shape[0], generator=g) * 0.98 + 0.01
    lo = y - width * torch.rand(y.shape, generator=g)
    hi = y + width * torch.rand(y.shape, generator=g)
    only = _asked(y, g, 0.2)
    monkeypatch.setattr(top_p_mask, "TAIL_SCAN", 0)
    k0, d0 = decisions(*top_p_bounds(lo, hi, p), y)
    for listed, sums in ((2048, top_p_sums), (8, top_p_sums), (8, top_p_sums_ref)):
        monkeypatch.setattr(queries, "QUERY_LIST", listed)
        k, d = decisions(*TopPQueries(lo, hi, p, PER_CALL._replace(top_p_sums=sums)).bounds(only, only), y)
        assert torch.equal(k & only, k0 & only) and torch.equal(d & only, d0 & only)
        assert not (k & ~k0).any() and not (d & ~d0).any()
    assert (k0 & only).any() and (d0 & only).any()


def _tied_rows(seed, R=24, V=1500):
    """Rows of few distinct values (every token tied with many others) and exact bounds on some
    rows: top-p's cut falls among tied tokens, where vLLM's sort order decides."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(-6, 4, (R, V), generator=g).float() * 0.5
    y[::5, 50:100] = -math.inf  # masked tokens
    lo, hi = y.clone(), y.clone()
    wide = torch.arange(R) % 2 == 1
    lo[wide] -= torch.rand(int(wide.sum()), V, generator=g) * 0.25
    hi[wide] += torch.rand(int(wide.sum()), V, generator=g) * 0.25
    return y, lo, hi, g


@pytest.mark.parametrize("variant", ["kernel", "reference", "strict_may_follow", "ties_before", "no_own_mass"])
def test_whole_row_top_p_sums_are_sound(variant, monkeypatch):
    """Tokens decided on their whole row's sums (a list of 4: nearly every asked token goes
    there) never contradict vLLM's top-p, on rows of ties; broken sums are caught: one that
    counts only the tokens strictly above ``ylo_i`` as possibly sorting after ``i``
    (``strict_may_follow``: a tied token may sort after it), one that counts the tokens tied at
    ``ylo_i`` as sorting before it (``ties_before``). Leaving ``i``'s own mass out of ``r_lo``
    (``no_own_mass``) is only weaker: sound, and deciding no more than the full computation."""
    from vllm_csv.sampling.nucleus.top_p_queries import TopPQueries

    def broken(lo, hi, el, eh, qrow, qcol):
        out = top_p_sums_ref(lo, hi, el, eh, qrow, qcol)
        lo_q, hi_q, el_q, eh_q = (t[qrow] for t in (lo, hi, el, eh))
        a = lo_q.gather(1, qcol[:, None])
        own = torch.zeros_like(lo_q, dtype=torch.bool).scatter_(1, qcol[:, None], True)
        if variant == "strict_may_follow":
            out[:, 0] = torch.where((hi_q > a) & ~own, eh_q, 0.0).sum(1)
        elif variant == "ties_before":
            out[:, 0] = torch.where((hi_q > a) & ~own, eh_q, 0.0).sum(1)
            out[:, 1] = torch.where(hi_q <= a, el_q, 0.0).sum(1) - torch.where(own, el_q, 0.0).sum(1)
        elif variant == "no_own_mass":
            out[:, 1] -= el_q.gather(1, qcol[:, None])[:, 0]
        return out

    monkeypatch.setattr(queries, "QUERY_LIST", 4)
    monkeypatch.setattr(top_p_mask, "TAIL_SCAN", 0)
    ops = PER_CALL._replace(top_p_sums={"kernel": top_p_sums, "reference": top_p_sums_ref}.get(variant, broken))
    wrong = 0
    for seed in range(4):
        y, lo, hi, g = _tied_rows(40 + seed)
        p = torch.rand(y.shape[0], generator=g) * 0.9 + 0.05
        kept = torch.isfinite(apply_top_k_top_p_pytorch(y.clone(), None, p))
        only = torch.isfinite(y) & (torch.rand(y.shape, generator=g) < 0.1)  # (within QUERY_MAX)
        k, d = decisions(*TopPQueries(lo, hi, p, ops).bounds(only, only), y)
        wrong += int((k & ~kept).sum() + (d & kept).sum())
        if variant in ("kernel", "reference", "no_own_mass"):
            k0, d0 = decisions(*top_p_bounds(lo, hi, p), y)
            assert not ((k & ~k0) & only).any() and not ((d & ~d0) & only).any()
            assert (k & only).any() and (d & only).any()
    assert (wrong == 0) == (variant in ("kernel", "reference", "no_own_mass"))


def test_top_p_sums_kernel_is_the_reference():
    """The kernel's four sums equal the reference's within float64 summation order, on rows
    longer than the vectors, queries at the first and last columns, -inf bounds, ties at the
    query's bounds and a token whose bounds are one point; it refuses queries outside the rows
    and masses of the wrong dtype."""
    if not build.kernels_available():
        pytest.skip("CPU kernels not built")
    g = torch.Generator().manual_seed(31)
    R, V = 6, 20011
    lo = torch.randn(R, V, generator=g) * 4
    hi = lo + torch.rand(R, V, generator=g)
    lo[0, :300] = -math.inf
    hi[1, :300] = lo[1, :300] = -math.inf
    lo[2, 1000:1100] = lo[2, 5]  # ties at a query's lower bound
    hi[2, 1100:1200] = lo[2, 5]
    lo[2, 1200:1300] = hi[2, 5]  # ... and at its upper bound
    hi[3, 7] = lo[3, 7]
    c = hi.amax(1, keepdim=True).double()
    el, eh = torch.exp(lo.double() - c), torch.exp(hi.double() - c)
    qrow = torch.cat([torch.arange(R).repeat_interleave(5), torch.tensor([0, 0, 1, 1, 2, 3])])
    qcol = torch.cat([torch.randint(0, V, (5 * R,), generator=g), torch.tensor([0, V - 1, 0, 350, 5, 7])])
    got = torch.ops.vllm_csv_cpu.top_p_sums(lo, hi, el, eh, qrow, qcol)
    want = top_p_sums_ref(lo, hi, el, eh, qrow, qcol)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    assert (want > 0).any(0).all()
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.vllm_csv_cpu.top_p_sums(lo, hi, el, eh, qrow, qcol + V)
    with pytest.raises(RuntimeError, match="float64"):
        torch.ops.vllm_csv_cpu.top_p_sums(lo, hi, el.float(), eh, qrow, qcol)


def test_unlisted_masses_kernel_is_the_reference():
    """The kernel's exp (SLEEF's, from libtorch) is within 1 ulp of exp on every normal result
    (the proof allows 64) and within 2^-149 below them; its sums equal the reference's within the
    two exps' ulps and float64 summation order, on rows longer than the vectors with a tail, -inf
    bounds, listed tokens at the first and last columns, a row whose shift is 0 and a list of no
    tokens; it refuses listed tokens outside the rows."""
    ops = build.load_ops()
    if ops is None:
        pytest.skip("CPU kernels not built (VLLM_CSV_CPU_KERNELS=0, or the build failed: see its log line)")
    if not ops.unlisted_masses_supported():
        pytest.skip(f"the kernels built; {build.no_avx512_reason('AVX-512')} for SLEEF's vector exp (the reference runs)")
    # one term a row: the sum is the term
    x = torch.cat([torch.rand(100_000, generator=torch.Generator().manual_seed(5)) * -110,
                   torch.tensor([0.0, -1e-7, -87.0, -87.4, -88.7, -103.9, -104.0, -150.0, -math.inf])])[:, None]
    one = ops.unlisted_masses(x, x, torch.zeros(x.shape[0], 1), torch.empty(x.shape[0], 0, dtype=torch.long))
    exact = torch.exp(x[:, 0].double())
    normal = exact >= 2.0**-126
    ulp = (torch.nextafter(exact.float(), torch.tensor(math.inf)) - exact.float()).double()
    for side in one.unbind(1):
        assert ((side - exact).abs() <= ulp)[normal].all()
        assert ((side - exact).abs() <= 2.0**-149)[~normal].all()
    g = torch.Generator().manual_seed(32)
    R, V = 5, 20011
    hi = torch.randn(R, V, generator=g) * 4
    lo = hi - torch.rand(R, V, generator=g)
    lo[0, :300] = -math.inf
    hi[1, :300] = lo[1, :300] = -math.inf
    c = hi.amax(1, keepdim=True)
    c[2] = 0.0
    ih = torch.stack([torch.randperm(V, generator=g)[:64] for _ in range(R)])
    ih[3, :2] = torch.tensor([0, V - 1])
    for k in (ih, ih[:, :0]):
        got, want = ops.unlisted_masses(lo, hi, c, k), unlisted_masses_ref(lo, hi, c, k)
        assert torch.allclose(got, want, rtol=2 * 2.0**-24, atol=0) and (want > 0).all()
    assert unlisted_masses(lo, hi, c, ih).equal(ops.unlisted_masses(lo, hi, c, ih))
    with pytest.raises(RuntimeError, match="outside"):
        ops.unlisted_masses(lo, hi, c, ih + V)


@pytest.mark.parametrize("variant", ["kernel", "reference", "lower_too_high", "upper_too_low"])
def test_unlisted_masses_bound_the_exact_sums(variant, monkeypatch):
    """TopPQueries' masses off the list bound the exact sums over those tokens (computed in
    float64 from the fp32 bounds): the upper one from ``hi`` at least, the lower one from ``lo``
    at most, through the kernel and the reference, on rows of five spreads with ties and -inf
    and on learned-head-shaped rows; sums off by 1e-4 of themselves (past the 512 u widening, 3e-5)
    are caught."""
    from vllm_csv.sampling.nucleus.top_p_queries import TopPQueries

    def off(sign_lo, sign_hi):
        def f(lo, hi, c, ih):
            s = unlisted_masses_ref(lo, hi, c, ih)
            return s * torch.tensor([1 + sign_lo * 1e-4, 1 + sign_hi * 1e-4], dtype=torch.float64)
        return f

    variants = {"kernel": unlisted_masses, "reference": unlisted_masses_ref,
                "lower_too_high": off(+1, 0), "upper_too_low": off(0, -1)}
    ops = PER_CALL._replace(unlisted_masses=variants[variant])
    caught = 0
    for y, g in (rows(41), peaked_rows(42)):
        p = torch.full((y.shape[0],), 0.9)
        lo = y - torch.rand(y.shape, generator=g) * 0.3
        q = TopPQueries(lo, y, p, ops)
        r = q.rows
        lo_r, hi_r = lo[r].double(), y[r].double()
        keep = ~q.is_listed
        c = q.c.double()
        ex_hi = torch.where(keep, torch.exp(hi_r - c), 0.0).sum(1)
        ex_lo = torch.where(keep, torch.exp(lo_r - c), 0.0).sum(1)
        ok = q.usable
        bad = ((q.unl_h < ex_hi) | (q.unl_l > ex_lo)) & ok
        caught += int(bad.sum())
        assert (ex_hi[ok] > 0).all()
    assert (caught == 0) == (variant in ("kernel", "reference"))


@pytest.mark.parametrize("listed,width", [(8, 0.5), (8, 3.0), (256, 0.5)])
def test_narrowed_top_p_queries_are_sound(listed, width, monkeypatch):
    """Queries narrowed to tighter bounds (the next round's, TopPQueries.narrowed: the list and
    the unlisted masses kept, the listed bounds re-sorted) never contradict vLLM's top-p, on
    rows where some tokens were tightened to their exact value (as scoring does: the list's
    order changes, exact values fall below the old K-th bound) and some rows dropped out; they
    decide at least what the wide queries decided; bounds that are not within the old ones, or
    other rows, or another top-p, give None (the caller builds anew)."""
    from vllm_csv.sampling.nucleus.top_p_queries import TopPQueries

    monkeypatch.setattr(queries, "QUERY_LIST", listed)
    for y, g in (rows(21), peaked_rows(22)):
        R, V = y.shape
        p = torch.rand(R, generator=g) * 0.98 + 0.01
        p[::7] = 1.0  # off
        lo = y - torch.rand(y.shape, generator=g) * width
        hi = y + torch.rand(y.shape, generator=g) * width
        kept = torch.isfinite(apply_top_k_top_p_pytorch(y.clone(), None, p))
        wide = TopPQueries(lo, hi, p)
        scored = hi.topk(3 * listed, dim=1).indices  # the tokens of highest upper bound: exact now
        scored = scored[:, torch.randperm(scored.shape[1], generator=g)[:listed]]
        lo2, hi2 = lo.clone(), hi.clone()
        lo2.scatter_(1, scored, y.gather(1, scored))
        hi2.scatter_(1, scored, y.gather(1, scored))
        p2 = p.clone()
        p2[::5] = 1.0  # rows certified in the first round: off now
        q = wide.narrowed(lo2, hi2, p2)
        assert q is not None and q.rows.numel() < R
        only = _asked(y, g, 0.3)
        olo, ohi = q.bounds(only, only)
        k, d = decisions(olo, ohi, y)
        on = (p2 < 1.0)[:, None]
        assert not (k & ~kept & on).any() and not (d & kept & on).any()
        k0, d0 = decisions(*wide.bounds(only), y)
        assert not ((k0 & ~k) & on & only).any() and not ((d0 & ~d) & on & only).any()
        assert (k & on & only).any() and (d & on & only).any()
        assert wide.narrowed(lo2 - 1.0, hi2, p2) is None  # a lower bound fell
        assert wide.narrowed(lo2, hi2 + 1e-3, p2) is None  # an upper bound rose
        lo3 = lo2.clone()
        lo3[1, 5] = math.nan
        assert wide.narrowed(lo3, hi2, p2) is None
        assert wide.narrowed(lo2, hi2, torch.where(p2 < 1.0, p2 * 0.5, 1.0)) is None  # another top-p
        assert wide.narrowed(lo2, hi2, torch.where(p < 1.0, p, 0.5)) is None  # a row it did not have


def test_narrowed_queries_keep_the_unlisted_below_the_old_list(monkeypatch):
    """Listed tokens scored far below the list's old K-th bound do not make the list cover a
    token: an unlisted token just below that old bound may still sort after it. Token 6 (y
    0.05, bounds [0, 5.5]) is listed; token 8 (y 4.9, bounds [-20, 4.95]) is not (the K-th bound
    is 5.0); the other listed tokens' exact values are -10. vLLM drops token 6 at p = 0.5
    (token 8 holds 99% of the mass): no query may keep it."""
    from vllm_csv.sampling.nucleus.top_p_queries import TopPQueries

    V, K = 64, 8
    y = torch.full((1, V), -8.0)
    lo, hi = y - 1.0, y + 1.0
    listed = [0, 1, 2, 3, 4, 5, 7]
    y[0, listed] = -10.0
    lo[0, listed], hi[0, listed] = -11.0, 6.5
    hi[0, 7] = 5.0  # the K-th bound
    y[0, 6], lo[0, 6], hi[0, 6] = 0.05, 0.0, 5.5
    y[0, 8], lo[0, 8], hi[0, 8] = 4.9, -20.0, 4.95
    p = torch.tensor([0.5])
    assert not torch.isfinite(apply_top_k_top_p_pytorch(y.clone(), None, p))[0, 6]
    only = torch.zeros(1, V, dtype=torch.bool)
    only[0, 6] = True
    monkeypatch.setattr(queries, "QUERY_LIST", K)
    wide = TopPQueries(lo, hi, p)
    assert int(wide.is_listed[0].sum()) == K and bool(wide.is_listed[0, 6]) and not bool(wide.is_listed[0, 8])
    lo2, hi2 = lo.clone(), hi.clone()
    lo2[0, listed], hi2[0, listed] = -10.0, -10.0  # scored: exact
    q = wide.narrowed(lo2, hi2, p)
    assert q is not None
    olo, ohi = q.bounds(only, only)
    assert olo[0, 6] == -math.inf  # not kept (undecided or dropped)


def _adversarial_min_p_rows(seed, R=96, V=3000):
    """Rows for min-p on bounds: scales from 1e-3 to 1e6, ties, masked tokens, tokens whose lower
    bound is -inf with a finite upper one, values exactly at the row's cut ``max + log(min_p)``
    (and one ulp either side), a huge-norm row, min-p at the floor, below it, and near 1."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1e-3, 1.0, 10.0, 1e3, 1e6])[torch.arange(R) % 5][:, None]
    y = torch.randn(R, V, generator=g) * scale
    y[:, :7] = y[:, 7:14]
    mp = torch.rand(R, generator=g) * 0.9 + 0.01
    mp[::11] = 1e-20  # the floor
    mp[5::11] = 1e-21  # below it: nothing decided
    mp[7::11] = 0.999
    mp[9::13] = 0.0
    cut = (y.amax(1).double() + torch.log(mp.double().clamp_min(1e-30))).float()
    edge = torch.randint(0, V, (R, 40), generator=g)
    at = cut[:, None].expand(R, 40)
    y.scatter_(1, edge[:, :20], at[:, :20])
    y.scatter_(1, edge[:, 20:30], torch.nextafter(at[:, :10], torch.full_like(at[:, :10], math.inf)))
    y.scatter_(1, edge[:, 30:], torch.nextafter(at[:, :10], torch.full_like(at[:, :10], -math.inf)))
    y[::6, 200:300] = -math.inf  # masked
    w1 = torch.rand(R, V, generator=g) * scale * 0.01
    w2 = torch.rand(R, V, generator=g) * scale * 0.01
    w1[::3] = 0.0
    w2[::4] = 0.0
    lo, hi = y - w1, y + w2
    lo[1::4, 400:420] = -math.inf  # lower bound unknown, upper known
    return y, lo, hi, mp, g


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_min_p_decisions_are_sound_on_adversarial_bounds(seed):
    """Every value the bounds allow (their ends and random points between) gets vLLM's own min-p
    decision wherever the bounds decided; rows with NaN or +inf bounds decide nothing."""
    y, lo, hi, mp, g = _adversarial_min_p_rows(seed)
    lo[3, 50], hi[3, 50] = math.nan, math.nan
    hi[8, 60] = math.inf
    nlo, nhi = min_p_bounds(lo, hi, mp)
    kept_for_sure, dropped_for_sure = torch.isfinite(nlo), (nhi == -math.inf) & (hi > -math.inf)
    assert not kept_for_sure[3].any() and not dropped_for_sure[3].any()
    assert not kept_for_sure[8].any() and not dropped_for_sure[8].any()
    for r in (3, 8):
        lo[r], hi[r], y[r] = 0.0, 0.0, 0.0
    pts = [y, lo.clamp_min(-3.0e38).where(torch.isfinite(lo), y), hi.where(torch.isfinite(hi), y)]
    for _ in range(3):
        u = torch.rand(y.shape, generator=g)
        pts.append(torch.where(torch.isfinite(lo) & torch.isfinite(hi), lo + u * (hi - lo), y))
    for p in pts:
        kept = vllm_min_p(p, mp) & torch.isfinite(p)
        assert not (kept_for_sure & ~kept)[torch.isfinite(p)].any()
        assert not (dropped_for_sure & kept).any()
    assert not kept_for_sure[5::11].any() and not dropped_for_sure[5::11].any()  # below the floor
    off = mp == 0
    assert torch.equal(nlo[off], lo[off]) and torch.equal(nhi[off], hi[off])
    assert not dropped_for_sure[1::4, 400:420].any()  # lower bound -inf: |y| unbounded, never dropped
    rows = (mp >= 1e-20) & (torch.arange(mp.numel()) != 3) & (torch.arange(mp.numel()) != 8)
    decided = (kept_for_sure | dropped_for_sure)[rows][torch.isfinite(y[rows])].float().mean()
    assert decided > 0.95


def test_a_negative_min_p_margin_on_the_row_is_caught(monkeypatch):
    """Broken bound: min-p's margin made negative on the whole-row rule: tokens within the
    margin of the cut get decisions vLLM contradicts."""
    monkeypatch.setattr(min_p_mask, "_min_p_margin", lambda y_abs, m_abs: torch.full_like(y_abs, -0.05))
    y, lo, hi, mp, _ = _adversarial_min_p_rows(14)
    nlo, nhi = min_p_bounds(y, y, mp)
    kept = vllm_min_p(y, mp)
    assert (torch.isfinite(nlo) & ~kept & torch.isfinite(y)).any() or ((nhi == -math.inf) & kept).any()


def _cut_rows(seed: int):
    """7 rows of 20000 bounds (longer than a kernel task) for the cut kernels' tests; skips without
    the kernels."""
    from vllm_csv.ops import build

    if not build.kernels_available():
        pytest.skip("CPU kernels not built")
    g = torch.Generator().manual_seed(seed)
    lo = torch.randn(7, 20000, generator=g)
    return lo, lo + torch.rand(7, 20000, generator=g)


def test_min_p_cut_kernel_is_the_reference():
    """The fused min-p cut equals its torch reference bit for bit: values at the thresholds and
    one ulp either side, NaN / +-inf bounds and thresholds, rows longer than a task."""
    from vllm_csv.ops.masks import min_p_cut, min_p_cut_ref

    lo, hi = _cut_rows(21)
    R = lo.shape[0]
    keep = torch.tensor([0.5, -math.inf, math.nan, math.inf, 1.0, 0.0, -2.0])
    drop = torch.tensor([-0.5, -math.inf, math.nan, math.inf, 0.25, 0.0, math.nan])
    lo[:, :100] = keep[:, None]
    lo[:, 100:200] = torch.nextafter(lo[:, :100], torch.full((R, 100), math.inf))
    hi[:, 200:300] = drop[:, None]
    hi[:, 300:400] = torch.nextafter(hi[:, 200:300], torch.full((R, 100), -math.inf))
    lo[:, 400:450] = -math.inf
    lo[:, 450:460], hi[:, 450:460] = math.nan, math.nan
    hi[:, 460:470] = math.inf
    lo[:, 470:480], hi[:, 470:480] = -math.inf, -math.inf
    got, want = min_p_cut(lo, hi, keep, drop), min_p_cut_ref(lo, hi, keep, drop)
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(1.5), b.nan_to_num(1.5))
    assert min_p_cut(lo[:, :0], hi[:, :0], keep, drop)[0].shape == (R, 0)
    with pytest.raises(RuntimeError, match="keep_at"):
        torch.ops.vllm_csv_cpu.min_p_cut(lo, hi, keep[:3], drop)


def test_top_k_cut_kernel_is_the_reference():
    """The fused top-k cut equals its torch reference bit for bit: upper bounds at ``H_k`` and one
    ulp either side, lower bounds at ``H_(k+1)`` / ``H_k`` and one ulp either side, upper bounds at
    ``L_k`` and one ulp below, NaN / +-inf bounds and levels, rows longer than a task; and it
    refuses levels of the wrong shape."""
    from vllm_csv.ops.masks import top_k_cut, top_k_cut_ref

    lo, hi = _cut_rows(23)
    R = lo.shape[0]
    hk = torch.tensor([1.0, -math.inf, math.nan, math.inf, 2.0, 0.0, 0.5])
    hk1 = torch.tensor([0.5, -math.inf, math.nan, 1.0, 2.0, -0.0, math.nan])
    lk = torch.tensor([-0.5, -math.inf, math.nan, math.inf, 0.25, 0.0, 0.5])
    up = torch.full((R, 100), math.inf)
    hi[:, :100] = hk[:, None]
    hi[:, 100:200] = torch.nextafter(hi[:, :100], up)
    hi[:, 200:300] = torch.nextafter(hi[:, :100], -up)
    lo[:, 300:400] = hk1[:, None]
    lo[:, 400:500] = torch.nextafter(lo[:, 300:400], -up)
    lo[:, 500:600] = hk[:, None]
    lo[:, 600:700] = torch.nextafter(lo[:, 500:600], -up)
    hi[:, 700:800] = lk[:, None]
    hi[:, 800:900] = torch.nextafter(hi[:, 700:800], -up)
    lo[:, 900:950] = -math.inf
    lo[:, 950:960], hi[:, 950:960] = math.nan, math.nan
    hi[:, 960:970] = math.inf
    lo[:, 970:980], hi[:, 970:980] = -math.inf, -math.inf
    got, want = top_k_cut(lo, hi, hk, hk1, lk), top_k_cut_ref(lo, hi, hk, hk1, lk)
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(1.5), b.nan_to_num(1.5))
    assert top_k_cut(lo[:, :0], hi[:, :0], hk, hk1, lk)[0].shape == (R, 0)
    with pytest.raises(RuntimeError, match="hk, hk1, lk"):
        torch.ops.vllm_csv_cpu.top_k_cut(lo, hi, hk[:3], hk1, lk)
    with pytest.raises(RuntimeError, match="lo, hi"):
        torch.ops.vllm_csv_cpu.top_k_cut(lo, hi[:, :5], hk, hk1, lk)


def _tied_far_below(seed, R=32, V=512):
    """Rows whose two highest values tie exactly, with bounds up to 1500 wide: masses relative
    to the row's highest upper bound underflow float64 (e^-745)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(R, V, generator=g) * 300
    top = y.argmax(1)
    other = (top + 1 + torch.randint(0, V - 1, (R,), generator=g)) % V
    y[torch.arange(R), other] = y[torch.arange(R), top]  # vLLM's sort order of the tie decides which is dropped
    lo = y - torch.rand(R, V, generator=g) * 1500
    hi = y + torch.rand(R, V, generator=g) * 1500
    exact = torch.rand(R, V, generator=g) < 0.3
    exact[torch.arange(R), top] = exact[torch.arange(R), other] = True
    lo, hi = torch.where(exact, y, lo), torch.where(exact, y, hi)
    return y, lo, hi, torch.stack([top, other], 1), g


@pytest.mark.parametrize("path", ["full", "queries", "narrowed", "narrowed_kept_stale"])
def test_top_p_on_masses_that_underflow_keeps_no_tied_token(path, monkeypatch):
    """Masses that underflow are not "no token" (nucleus.top_p docstring, "underflow in the masses"):
    two tokens tied far below the shift, one of which vLLM's top-p drops (whichever its sort puts
    first), are never certainly kept, and no decision contradicts vLLM's top-p. ``narrowed``: the
    shift left by wider bounds (1e4 above); ``narrowed_kept_stale``: without the rebuild that a
    stale shift triggers (the underflow margin alone)."""
    from vllm_csv.sampling.nucleus.top_p_queries import TopPQueries

    if path == "narrowed_kept_stale":
        monkeypatch.setattr(queries, "STALE_SHIFT", math.inf)
    # the smallest case: token 0 in [-800, 0], token 1 exactly -800 (a tie when y_0 = -800)
    lo, hi, p = torch.tensor([[-800.0, -800.0]]), torch.tensor([[0.0, -800.0]]), torch.tensor([0.3])
    assert top_p_bounds(lo, hi, p)[0][0, 0] == -math.inf
    y, lo, hi, tied, g = _tied_far_below(3)
    R = y.shape[0]
    p = torch.rand(R, generator=g) * 0.6 + 0.05  # below 0.5: one of the tied pair is dropped
    kept = torch.isfinite(apply_top_k_top_p_pytorch(y.clone(), None, p))
    if path == "full":
        olo, ohi = top_p_bounds(lo, hi, p)
    elif path == "queries":
        olo, ohi = TopPQueries(lo, hi, p).bounds(torch.ones_like(lo, dtype=torch.bool))
    else:
        q = TopPQueries(lo, hi + 1e4, p).narrowed(lo, hi, p)
        assert (q is None) == (path == "narrowed")  # a stale shift: built anew
        q = q or TopPQueries(lo, hi, p)
        olo, ohi = q.bounds(torch.ones_like(lo, dtype=torch.bool))
    k, d = decisions(olo, ohi, y)
    assert not (k & ~kept).any() and not (d & kept).any()
    assert not k.gather(1, tied).any()
