"""Certify vLLM's Model Runner V2 verification of drafts (``standard`` rejection sampling; CUDA):
for each sampled request of a speculative step, how many of its draft tokens are accepted and
which token follows them, from bounds on its target rows.

What V2 computes, read in 0.32.0 and 0.33.0 (``spec_decode/rejection_sampler_utils.py``; one-hot
drafts, ``draft_logits`` None: ngram drafts, or a drafter's greedy ones, every drafter's default;
probabilistic drafts below). Request ``i`` has rows
``r_0 .. r_n`` (its ``n`` draft tokens' target rows, then its bonus row), each processed by the
sampler's ``apply_sampling_params`` (for the requests certified here: ``x = fl32(l / T)``, not
divided at ``T = 1``). Row ``r_j`` verifies draft ``d_j`` (the input token of row ``r_{j + 1}``):

    lse_j  = G + log(sum_b s_b exp(m_b - G))     (fp32: blocks of 8192 tokens, m_b their maxima,
                                                  s_b = sum exp(x - m_b), G = max_b m_b)
    u_j    = max(tl.rand(seed, pos_j), 4.6566127342e-10)      (Philox 4x32-10: :func:`rand_uniform`)
    accept d_j  iff  x_{d_j} - lse_j > log(u_j)

from ``j = 0`` until the first rejection ``a`` (or ``a = n``: all accepted); the request's
next token is then V2's Gumbel draw (:mod:`.gumbel_v2`, seed and ``pos_a``) from row ``r_a``
with ``d_a`` removed (``-inf``), or from the bonus row ``r_n`` whole. Rows after ``r_a`` are not
read.

Probabilistic drafts (``draft_sample_method = "probabilistic"``: V2 keeps the drafter's logits
``D``, and each draft was drawn from them): V2 accepts ``d_j`` iff ``x_d - lse > log(u) + q_d``
with ``q = fl(D / T) - lse(fl(D / T))`` computed the same way (:func:`draft_logprob_bounds`: its
inputs are known exactly, only its arithmetic is bounded), and draws the next token after a
rejection from the residual ``t + log1p(-exp(q - t))`` where ``exp(q - t) < 1`` (``-inf``
elsewhere), ``t = x - lse`` (:func:`residual_bounds`), without removing ``d_a``.

The certificate (:func:`certify_verification_v2`): ``x``'s bounds from the head's screen
(:class:`.HeadAdapter`) through :func:`~.gumbel_v2.temperature_bounds`, every draft token
scored exactly; :func:`decide` compares bounds on what the kernel computes for
``x_d - lse`` with bounds on its ``log(u)`` (:func:`logprob_slack`, :func:`log_slack`) and
answers accept, reject or undecided per row; an undecided row gets the tokens of highest upper
bound scored (they carry its mass), up to :data:`ROUNDS` times within the head's budget. A
request is certified when every row up to its first rejection is decided and the draw from
``r_a`` (with ``d_a`` masked) is certified (:func:`~.rows_v2.certify_rows_v2`); otherwise its
rows go dense.

What is handed to V2's kernels for a certified request (:class:`Verified`), so that its
unchanged code takes the same decisions: rows ``r_j, j < a``: ``0`` at ``d_j``, ``-inf``
elsewhere (then ``lse = x_d``, ``x_d - lse = 0 > log(u) + q_d``: accepted, since the kernel's
``log(u) + q_d < 0`` was certified, :func:`decide`); row ``r_a``: with one-hot drafts the draw's
exact values on its scored set, ``-inf`` elsewhere and at ``d_a`` (``x_d - lse = -inf``:
rejected; the residual draw returns the certified winner, :mod:`.rows_v2`); with probabilistic
drafts the residual draw's winner alone (:func:`_residual_draws`); the bonus row: the draw's
exact values; rows after ``r_a``: ``-inf`` (not read). A probabilistic rejected row's residual
compares tokens through the row's lse, so its tokens of highest upper bound are scored until
the lse is within :data:`LSE_WIDTH` before the draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..gumbel_noise import LOG_ABS, LOG_REL
from .gumbel_v2 import min_p_bounds, temperature_bounds
from .head_adapter import HeadAdapter
from .rows_v2 import Bounds, certify_rows_v2
from .scoring import RowsResult, budget_of, score_columns, screen_bounds

ROUNDS = 4  # scoring rounds for undecided acceptances
FIRST = 32  # tokens of highest upper bound scored per row before the first decision (with the drafts)
LSE_WIDTH = 0.01  # a rejected row's lse is pinned this tightly before its residual draw (probabilistic drafts)
BLOCK = 8192  # V2's vocabulary block for the row statistics (``VOCAB_BLOCK_SIZE``)
RAND_MIN = float(np.float32(4.6566127342e-10))  # ``tl_rand32``'s floor (``_TL_RAND_MIN``), as fp32
ACCEPT, REJECT, UNDECIDED = 1, -1, 0

_M32 = (1 << 32) - 1
_PHILOX = (0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85)  # round multipliers A, B; key steps


def rand_uniform(seeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """V2's verification uniform ``tl_rand32(seed, pos, includes_zero=False)``, bit for bit.

    Triton's ``tl.rand(seed, offset)`` (``triton/language/random.py``, read in 3.9; the same
    Philox since 2.x: tests check it against Triton's own under its interpreter, and on a GPU):
    ``randint4x``'s first word of Philox 4x32 with 10 rounds, counter ``(offset_lo, offset_hi,
    0, 0)``, key ``(seed_lo, seed_hi)``, read as int32 ``x`` and mapped to
    ``fl32(fl32(x') * fl32(4.6566127342e-10))``, ``x' = x`` or ``-x - 1`` where negative; vLLM
    then clamps it below at the same constant.

    Parameters
    ----------
    seeds, pos : torch.Tensor
        ``[N]`` int64 (the request's seed, the row's position).

    Returns
    -------
    torch.Tensor
        ``[N]`` float32 on ``seeds``' device.
    """
    s = seeds.detach().cpu().numpy().astype(np.int64).view(np.uint64)
    o = pos.detach().cpu().numpy().astype(np.int64).view(np.uint64)
    m = np.uint64(_M32)
    c0, c1 = o & m, (o >> np.uint64(32)) & m
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = s & m, (s >> np.uint64(32)) & m
    A, B, KA, KB = (np.uint64(v) for v in _PHILOX)
    for _ in range(10):
        pa, pb = A * c0, B * c2  # (exact: both factors below 2^32)
        c0, c1, c2, c3 = ((pb >> np.uint64(32)) ^ c1 ^ k0, pb & m, (pa >> np.uint64(32)) ^ c3 ^ k1, pa & m)
        k0, k1 = (k0 + KA) & m, (k1 + KB) & m
    x = c0.astype(np.uint32).view(np.int32).astype(np.int64)
    x = np.where(x < 0, -x - 1, x).astype(np.float32)
    u = (x * np.float32(4.6566127342e-10)).astype(np.float32)
    return torch.from_numpy(np.maximum(u, np.float32(RAND_MIN))).to(seeds.device)


def log_slack(logu: torch.Tensor) -> torch.Tensor:
    """How far the kernel's fp32 ``tl.log(u)`` may lie from the real ``log(u)`` (float64 ``[N]``):
    :data:`~vllm_csv.gumbel_noise.LOG_ABS` + ``LOG_REL |log u|``, as for min-p's logarithm."""
    return LOG_ABS + LOG_REL * logu.abs()


def lse_bounds(qlo: torch.Tensor, qhi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on the real ``log sum exp(x)`` of rows with ``qlo <= x <= qhi`` (``[N, V]`` float32,
    ``-inf`` where a token is certainly ``-inf``): float64 ``[N]`` each (monotone in every ``x``)."""
    return torch.logsumexp(qlo.double(), 1), torch.logsumexp(qhi.double(), 1)


def logprob_slack(V: int, big: torch.Tensor) -> torch.Tensor:
    """How far V2's fp32 ``x_d - lse`` may lie from the real value computed from the same ``x``
    (float64 ``[N]``), ``big`` bounding ``|G|``, ``|x_d|`` and ``|x_d - lse|``:

    * the sums: each ``s_b`` adds at most :data:`BLOCK` positive terms, the total
      ``V / BLOCK`` more, any order: relative error ``gamma_(BLOCK + blocks)``, ``2^-23`` a term
      here; each term's ``exp`` (Triton's fp32 ``exp``, an approximate ``ex2`` on NVIDIA GPUs of an
      argument rounded once) within ``2^-21 + 104 * 2^-23`` relative (arguments below ``-104``
      underflow: an absolute ``2^-126`` each, against a sum of at least 1, the maximum's term);
      ``log(1 + r) <= 1.01 r``;
    * the ``log``: :data:`~vllm_csv.gumbel_noise.LOG_ABS` + ``LOG_REL log(V)``;
    * three fp32 roundings (``G + log``, ``x_d - lse``, the subtraction inside each ``exp``'s
      argument is in the ``exp`` term): ``2^-23 big`` each."""
    blocks = -(-V // BLOCK)
    rel = (min(V, BLOCK) + blocks) * 2.0**-23 + 2 * (2.0**-21 + 104 * 2.0**-23) + V * 2.0**-126
    return 1.01 * rel + LOG_ABS + LOG_REL * math.log(max(V, 2)) + 3 * 2.0**-23 * big


def decide(qlo: torch.Tensor, qhi: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor,
           draft_lp: tuple[torch.Tensor, torch.Tensor] | None = None,
           lse: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Each row's verification decision from bounds on its processed logits.

    Parameters
    ----------
    qlo, qhi : torch.Tensor
        ``[N, V]`` float32 bounds on ``x`` (what V2's kernel reads).
    drafts : torch.Tensor
        ``[N]`` int64, the draft token each row verifies (``< 0``: none, the bonus row).
    u : torch.Tensor
        ``[N]`` float32, :func:`rand_uniform` of each row.
    draft_lp : tuple of torch.Tensor, optional
        ``(lo, hi)`` float64 ``[N, V]``: bounds on the kernel's draft log-probabilities
        (:func:`draft_logprob_bounds`; probabilistic drafts, which V2 accepts when
        ``x_d - lse > log(u) + q_d``); None: one-hot drafts (``q_d = 0``).
    lse : tuple of torch.Tensor, optional
        :func:`lse_bounds` of ``qlo, qhi``, where the caller has them already.

    Returns
    -------
    torch.Tensor
        ``[N]`` int8: :data:`ACCEPT` or :data:`REJECT` where the kernel certainly decides so,
        else :data:`UNDECIDED` (bonus rows included). An acceptance also needs ``log(u) + q_d < 0``
        for certain: the row handed over for it holds the draft alone (``x_d - lse = 0``).
    """
    N, V = qlo.shape
    d = drafts.clamp(min=0)[:, None]
    xlo, xhi = qlo.gather(1, d).squeeze(1).double(), qhi.gather(1, d).squeeze(1).double()
    llo, lhi = lse_bounds(qlo, qhi) if lse is None else lse
    gmax = torch.maximum(qlo.double().amax(1).abs(), qhi.double().amax(1).abs())
    big = torch.maximum(torch.maximum(gmax, torch.maximum(xlo.abs(), xhi.abs())), (xlo - lhi).abs() + (xhi - llo).abs())
    slack = logprob_slack(V, big)
    lp_lo, lp_hi = xlo - lhi - slack, xhi - llo + slack
    logu = torch.log(u.double())
    eps = log_slack(logu)
    ok = (drafts >= 0) & torch.isfinite(lp_lo) & torch.isfinite(lp_hi) & torch.isfinite(llo) & torch.isfinite(lhi)
    rhs_lo, rhs_hi = logu - eps, logu + eps
    if draft_lp is not None:  # log(u) + q_d, one more fp32 rounding
        qd_lo, qd_hi = draft_lp[0].gather(1, d).squeeze(1), draft_lp[1].gather(1, d).squeeze(1)
        add = 2.0**-23 * (logu.abs() + torch.maximum(qd_lo.abs(), qd_hi.abs()))
        rhs_lo, rhs_hi = rhs_lo + qd_lo - add, rhs_hi + qd_hi + add
        ok &= torch.isfinite(rhs_lo) & torch.isfinite(rhs_hi)
    out = torch.zeros(N, dtype=torch.int8, device=qlo.device)
    out[ok & (lp_lo > rhs_hi) & (rhs_hi < 0)] = ACCEPT
    out[ok & (lp_hi < rhs_lo)] = REJECT
    return out


def draft_logprob_bounds(draft: torch.Tensor, temp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on V2's fp32 draft log-probabilities ``fl(draft / T) - lse`` of every token (the
    draft logits are given exactly: only the kernel's division, sums, ``exp`` and ``log`` are
    bounded, as for the target rows: :func:`logprob_slack`).

    Parameters
    ----------
    draft : torch.Tensor
        ``[N, V]`` the drafter's logits of each row as V2 keeps them (pre-temperature).
    temp : torch.Tensor
        ``[N]`` float32, the rows' temperatures.

    Returns
    -------
    (lo, hi) : tuple of torch.Tensor
        ``[N, V]`` float64; ``-inf`` on tokens whose draft logit is ``-inf``.
    """
    x = draft.float()
    return logprob_bounds(*temperature_bounds(x, x, temp))


def logprob_bounds(qlo: torch.Tensor, qhi: torch.Tensor, lse: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on V2's fp32 log-probabilities ``x - lse`` of every token of rows with
    ``qlo <= x <= qhi`` (``[R, V]`` float32): the real ones' bounds (:func:`lse_bounds`, intersected
    with ``lse``, other float64 ``[R]`` bounds on the rows' real lse, where given) widened by
    :func:`logprob_slack` with ``2 max |x| + |lse|`` bounding ``|G|``, ``|x|`` and ``|x - lse|``
    (infinities left out of the maxima). Returns ``[R, V]`` float64 each."""
    llo, lhi = lse_bounds(qlo, qhi)
    if lse is not None:
        llo, lhi = torch.maximum(llo, lse[0]), torch.minimum(lhi, lse[1])
    big = torch.maximum(qlo.double().abs().nan_to_num(posinf=0.0).amax(1), qhi.double().abs().nan_to_num(posinf=0.0).amax(1))
    slack = logprob_slack(qlo.shape[1], 2 * big + lhi.abs().nan_to_num(posinf=0.0))[:, None]
    return qlo.double() - lhi[:, None] - slack, qhi.double() - llo[:, None] + slack


def residual_bounds(qlo: torch.Tensor, qhi: torch.Tensor, dlo: torch.Tensor, dhi: torch.Tensor,
                    lse: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on what V2's resampling kernel draws from on a rejected row with probabilistic
    drafts: ``r = t + log1p(-exp(q - t))`` where the fp32 ``exp(q - t) < 1``, else ``-inf``, with
    ``t = x - lse`` the target's log-probabilities (``x`` within ``qlo, qhi``, ``[R, V]`` float32)
    and ``q`` the draft's (``dlo, dhi``, ``[R, V]`` float64, :func:`draft_logprob_bounds`).

    ``r`` increases with ``t`` and decreases with ``q``; the kernel's ``exp`` is within
    ``2^-21 + 104 * 2^-23`` relative of the real one (:func:`logprob_slack`), its ``log1p``
    (libdevice) and the final addition within ``2^-22`` relative each: a token whose ratio may
    reach 1 gets a lower bound of ``-inf``, one whose ratio is surely at least 1 both bounds
    ``-inf``. ``t``'s bounds: :func:`logprob_bounds` (with ``lse``). Returns ``[R, V]`` float32,
    rounded outwards."""
    from ..fp import round_down32, round_up32

    tlo, thi = logprob_bounds(qlo, qhi, lse)
    rel = 2.0**-21 + 104 * 2.0**-23
    with torch.no_grad():
        rho_lo = torch.exp((dlo - thi).clamp(max=100.0)) * (1 - rel)
        rho_hi = torch.exp((dhi - tlo).clamp(max=100.0)) * (1 + rel)
        r_hi = thi + torch.log1p(-rho_lo.clamp(max=1.0))
        r_lo = tlo + torch.log1p(-rho_hi.clamp(max=1.0))
    r_hi = torch.where(rho_lo < 1, r_hi + 2.0**-21 * r_hi.abs(), -math.inf)
    r_lo = torch.where(rho_hi < 1 - 2.0**-20, r_lo - 2.0**-21 * r_lo.abs(), -math.inf)
    # (NaN: a ratio of two -inf log-probabilities, a token the kernel gives -inf; not nan_to_num,
    # which would also turn the infinities into the largest finite values)
    return (round_down32(torch.where(torch.isnan(r_lo), -math.inf, r_lo)),
            round_up32(torch.where(torch.isnan(r_hi), math.inf, r_hi)))


def first_undecided(dec: torch.Tensor, cu: list[int]) -> tuple[list[int], list[int]]:
    """Per request (rows ``cu[i] .. cu[i + 1] - 1``): the index ``a`` of its first row not
    accepted (its last row, the bonus, if all its drafts are), and that row's decision
    (:data:`REJECT`, :data:`UNDECIDED`; :data:`ACCEPT` standing for the bonus row's draw)."""
    d = dec.tolist()
    first, what = [], []
    for i in range(len(cu) - 1):
        a, n = 0, cu[i + 1] - cu[i] - 1
        while a < n and d[cu[i] + a] == ACCEPT:
            a += 1
        first.append(a)
        what.append(ACCEPT if a == n else d[cu[i] + a])
    return first, what


@dataclass
class Verified:
    """:func:`certify_verification_v2`'s result for ``R`` requests over ``N`` rows."""

    values: torch.Tensor  # [N, V] model dtype: the rows to hand to V2 (module docstring); certified requests only
    certified: torch.Tensor  # [R] bool (host)
    accepted: list[int]  # per request: drafts accepted (meaningful where certified)
    token: list[int]  # per request: the token after them (meaningful where certified)
    reason: list[str | None]  # per request: None if certified, else why not
    scored: int  # tokens scored in the acceptance rounds plus the draws'


def certify_verification_v2(adapter: HeadAdapter, hidden: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                            temp: torch.Tensor, drafts: torch.Tensor, cu: list[int],
                            draft_logits: torch.Tensor | None = None, process: Bounds | None = None,
                            min_p: torch.Tensor | None = None) -> Verified:
    """Certify V2's verification (module docstring) of ``R`` sampled requests.

    Parameters
    ----------
    adapter : HeadAdapter
    hidden : torch.Tensor
        ``[N, d]`` model dtype: each request's rows, its target rows then its bonus row,
        request after request.
    seeds, pos : torch.Tensor
        ``[N]`` int64: each row's request seed and position (V2's ``pos`` of the row).
    temp : torch.Tensor
        ``[N]`` float32, each row's request temperature (``> 0``; V2 divides by it unless 1).
    drafts : torch.Tensor
        ``[N]`` int64: the draft token each target row verifies; ``-1`` on bonus rows.
    cu : list of int
        ``[R + 1]``: request ``i``'s rows are ``cu[i] .. cu[i + 1] - 1``.
    draft_logits : torch.Tensor, optional
        ``[N, V]``: probabilistic drafts, the drafter's logits (pre-temperature) each target row's
        draft was drawn from (bonus rows: anything); None: one-hot drafts.
    process : callable, optional
        ``(lo, hi) -> (lo, hi)``: vLLM's logits processors V2 runs before the temperature, on
        ``[N, V]`` float32 bounds of all the rows (out of place; each monotone per token, as in
        :func:`~.rows_v2.certify_rows_v2`). None: no processor acts on these rows.
    min_p : torch.Tensor, optional
        ``[N]`` float32, each row's ``min_p`` (0: none; None: no row has one). V2 applies it in
        ``apply_sampling_params``, after the temperature, on the whole row (a rejected draft
        included), before the kernels verify and draw (:func:`_one_hot_draws`).

    Returns
    -------
    Verified
    """
    N, V, R = hidden.shape[0], adapter.vocab_size, len(cu) - 1
    dev = hidden.device
    values = torch.full((N, V), -math.inf, dtype=adapter.dtype, device=dev)
    certified = torch.zeros(R, dtype=torch.bool)
    reasons: list[str | None] = ["uncertified"] * R
    accepted, token = [0] * R, [0] * R
    lo, hi, hnorm, finite, _ = screen_bounds(adapter, hidden)
    budget = budget_of(adapter)
    scored = torch.zeros(V, dtype=torch.bool, device=dev)
    vals = torch.full((N, V), -math.inf, dtype=adapter.dtype, device=dev)
    target = drafts >= 0
    first = torch.cat([drafts[target].unique(), hi.topk(min(FIRST, V), 1).indices[target].flatten().unique()])
    score_columns(adapter, hidden, hnorm, first.unique(), vals, lo, hi, scored)
    u = rand_uniform(seeds, pos)
    dlp = None if draft_logits is None else draft_logprob_bounds(draft_logits, temp)
    fin = finite.cpu().tolist()
    req_finite = [all(fin[cu[i]:cu[i + 1]]) and float(temp[cu[i]]) > 0 for i in range(R)]
    for rnd in range(ROUNDS + 1):
        qlo, qhi = _processed(lo, hi, temp, process, min_p)
        llo, lhi = lse_bounds(qlo, qhi)
        dec = decide(qlo, qhi, drafts, u, dlp, (llo, lhi))
        a, what = first_undecided(dec, cu)
        open_rows = [cu[i] + a[i] for i in range(R) if req_finite[i] and what[i] == UNDECIDED]
        if dlp is not None:  # a residual draw compares tokens through the row's lse: pin it first
            open_rows += [cu[i] + a[i] for i in range(R) if req_finite[i] and what[i] == REJECT
                          and not float(lhi[cu[i] + a[i]] - llo[cu[i] + a[i]]) < LSE_WIDTH]
        room = budget - int(scored.sum())
        if not open_rows or rnd == ROUNDS or room <= 0:
            break
        # the open rows' mass: their tokens of highest upper bound not scored yet
        rows = torch.tensor(open_rows, device=dev)
        width = min(V, FIRST << (2 * (rnd + 1)), max(1, room // len(open_rows)))
        cand = qhi[rows].masked_fill(scored[None], -math.inf).topk(width, 1)
        new = cand.indices[torch.isfinite(cand.values)].unique()
        if new.numel() == 0:
            break
        score_columns(adapter, hidden, hnorm, new[:room], vals, lo, hi, scored)
    n_scored = int(scored.sum())
    draw = [i for i in range(R) if req_finite[i] and what[i] != UNDECIDED]
    for i in range(R):
        if not req_finite[i]:
            reasons[i] = "nonfinite"
        elif what[i] == UNDECIDED and n_scored >= budget:
            reasons[i] = "budget"
    # the draws: row r_a of each decided request (the bonus row; with one-hot drafts also a
    # rejected row, d_a removed: _one_hot_draws; with probabilistic drafts a rejected row's
    # residual: _residual_draws, its lse held within the last round's bounds)
    one_hot = [i for i in draw if what[i] == ACCEPT or dlp is None]
    d_list = drafts.tolist()
    for group, residual in ((one_hot, False), ([i for i in draw if i not in one_hot], True)):
        if not group:
            continue
        rows = torch.tensor([cu[i] + a[i] for i in group], device=dev)
        sub = None if process is None else _rows_of(process, rows, N)
        if residual:
            res = _residual_draws(adapter, hidden[rows], seeds[rows], pos[rows], temp[rows],
                                  (dlp[0][rows], dlp[1][rows]), drafts[rows], (llo[rows], lhi[rows]), sub,
                                  None if min_p is None else min_p[rows])
        else:
            removed = torch.tensor([d_list[cu[i] + a[i]] if what[i] == REJECT else -1 for i in group], device=dev)
            res = _one_hot_draws(adapter, hidden[rows], seeds[rows], pos[rows], temp[rows], removed, sub,
                                 None if min_p is None else min_p[rows])
        n_scored += res.scored
        ok, win = res.certified.cpu().tolist(), res.winner.cpu().tolist()
        for j, i in enumerate(group):
            if not ok[j]:
                reasons[i] = res.reason[j]
                continue
            certified[i], reasons[i], accepted[i], token[i] = True, None, a[i], win[j]
            r0 = cu[i]
            for k in range(a[i]):  # accepted rows: one finite token, the draft
                values[r0 + k, d_list[r0 + k]] = 0.0
            values[r0 + a[i]] = res.values[j]
    return Verified(values, certified, accepted, token, reasons, n_scored)


def _processed(lo: torch.Tensor, hi: torch.Tensor, temp: torch.Tensor, process: Bounds | None,
               min_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on what V2's kernels read of rows with head values within ``lo, hi``: vLLM's
    processors (``process``), the temperature, then min-p, in ``apply_sampling_params``' order."""
    qlo, qhi = temperature_bounds(*((lo, hi) if process is None else process(lo, hi)), temp)
    return (qlo, qhi) if min_p is None else min_p_bounds(qlo, qhi, min_p)[:2]


def _rows_of(process: Bounds, rows: torch.Tensor, N: int) -> Bounds:
    """``process`` (a map of all ``N`` rows' bounds) as a map of the bounds of ``rows`` alone: run
    on ``[N, V]`` tensors holding them (vLLM's processors read a row's context by its place among
    the rows: a request's earlier drafts for the penalties), the other rows zeros."""
    def sub(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = [torch.zeros((N, x.shape[1]), dtype=x.dtype, device=x.device).index_copy_(0, rows, x) for x in (lo, hi)]
        plo, phi = process(*full)
        return plo[rows], phi[rows]

    return sub


def _one_hot_draws(adapter: HeadAdapter, hidden: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                   temp: torch.Tensor, removed: torch.Tensor, process: Bounds | None = None,
                   min_p: torch.Tensor | None = None):
    """V2's draw from the rows after a rejection of a one-hot draft ``removed`` (``>= 0``; ``-1``:
    none, a bonus row): V2 processes the whole row (min-p's threshold taken with the draft still
    in it), then its kernel draws with the draft removed: :func:`~.rows_v2.certify_rows_v2` with
    the draft ``removed`` after min-p (its certified rows carry ``-inf`` on the tokens min-p
    certainly drops and on the draft)."""
    gone = torch.zeros(hidden.shape[0], adapter.vocab_size, dtype=torch.bool, device=hidden.device)
    rows = (removed >= 0).nonzero().squeeze(1)
    gone[rows, removed[rows]] = True
    return certify_rows_v2(adapter, hidden, seeds, pos, temp, process=process, min_p=min_p,
                           removed=gone if rows.numel() else None)


def _residual_draws(adapter: HeadAdapter, hidden: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                    temp: torch.Tensor, dlp: tuple[torch.Tensor, torch.Tensor], drafts: torch.Tensor,
                    lse: tuple[torch.Tensor, torch.Tensor], process: Bounds | None = None,
                    min_p: torch.Tensor | None = None):
    """V2's draw from rejected rows' residuals (probabilistic drafts): :func:`~.rows_v2.certify_rows_v2`
    on :func:`residual_bounds` (``T = 1`` there: the residual is drawn undivided), the rows' lse
    held within ``lse`` (float64 ``[R]`` bounds from the acceptance rounds' scoring, which the
    draw's own rounds, starting from the screen, would otherwise redo). A certified
    row is handed over holding its winner alone (``0``; every other token ``-inf``): the kernel
    then finds ``t_w = 0``, a ratio ``exp(q_w) < 1`` and the rest ``-inf``, so it draws the
    winner, and rejects the draft (``x_d = -inf``), which needs the winner not to be the draft
    and ``q_w`` surely below 0: rows where either fails are not certified."""
    def residual(lo, hi):  # (the residual of the row min-p left)
        return residual_bounds(*_processed(lo, hi, temp, process, min_p), *dlp, lse=lse)

    res = certify_rows_v2(adapter, hidden, seeds, pos, torch.ones_like(temp), process=residual)
    w = res.winner[:, None]
    ok = res.certified & (res.winner != drafts) & (dlp[1].gather(1, w).squeeze(1) < -2.0**-19)
    values = torch.full_like(res.values, -math.inf).scatter_(1, w, 0.0)
    reason = [r if c else (r or "uncertified") for r, c in zip(res.reason, ok.tolist())]
    return RowsResult(values, ok, res.winner, reason, res.scored)
