"""Certify sampled requests' verification in vLLM's V2 ``RejectionSampler`` (the V2 runner's
speculative steps, CUDA): the wrapped ``RejectionSampler.__call__`` (:mod:`..patches`).

In a step with draft tokens the plan defers every row of a temperature-sampling request (with
min-p, vLLM's processors or neither; mode ``spec_sampling``, :func:`~..plan.target_plan`): the
head leaves them as placeholders and hands their hidden states over on the step. Here, before vLLM's own code:

1. the drafts each row verifies, as V2's ``gather_draft_sampled`` makes them (:func:`drafts_of`:
   the next row's input token; a placeholder ``-1`` where the request has not sampled past its
   prefill, which makes its request dense here, as does a draft past the vocabulary), each row's request seed, temperature and
   position, read the way the kernels read them (``expanded_idx_mapping``, ``positions[logits_indices]``);
2. :func:`~vllm_csv.sampling.verify_v2.certify_verification_v2`: the accepted drafts and the next
   token of each request from bounds on its rows, decided or not; on CUDA's backend the same
   certificate on the device (:func:`~vllm_csv.sampling.verify_v2_fused.verify_fused`: the fused
   step's kernels, one host read instead of a few a round);
3. a certified request's rows are written as that module hands them to V2 (accepted rows: one
   finite token, the draft; the first rejected row: with one-hot drafts the draw's exact values
   with the rejected draft at ``-inf``, with probabilistic drafts (``draft_logits``, the
   drafter's logits V2 keeps for its ratio test) the residual draw's winner alone; the bonus
   row: the draw's exact values; on the device path the token alone on either; later rows
   ``-inf``), every other deferred row gets the dense head's values (:mod:`..fill`).

vLLM's unchanged ``RejectionSampler`` then verifies and draws from those logits: the same accepted
counts and tokens as on the dense head's rows, and no random state to keep in step (V2's
uniforms and Gumbel noise are hashed from the seed and the position).

vLLM's V2 processors (:func:`~.sampler._processors`, each row's context read as V2 reads it in
a speculative step) and min-p run on the bounds (:mod:`vllm_csv.sampling.verify_v2`).

Dense instead (:func:`_unsupported`): a draft vocabulary of another size (V2 then verifies over
the smaller), drafts a grammar invalidated, a top-k or top-p anywhere in the batch, a thinking
budget, logprobs asked in the batch (V2 computes them over every row), a sampler the V2 hook
does not certify, verification other than ``standard``, tensor parallelism, deferred rows that
are not whole requests.
"""

from __future__ import annotations


import numpy as np
import torch

from ... import clock
from ...sampling.types import RowsResult
from ...sampling.sharded_rows import ShardedAdapter
from ...sampling.verify_v2 import certify_verification_v2
from ...sampling.verify_v2_fused import verify_fused
from ..fill import finish, write_certified
from ..step import Deferred, DeferredStats, take_handoff
from .sampler import _processors, drawn_otherwise, fused_draw_for
from .spec import verification_ok


def drafts_of(input_batch, prefill_len: torch.Tensor) -> torch.Tensor:
    """V2's ``gather_draft_sampled`` (``spec_decode/rejection_sampler.py``, read in 0.32.0 and
    0.33.0) in torch: ``[num_logits]`` int64, each logits row's input token, ``-1`` where the row
    is a draft slot of a request still within its prefill (``local_pos > 0`` and
    ``pos - local_pos < prefill_len``). Row ``r``'s draft is entry ``r + 1``."""
    idx = input_batch.logits_indices.long()
    token = input_batch.input_ids[idx].long()
    pos = input_batch.positions[idx].long()
    local = input_batch.expanded_local_pos.long()
    prefill = prefill_len[input_batch.expanded_idx_mapping.long()].long()
    return torch.where((local > 0) & (pos - local < prefill), -1, token)


def _unsupported(rs, d: Deferred, input_batch, draft_logits, invalid_drafts) -> str | None:
    if not verification_ok(rs):
        return "the rejection sampler is not V2's standard verification with its fp32 Gumbel sampler"
    if isinstance(d.adapter, ShardedAdapter):
        return "tensor parallelism (the V2 verification certificate is not sharded)"
    if draft_logits is not None and draft_logits.shape[-1] != d.logits.shape[-1]:
        return "a draft vocabulary of another size than the target's"
    if invalid_drafts is not None:
        return "drafts checked by a grammar"
    ss, batch = rs.sampler.sampling_states, input_batch.idx_mapping_np
    if ss.max_num_logprobs(batch) != -1:  # (NO_LOGPROBS: computed over every row when any asks)
        return "logprobs in the batch"
    slots = input_batch.expanded_idx_mapping[d.rows.to(input_batch.expanded_idx_mapping.device)].cpu().numpy()
    if bool(np.any(ss.temperature.np[slots] <= 0)):
        return "a temperature of 0 on a deferred request"
    return drawn_otherwise(rs.sampler, batch, slots)


def _requests(d: Deferred, input_batch) -> tuple[list[int], list[int]] | None:
    """The deferred rows as whole requests: ``(cu, reqs)``, ``cu`` (``[R + 1]``) offsets into the
    deferred rows and ``reqs`` the requests' indices in the batch, where they are requests' rows
    in the batch's order; else None."""
    cu_b = np.asarray(input_batch.cu_num_logits_np[: input_batch.num_reqs + 1], dtype=np.int64)
    rows = d.rows.numpy()
    want, cu, reqs = [], [0], []
    for i in range(input_batch.num_reqs):
        if cu_b[i] < cu_b[i + 1] and cu_b[i] in rows:
            want.extend(range(cu_b[i], cu_b[i + 1]))
            cu.append(len(want))
            reqs.append(i)
    return (cu, reqs) if len(want) == rows.size and bool(np.array_equal(np.asarray(want), rows)) else None


