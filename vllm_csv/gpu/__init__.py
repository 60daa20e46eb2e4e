"""The fused certified step on CUDA (Triton): five kernels, each in its own module beside its
torch reference and its custom op, and the step that runs them (:class:`.step.FusedStep`, no
host sync, fixed shapes):

1. :mod:`.quantize` -- :func:`~.quantize.quantize_rows` ``[B]`` programs: ``h`` -> two int8
   codes (``h ~ t p + t2 p2``, the second the first's residual), residual norm ``e >= ||h - t p -
   t2 p2||``, ``||h||`` rounded up, and which rows may be certified.
2. :mod:`.screen` -- :func:`~.screen.screen_block_max` ``[ceil(V / BV)]`` programs: the exact
   int8 GEMM ``<q_i, p_b>`` on tensor cores, its epilogue every token's upper and lower bound
   of its dense logit (the screen's center ``y = fl(fl(fl(acc) t_b) s_i) (+ b_i)`` widened by
   the token's own radius and norm and the row's activation error) and the largest of each per
   block of ``SUB`` tokens. It writes two ``[B, ceil(V / SUB)]`` arrays, never ``[B, V]``. Its
   tile is tuned once per shape there.
3. :mod:`.select` -- :func:`~.select.select_blocks` ``[B]`` programs: ``tau``, the k-th largest
   block lower bound (a lower bound of the row's k-th largest logit), and the candidate blocks
   (upper bound ``>= tau``), compacted in ascending order into a fixed ``[B, CAP]`` list; more
   than ``CAP`` blocks: the row is not ``live`` (reason ``budget``); ``outside``, the largest
   upper bound of the other blocks.
4. :mod:`.score` -- :func:`~.score.score_blocks` ``[B, CAP, SUB / SCORE_TOKENS]`` programs: every
   token of a candidate block scored in float64 with the dense engine's interval
   (:func:`vllm_csv.head.bounds.score`): the rounded ends ``lower <= zt <= upper`` and
   ``z`` (the dense bits where the ends agree).
5. :mod:`.certify` -- :func:`~.certify.certify_rows` ``[B]`` programs: the top-k certificate of
   :func:`vllm_csv.ops.step.certify_topk_ref` per row against ``outside_high = outside`` and,
   for ``k = 1`` rows, the replayed tie (lowest id holding a value known bit for bit). Writes
   the top-k ids (descending, ties by the lowest id), their values and the row's outcome code
   (:data:`vllm_csv.ops.step.REASONS`).

Beside the five, for vLLM V2's temperature rows: :mod:`.draw_bounds` -- every block's noisy
bound (``[B, V / 1024]`` programs) and the candidate blocks of largest bound (``[B]``); then
:mod:`.gumbel_draw` (with the overview) -- V2's Gumbel draw certified from the candidates' exact
intervals, their noise replayed per token (``[B]``); :mod:`.gumbel_jit` holds the replica of V2's
noise and temperature they share. For V2's speculative verification: :mod:`.philox` -- each row's
verification uniform (``tl.rand``, ``[N / 256]`` programs). :meth:`.step.FusedStep.draw_v2` runs them around the step's
quantize, screen and scoring kernels.

:mod:`.common` holds what they share: the block layout (``SUB``, ``CAP``), whether Triton is
here, the dispatch between a kernel and its reference, the launch options and the model-dtype
bit helpers.

Why blocks and not tokens past the GEMM: the k-th largest lower bound, hence the threshold,
is known only once every block has been read, so the GEMM cannot pick tokens itself; a
token of a block whose upper bound is below ``tau`` is below the row's k-th largest logit,
and every token of a block that reaches it is scored exactly, so the certificate of each row
holds with ``outside_high = outside < tau`` on its own candidate blocks (not the batch's
union, as on the CPU). Why each token's own bounds: the CPU search
(:func:`vllm_csv.head.selection.select_two_sided`) widens every token by the vocabulary's
largest radius and norm; on heads trained on a GPU that left a third to a half of the rows
more than ``CAP`` candidate blocks (``benchmarks/gpu_learned.py``, H200).

Each op is a ``torch.library`` custom op (``torch.ops.vllm_csv_gpu.<kernel>``) with a fake
implementation; ``<kernel>_ref`` is the same math in torch, the tests' oracle
(``tests/test_gpu_kernels.py``), and ``<kernel>_triton`` its launcher. The kernels run under
``TRITON_INTERPRET=1`` on the CPU (CI) and compiled on CUDA. Importing this package (hence any
of its modules) imports every kernel module, so every op is registered, once, whichever
module is imported first.
"""

from . import certify, draw_bounds, gumbel_draw, philox, quantize, score, screen, select  # noqa: F401 - registers every op
