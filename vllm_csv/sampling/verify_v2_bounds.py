"""What vLLM's Model Runner V2 computes when it verifies drafts (``standard`` rejection sampling;
CUDA), and bounds on it: the arithmetic :mod:`.verify_v2` (the certificate's loop) and
:mod:`.verify_v2_fused` (the same on the device) decide from.

Read in 0.32.0 and 0.33.0 (``spec_decode/rejection_sampler_utils.py``; one-hot
drafts, ``draft_logits`` None: ngram drafts, or a drafter's greedy ones, every drafter's default;
probabilistic drafts below). Request ``i`` has rows
``r_0 .. r_n`` (its ``n`` draft tokens' target rows, then its bonus row), each processed by the
sampler's ``apply_sampling_params`` (for the requests certified here: ``x = fl32(l / T)``, not
divided at ``T = 1``). Row ``r_j`` verifies draft ``d_j`` (the input token of row ``r_{j + 1}``):

    lse_j  = G + log(sum_b s_b exp(m_b - G))     (fp32: blocks of 8192 tokens, m_b their maxima,
                                                  s_b = sum exp(x - m_b), G = max_b m_b)
    u_j    = max(tl.rand(seed, pos_j), 4.6566127342e-10)      (Philox 4x32-10: :func:`~vllm_csv.gumbel_noise.philox_uniform`)
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

:func:`decide` compares bounds on what the kernel computes for ``x_d - lse`` with bounds on its
``log(u)`` (:func:`logprob_slack`, :func:`log_slack`) and answers accept, reject or undecided per
row (:func:`decide_from`, from bounds on the draft's value, the row's lse and its maximum).
"""

from __future__ import annotations

import math

import torch

from ..gumbel_noise import LOG_ABS, LOG_REL
from .gumbel_v2 import temperature_bounds

BLOCK = 8192  # V2's vocabulary block for the row statistics (``VOCAB_BLOCK_SIZE``)
ACCEPT, REJECT, UNDECIDED = 1, -1, 0


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
        ``[N]`` float32, :func:`~vllm_csv.gumbel_noise.philox_uniform` of each row.
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
    gmax = torch.maximum(qlo.amax(1).double().abs(), qhi.amax(1).double().abs())
    qd = None if draft_lp is None else (draft_lp[0].gather(1, d).squeeze(1), draft_lp[1].gather(1, d).squeeze(1))
    return decide_from(xlo, xhi, lse_bounds(qlo, qhi) if lse is None else lse, gmax, V, drafts, u, qd)


