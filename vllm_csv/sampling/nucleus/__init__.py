"""vLLM's min-p, top-k and top-p masks on bounds: what the draw's inputs may be after the masks.

Input: ``ylo <= y <= yhi`` (fp32, ``[R, V]``, ``-inf`` for masked tokens) on the values after
temperature. Output: the same bounds after the mask, sound for every ``y`` in the box:
a token certainly dropped gets ``-inf`` on both sides, a token certainly kept keeps its
bounds, an undecided one gets ``ylo = -inf`` (it may be dropped) and keeps ``yhi``.
The draw certificate (:mod:`~vllm_csv.sampling.certificate`) then only certifies a winner that
is certainly kept and beats every token that may be kept.

One module per mask, each with its proof in its docstring, in vLLM's order:

* :mod:`.min_p` -- ``MinPLogitsProcessor``: per-row thresholds with a margin over vLLM's fp32
  evaluation; also min-p on part of a row (tensor parallelism);
* :mod:`.top_k` -- ``apply_top_k_only``: the ``k``-th largest lower and upper bounds, no margin;
* :mod:`.top_p` -- ``apply_top_k_top_p_pytorch``'s top-p: the four masses of each token, the
  relative rounding margin, the tail dropped as a block, underflow; every token decided;
* :mod:`.top_p_queries` -- top-p deciding chosen tokens only (the draw's likely winners and
  contenders), from a per-row list of the highest upper bounds that later rounds narrow;
* :mod:`.chain` -- the three in vLLM's order on chosen rows (what the rounds of
  :mod:`~vllm_csv.sampling.rounds` apply), and whether any is on.

The outside blocks (:class:`~vllm_csv.sampling.outside.Outside`, tensor parallelism: tokens
known through per-row, per-block summaries only, ``-inf`` on both sides in ``ylo, yhi``):
:func:`~.min_p.min_p_bounds` and :func:`~.top_p.top_p_bounds` take them as one more argument
(each module's docstring, "the outside blocks"); top-k does not (block tokens are not counted).
Block tokens are never certainly kept (their lower bounds are not known one by one).
"""
