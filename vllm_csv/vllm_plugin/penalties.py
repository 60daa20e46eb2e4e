"""vLLM's presence, frequency and repetition penalties on the few tokens they touch.

The sampler hook runs vLLM's own logits processors on lower and upper bounds of every deferred
row, two or three rounds a step, so each of its ``[R, V]`` passes is paid four to six times
where the dense step pays it once. The penalties are the dearest of them on the CPU
(``apply_penalties``: two ``[R, V + 1]`` bin counts and two ``torch.where`` over bool masks:
3.1 ms a call for 8 rows of 65536 tokens, 16 prompt and 20 output tokens each, on 2 cores;
0.13 ms on the 288 columns they touch), and they touch few tokens: a
token that is in neither the row's prompt nor its output gets, in vLLM 0.32
(``vllm.model_executor.layers.utils.apply_penalties``),

* repetition: ``x * s`` with ``s = where(x > 0, 1.0 / 1.0, 1.0) = 1.0``: ``x`` itself;
* frequency: ``x - f * 0`` and presence: ``x - p * 0``: ``x - (+-0)``, ``x`` itself (a zero may
  change sign; ``f, p`` are finite: vLLM checks them, and :class:`TouchedPenalties` again).

So with ``T`` the tokens of every row's prompt and output, vLLM's own ``apply_penalties`` on
the columns ``T`` only (token ids renumbered to their place in ``T``; vLLM's padding and
``-1`` placeholders to the renumbered padding), the other columns left alone, gives the same
values as the full call: each column's result depends on its own value, its row's penalties,
and its counts in the row's prompt and output, which the renumbering keeps.
"""

from __future__ import annotations

import torch

COMPACT_BELOW = 0.25  # columns touched, as a share of V, below which the compact call is used


class TouchedPenalties:
    """vLLM's penalties of one step's sampling metadata on the columns they touch.

    Built once per sampler step (the metadata is fixed for the step); :meth:`apply` is then
    called on the ``[R, V]`` tensors of processed bounds. ``usable`` is False where the compact
    call does not apply (no penalties, a non-finite penalty, or most of the vocabulary touched):
    run vLLM's own full call then."""

    def __init__(self, md, vocab_size: int):
        self.usable = False
        if md.no_penalties or md.prompt_token_ids is None:
            return
        pens = (md.presence_penalties, md.frequency_penalties, md.repetition_penalties)
        if not all(bool(torch.isfinite(p).all()) for p in pens):
            return
        from vllm.utils.torch_utils import make_tensor_with_pad

        V = vocab_size
        out = make_tensor_with_pad(md.output_token_ids, pad=V, device="cpu", dtype=torch.int64)
        prompt = md.prompt_token_ids.cpu().long()
        ids = torch.cat([prompt.flatten(), out.flatten()])
        cols = ids[(ids >= 0) & (ids < V)].unique()  # ascending
        if cols.numel() > COMPACT_BELOW * V:
            return
        n = cols.numel()
        place = torch.full((V + 1,), n, dtype=torch.int64)  # token id -> its column in T; else n (padding)
        place[cols] = torch.arange(n)
        # vLLM pads with V and (async scheduling) leaves -1 placeholders, which it maps to V
        self.prompt = place[prompt.clamp(-1, V)]  # (-1 indexes place[V] = padding)
        self.output = place[out.clamp(-1, V)]
        self.cols, self.pens = cols, pens
        self.usable = True

    def apply(self, *xs: torch.Tensor) -> None:
        """Each of ``xs`` (``[R, V]`` float32, the step's rows: a row's lower and upper bounds)
        after vLLM's penalties, in place; one call of vLLM's on their touched columns stacked
        (each row's result depends on that row alone: its values, penalties and counts)."""
        from vllm.model_executor.layers.utils import apply_penalties

        dev, n = xs[0].device, len(xs)
        cols = self.cols.to(dev)
        sub = apply_penalties(torch.cat([x[:, cols] for x in xs]), self.prompt.to(dev).repeat(n, 1),
                              self.output.to(dev).repeat(n, 1), *(p.to(dev).repeat(n) for p in self.pens))
        for x, part in zip(xs, sub.chunk(n)):
            x[:, cols] = part
