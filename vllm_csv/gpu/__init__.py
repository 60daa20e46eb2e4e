"""The fused certified step on CUDA (Triton): five kernels, each in its own module beside its
torch reference and its custom op, and the step that runs them (:class:`.step.FusedStep`, no
host sync, fixed shapes):

1. :mod:`.quantize` -- :func:`~.quantize.quantize_rows` ``[B]`` programs: ``h`` -> int8 ``p``,
   scale ``t``, residual norm ``e >= ||h - t p||``, ``||h||`` rounded up, and which rows may be
   certified.
2. :mod:`.screen` -- :func:`~.screen.screen_block_max` ``[ceil(V / BV)]`` programs: the exact
   int8 GEMM ``<q_i, p_b>`` on tensor cores, its epilogue the screen's center ``y =
   fl(fl(fl(acc) t_b) s_i) (+ b_i)`` and the maximum of each block of ``SUB`` tokens. It writes
   ``[B, ceil(V / SUB)]`` maxima, never ``[B, V]``. Its tile is tuned once per shape there.
3. :mod:`.select` -- :func:`~.select.select_blocks` ``[B]`` programs: the threshold of
   :func:`vllm_csv.ops.select.select_candidates_ref` from the block maxima (``y_1``, the
   k-th largest ``y_k``, ``tau``, ``thr``) and the candidate blocks (maximum ``>= thr``),
   compacted in ascending order into a fixed ``[B, CAP]`` list; more than ``CAP`` blocks: the
   row is not ``live`` (reason ``budget``).
4. :mod:`.score` -- :func:`~.score.score_blocks` ``[B, CAP, SUB / SCORE_TOKENS]`` programs: every
   token of a candidate block scored in float64 with the dense engine's interval
   (:func:`vllm_csv.head.bounds.score`): the rounded ends ``lower <= zt <= upper`` and
   ``z`` (the dense bits where the ends agree).
5. :mod:`.certify` -- :func:`~.certify.certify_rows` ``[B]`` programs: the top-k certificate of
   :func:`vllm_csv.ops.step.certify_topk_ref` per row against ``outside_high = tau`` and,
   for ``k = 1`` rows, the replayed tie (lowest id holding a value known bit for bit). Writes
   the top-k ids (descending, ties by the lowest id), their values and the row's outcome code
   (:data:`vllm_csv.ops.step.REASONS`).

Beside the five, for vLLM V2's temperature rows: :mod:`.draw_bounds` -- every block's noisy
bound (``[B, V / 1024]`` programs) and the candidate blocks of largest bound (``[B]``); then
:mod:`.gumbel_draw` (with the overview) -- V2's Gumbel draw certified from the candidates' exact
intervals, their noise replayed per token (``[B]``); :mod:`.gumbel_jit` holds the replica of V2's
noise and temperature they share. :meth:`.step.FusedStep.draw_v2` runs them around the step's
quantize, screen and scoring kernels.

:mod:`.common` holds what they share: the block layout (``SUB``, ``CAP``), whether Triton is
here, the dispatch between a kernel and its reference, the launch options and the model-dtype
bit helpers.

Why blocks and not tokens past the GEMM: the k-th largest screen value, hence the threshold,
is known only once every block has been read, so the GEMM cannot pick tokens itself; a
token of a block below the threshold has ``hi < tau`` (the search's argument,
:func:`vllm_csv.head.selection.select_two_sided`), and every token of a block that
reaches it is scored exactly, so the certificate of each row holds with ``outside_high =
tau`` on its own candidate blocks (not the batch's union, as on the CPU).

Each op is a ``torch.library`` custom op (``torch.ops.vllm_csv_gpu.<kernel>``) with a fake
implementation; ``<kernel>_ref`` is the same math in torch, the tests' oracle
(``tests/test_gpu_kernels.py``), and ``<kernel>_triton`` its launcher. The kernels run under
``TRITON_INTERPRET=1`` on the CPU (CI) and compiled on CUDA. Importing this package (hence any
of its modules) imports every kernel module, so every op is registered, once, whichever
module is imported first.
"""

from . import certify, draw_bounds, gumbel_draw, quantize, score, screen, select  # noqa: F401 - registers every op
