"""Exact sampling on the certified path: vLLM's Gumbel-max draws, replayed per token.

vLLM's V1 runner's draw (``fused_gumbel_argmax`` after vLLM's min-p, top-k and top-p; with
tensor parallelism too):

* :mod:`.gumbel` -- the noise ``fused_gumbel_argmax`` adds, for any token of a row.
* :mod:`.certificate` -- which token the draw picks, certified from bounds on every token's
  sampler input (pure math, no vLLM).
* :mod:`.nucleus` -- vLLM's min-p, top-k and top-p keep-drop decisions from the same bounds, one
  module per mask (:mod:`.nucleus.min_p`, :mod:`.nucleus.top_k`, :mod:`.nucleus.top_p`,
  :mod:`.nucleus.top_p_queries`), chained in vLLM's order by :mod:`.nucleus.chain`.
* :mod:`.rows` -- the entry (:func:`~.rows.certify_rows`): the top-k rows' path first, then the
  rounds for the rest.
* :mod:`.top_k_rows` -- rows with a top-k (a min-p may come before it, a top-p after it), certified on their
  highest upper bounds alone (no rounds), before the loop.
* :mod:`.rounds` -- the loop: bounds, vLLM's processors and masks on them, certificate, exact
  scoring of the contenders, repeated.
* :mod:`.outside` and :mod:`.sharded_rows` -- the same under tensor parallelism (tokens of other
  ranks known through block summaries).

vLLM's Model Runner V2's draw (CUDA; the counterparts of :mod:`.gumbel` with :mod:`.certificate`, and
of :mod:`.rows`):

* :mod:`.gumbel_v2` -- the V2 runner's Gumbel noise, replayed, its temperature and min-p on
  bounds, and its draw certificate; tested against vLLM's own Triton functions (by Triton's
  interpreter on the CPU, compiled on a GPU where one is lent);
* :mod:`.rows_v2` -- the V2 loop for plain temperature sampling (bounds, temperature, draw
  certificate, exact scoring of the contenders).

Shared by both:

* :mod:`.scoring` -- what every loop shares: the screen's bounds (:func:`~.scoring.screen`), the
  columns to score next within the budget (:func:`~.scoring.next_columns`).
* :mod:`.types` -- the loops' records: the state they tighten (:class:`~.types.Screened`), their
  result (:class:`~.types.RowsResult`).
* :mod:`.head_adapter` -- the only place that calls the certified head's internals; it scores
  chosen columns into a loop's state (:meth:`~.head_adapter.HeadAdapter.score_columns`).
"""