def decide_from(xlo: torch.Tensor, xhi: torch.Tensor, lse: tuple[torch.Tensor, torch.Tensor], gmax: torch.Tensor,
                V: int, drafts: torch.Tensor, u: torch.Tensor,
                draft_lp: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """:func:`decide` from bounds on what it reads of a row (float64 ``[N]`` each): the draft's
    processed value ``xlo <= x_d <= xhi``, the row's real lse ``lse = (llo, lhi)``, ``gmax`` a
    bound on ``|G|`` (the row's maximum), the row's vocabulary size ``V``; ``draft_lp``: bounds on
    the draft's own log-probability ``q_d`` (probabilistic drafts). Same result as :func:`decide`."""
    llo, lhi = lse
    big = torch.maximum(torch.maximum(gmax, torch.maximum(xlo.abs(), xhi.abs())), (xlo - lhi).abs() + (xhi - llo).abs())
    slack = logprob_slack(V, big)
    lp_lo, lp_hi = xlo - lhi - slack, xhi - llo + slack
    logu = torch.log(u.double())
    eps = log_slack(logu)
    ok = (drafts >= 0) & torch.isfinite(lp_lo) & torch.isfinite(lp_hi) & torch.isfinite(llo) & torch.isfinite(lhi)
    rhs_lo, rhs_hi = logu - eps, logu + eps
    if draft_lp is not None:  # log(u) + q_d, one more fp32 rounding
        qd_lo, qd_hi = draft_lp
        add = 2.0**-23 * (logu.abs() + torch.maximum(qd_lo.abs(), qd_hi.abs()))
        rhs_lo, rhs_hi = rhs_lo + qd_lo - add, rhs_hi + qd_hi + add
        ok &= torch.isfinite(rhs_lo) & torch.isfinite(rhs_hi)
    out = torch.zeros(xlo.shape[0], dtype=torch.int8, device=xlo.device)
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
    big = _finite_abs_max(qlo, qhi)
    slack = logprob_slack(qlo.shape[1], 2 * big + lhi.abs().nan_to_num(posinf=0.0))[:, None]
    return qlo.double() - lhi[:, None] - slack, qhi.double() - llo[:, None] + slack


def _finite_abs_max(qlo: torch.Tensor, qhi: torch.Tensor) -> torch.Tensor:
    """``[R]`` float64: the largest ``|x|`` of the bounds' finite values (``+-inf`` count 0)."""
    return torch.maximum(qlo.double().abs().nan_to_num(posinf=0.0).amax(1), qhi.double().abs().nan_to_num(posinf=0.0).amax(1))


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
    tlo, thi = logprob_bounds(qlo, qhi, lse)
    return _plus_log1m_ratio(tlo, thi, tlo, thi, dlo, dhi)


def _plus_log1m_ratio(base_lo: torch.Tensor, base_hi: torch.Tensor, tlo: torch.Tensor, thi: torch.Tensor,
                      dlo: torch.Tensor, dhi: torch.Tensor, w: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``base + c`` rounded outwards to fp32 (:func:`residual_bounds`, :func:`shifted_residual_bounds`):
    ``c = log1p(-exp(q - t))`` bounded from ``t`` within ``tlo, thi`` and ``q`` within ``dlo, dhi``
    (the kernel's ``exp`` within ``2^-21 + 104 * 2^-23`` relative), the ``log1p`` and the sum
    within ``2^-21 |r|``; with ``w`` (``|r| <= |value| + w``), ``2^-21 w`` more and the margin's
    ``2^-22 w``. ``-inf`` where the ratio may reach 1 (below) or surely does (both)."""
    from ..fp import round_down32, round_up32

    rel = 2.0**-21 + 104 * 2.0**-23
    with torch.no_grad():
        rho_lo = torch.exp((dlo - thi).clamp(max=100.0)) * (1 - rel)
        rho_hi = torch.exp((dhi - tlo).clamp(max=100.0)) * (1 + rel)
        hi = base_hi + torch.log1p(-rho_lo.clamp(max=1.0))
        lo = base_lo + torch.log1p(-rho_hi.clamp(max=1.0))
    if w is None:
        hi, lo = hi + 2.0**-21 * hi.abs(), lo - 2.0**-21 * lo.abs()
    else:
        hi, lo = hi + 2.0**-21 * (hi.abs() + w) + 2.0**-22 * w, lo - 2.0**-21 * (lo.abs() + w) - 2.0**-22 * w
    hi = torch.where(rho_lo < 1, hi, -math.inf)
    lo = torch.where(rho_hi < 1 - 2.0**-20, lo, -math.inf)
    # (NaN: a ratio of two -inf log-probabilities, a token the kernel gives -inf; not nan_to_num,
    # which would also turn the infinities into the largest finite values)
    return (round_down32(torch.where(torch.isnan(lo), -math.inf, lo)),
            round_up32(torch.where(torch.isnan(hi), math.inf, hi)))


def shifted_residual_bounds(qlo: torch.Tensor, qhi: torch.Tensor, dlo: torch.Tensor, dhi: torch.Tensor,
                            lse: tuple[torch.Tensor, torch.Tensor], gmax: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on ``z = r + (L - S)``: what V2's resampling kernel draws from (:func:`residual_bounds`'
    ``r``, fp32, the kernel's own) plus one shift common to the row, ``L`` the kernel's fp32 lse and
    ``S = lse[0]``. V2's draw compares ``r_i + g_i`` between the tokens of one row, which a common
    shift leaves alone, so a certificate on ``z`` is one on ``r`` (the comparison margin below);
    and ``z`` depends on the lse only through the ratio, so a row whose lse is known loosely keeps
    tight bounds wherever the draft's probability is well below the target's.

    ``r = fl(t + c)``, ``t = fl(x - L)``, ``c = fl(log1p(-fl(exp(q - t))))``, hence ``z = x - S +
    eta + c + rho`` with ``eta`` the rounding of ``t``, ``rho`` that of the sum. ``L`` lies within
    ``lse`` widened by :func:`logprob_slack` ``s`` (which also covers ``eta``; its ``big`` as in
    :func:`logprob_bounds` with ``gmax``), so ``t`` within ``[x_lo - lse[1] - s, x_hi - lse[0] +
    s]``, which bounds the ratio and ``c`` as in :func:`residual_bounds` (``c`` decreases with
    ``q`` and increases with ``t``); the ``log1p`` and the sum within ``2^-21 |r|``, ``|r| <= |z| +
    W``, ``W = lse[1] - lse[0] + 2 s >= |L - S|``. The device draw's comparison margin is
    ``2^-23 (A + 24)`` with ``A`` the largest ``|z|`` it is given, where ``|r|`` may be ``W``
    larger: every bound is widened by ``2^-22 W`` more, which covers that on both sides of each
    comparison. ``-inf`` where the ratio may reach 1 (below) or surely does (both), as there.

    Parameters
    ----------
    qlo, qhi : torch.Tensor
        ``[R, V]`` float32 bounds of the processed target logits (some tokens only: the others
        ``-inf``, or ``-inf`` below).
    dlo, dhi : torch.Tensor
        ``[R, V]`` float64, the draft's log-probabilities (:func:`draft_logprob_bounds`).
    lse : tuple of torch.Tensor
        ``[R]`` float64 bounds of each row's real lse (over the whole row).
    gmax : torch.Tensor
        ``[R]`` float64, ``>= |G|`` of the whole row.

    Returns
    -------
    (zlo, zhi) : tuple of torch.Tensor
        ``[R, V]`` float32, rounded outwards.
    """
    V = qlo.shape[1]
    big = torch.maximum(_finite_abs_max(qlo, qhi), gmax)
    s = logprob_slack(V, 2 * big + gmax + math.log(V))[:, None]
    llo, lhi = lse[0][:, None], lse[1][:, None]
    xlo, xhi = qlo.double(), qhi.double()
    z_lo, z_hi = _plus_log1m_ratio(xlo - llo - s, xhi - llo + s, xlo - lhi - s, xhi - llo + s, dlo, dhi,
                                   w=lhi - llo + 2 * s)
    known = torch.isfinite(llo) & torch.isfinite(lhi)  # (S and W finite: else nothing is bounded)
    return z_lo.masked_fill(~known, -math.inf), z_hi.masked_fill(~known, math.inf)


def residual_alone_ok(winner: torch.Tensor, drafts: torch.Tensor, q_hi: torch.Tensor) -> torch.Tensor:
    """Whether a rejected row's residual winner (``[R]`` int64) may be handed to V2 alone (``0``,
    every other token ``-inf``; probabilistic drafts): the kernel then finds ``t_w = 0``, a ratio
    ``exp(q_w)`` and the rest ``-inf``, so it draws the winner, and rejects the draft (``x_d =
    -inf``), which needs the winner not to be the draft and ``q_w`` (upper bound ``q_hi``, float64
    ``[R]``) surely below 0, so that the fp32 ratio is below 1. ``[R]`` bool."""
    return (winner != drafts) & (q_hi < -2.0**-19)


def first_rows(dec: torch.Tensor, cu: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lead [N] bool, a [R] int64)`` for decisions ``dec [N]`` of requests whose rows are
    ``cu[i] .. cu[i + 1] - 1`` (``cu [R + 1]`` int64 on ``dec``'s device): the rows accepted with
    every earlier row of their request accepted, and each request's count of them (its first row
    not accepted is ``cu[i] + a[i]``; its last row, the bonus, ends the walk). No host sync."""
    sizes = cu[1:] - cu[:-1]
    R = sizes.numel()
    req_of = torch.repeat_interleave(torch.arange(R, device=dec.device), sizes, output_size=N)
    last = torch.zeros(N, dtype=torch.bool, device=dec.device)
    last[cu[1:] - 1] = True
    nacc = ((dec != ACCEPT) | last).long()
    before = nacc.cumsum(0) - nacc  # rows not accepted before each row, over the whole batch
    lead = (nacc == 0) & (before == before[cu[:-1]][req_of])
    a = torch.zeros(R, dtype=torch.long, device=dec.device).scatter_add_(0, req_of, lead.long())
    return lead, a


def first_undecided(dec: torch.Tensor, cu: list[int]) -> tuple[list[int], list[int]]:
    """Per request (rows ``cu[i] .. cu[i + 1] - 1``): the index ``a`` of its first row not
    accepted (its last row, the bonus, if all its drafts are: :func:`first_rows`), and that row's
    decision (:data:`REJECT`, :data:`UNDECIDED`; :data:`ACCEPT` standing for the bonus row's
    draw), on the host."""
    cu_t = torch.tensor(cu, dtype=torch.long, device=dec.device)
    _, a = first_rows(dec, cu_t, dec.numel())
    row = cu_t[:-1] + a
    what = torch.where(row == cu_t[1:] - 1, ACCEPT, dec[row].long())
    return a.tolist(), what.tolist()