def _row_drafts(input_batch, dev_rows: torch.Tensor, cu: list[int], prefill_len: torch.Tensor):
    """``(drafts, bonus)`` of the deferred rows ``dev_rows`` (whole requests, offsets ``cu``): the
    draft each target row verifies (:func:`drafts_of`'s next entry), ``-1`` on each request's
    last row, its bonus row (``bonus``, ``[N]`` bool over the rows)."""
    following = drafts_of(input_batch, prefill_len)
    drafts = following[torch.clamp(dev_rows + 1, max=following.numel() - 1)]
    bonus = torch.zeros(dev_rows.numel(), dtype=torch.bool, device=dev_rows.device)
    bonus[torch.tensor(cu[1:], device=dev_rows.device) - 1] = True
    return drafts.masked_fill(bonus, -1), bonus


def resolve(rs, d: Deferred, logits: torch.Tensor, input_batch, draft_logits=None,
            invalid_drafts=None) -> DeferredStats:
    """Fill ``logits``' deferred rows (certified requests' rows as
    :mod:`vllm_csv.sampling.verify_v2` hands them over, the others dense) in place before V2's
    ``RejectionSampler`` verifies them (module docstring). Host syncs: the drafts' and the
    certificate's (its rounds read decisions on the host)."""
    t0 = clock.now()
    rows = d.rows
    st = DeferredStats(rows=rows.numel())
    dev = logits.device
    dev_rows = rows.to(dev)
    why = _unsupported(rs, d, input_batch, draft_logits, invalid_drafts)
    found = None if why is not None else _requests(d, input_batch)
    if why is None and found is None:
        why = "deferred rows that are not whole requests"
    certified = torch.zeros(rows.numel(), dtype=torch.bool)
    if why is None:
        cu, reqs = found
        ss = rs.sampler.sampling_states
        slot = input_batch.expanded_idx_mapping[dev_rows].long()
        pos = input_batch.positions[input_batch.logits_indices[dev_rows]].long()
        drafts, bonus = _row_drafts(input_batch, dev_rows, cu, rs.sampler.req_states.prefill_len.gpu.to(dev))
        # a placeholder draft (-1 on a target row), or one past the vocabulary (which V2 would read
        # out of its rows): its request stays dense, out of the certificate
        R = len(cu) - 1
        sizes = torch.tensor(np.diff(cu), device=dev)
        req_of = torch.repeat_interleave(torch.arange(R, device=dev), sizes)
        keep = torch.ones(R, dtype=torch.bool, device=dev)
        keep[req_of[((drafts < 0) | (drafts >= logits.shape[1])) & ~bonus]] = False
        ok = torch.zeros(R, dtype=torch.bool, device=dev)
        values = torch.empty((rows.numel(), logits.shape[1]), dtype=logits.dtype, device=dev)
        reason = ["unsupported"] * R
        scored = 0
        if bool(keep.any()):
            kept = keep[req_of]
            kr = keep.nonzero().squeeze(1)
            sub_cu = [0] + sizes[kr].cumsum(0).tolist()
            batch_req = np.asarray(reqs)[req_of[kept].cpu().numpy()]  # (each row's request in the batch)
            slot_np = slot.cpu().numpy()
            process = _processors(rs.sampler, input_batch, dev_rows[kept], batch_req, slot_np[kept.cpu().numpy()])
            min_p = ss.min_p.gpu[slot].float() if bool(np.any(ss.min_p.np[slot_np] != 0)) else None
            draft = None
            if draft_logits is not None:  # each target row's drafter logits: [slot, its local position]
                step = input_batch.expanded_local_pos[dev_rows].long().clamp(max=draft_logits.shape[1] - 1)
                draft = draft_logits[slot, step][kept]
            args = (d.hidden[kept], ss.seeds.gpu[slot[kept]].long(), pos[kept], ss.temperature.gpu[slot[kept]].float(),
                    drafts[kept], sub_cu)
            fused = fused_draw_for(d.adapter, None)
            mp = min_p[kept] if min_p is not None else None
            if fused is not None:  # the device path (CUDA's backend)
                res = verify_fused(fused, *args, process, mp, draft)
            else:
                res = certify_verification_v2(d.adapter, *args, draft, process, mp)
            ok[kr] = res.certified.to(dev)
            values[kept] = res.values.to(values.dtype)
            for j, r in enumerate(kr.tolist()):
                reason[r] = res.reason[j]
            scored = res.scored
        per_row = ok[req_of]
        reasons = [None if c else (reason[r] or "unsupported") for c, r in zip(per_row.tolist(), req_of.tolist())]
        certified = write_certified(logits, dev_rows, RowsResult(values, per_row, torch.zeros_like(rows), reasons,
                                                                 scored), st)
    finish(d, logits, dev_rows, certified, None, st, why, t0)
    return st


def verify(orig, rs, logits: torch.Tensor, input_batch, draft_logits=None, invalid_drafts=None, *a, **k):
    """The wrapped ``RejectionSampler.__call__`` (:mod:`..patches`): the step's deferred rows
    resolved (:func:`resolve`) and their account settled, then vLLM's own ``orig``."""
    d = take_handoff(rs.sampler, logits)
    if isinstance(d, Deferred):
        d.account.settle(resolve(rs, d, logits, input_batch, draft_logits, invalid_drafts))
    return orig(rs, logits, input_batch, draft_logits, invalid_drafts, *a, **k)
