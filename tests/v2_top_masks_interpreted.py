"""vLLM's top-k / top-p Triton kernels (``vllm/v1/sample/ops/topk_topp_triton.py``, Qrita) run by
Triton's interpreter on the CPU: a helper of test_v2_top_masks.py, run in a subprocess
(``python v2_top_masks_interpreted.py CASE OUT``).

The module is vLLM's file with one change: ``row_id.to(tl.int64)`` reads ``row_id +
tl.zeros((), tl.int64)`` (the interpreter's ``tl.range`` yields Python ints, which have no
``.to``; on a GPU both are the same int64 row index). Both paths run: the kernel every batch
takes (``apply_top_k_top_p_triton``; its CUDA-only split of top-p-only rows off) and the split
pipeline itself (``_apply_topp_split``, which vLLM runs on CUDA for batches of at most 64 rows,
called directly here with 132 programs' worth of splits, an H100's SM count).

CASE (a ``torch.save``'d dict): ``x [R, V]`` float32, ``k [R]`` int32 or None, ``p [R]`` float32
or None, ``split`` (run the split pipeline on the rows instead; ``k`` None). OUT gets ``y``,
the masked rows, and ``file``, the vLLM file that ran."""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"


def load():
    import importlib.util
    import pathlib
    import tempfile

    import triton
    import triton.language as tl
    import vllm.triton_utils as tu

    tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True  # (vLLM hands out placeholders on a CPU platform)
    spec = importlib.util.find_spec("vllm.v1.sample.ops.topk_topp_triton")
    src = pathlib.Path(spec.origin).read_text()
    assert src.count("row_id.to(tl.int64)") == 1, spec.origin
    out = pathlib.Path(tempfile.mkdtemp()) / "topk_topp_triton.py"
    out.write_text(src.replace("row_id.to(tl.int64)", "(row_id + tl.zeros((), tl.int64))"))
    mod_spec = importlib.util.spec_from_file_location("vllm_topk_topp_triton", out)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    mod.num_compute_units = lambda index=None: 132
    return mod, spec.origin


def run(c: dict) -> dict:
    mod, origin = load()
    y = c["x"].clone()
    if c.get("split"):
        mod._apply_topp_split(y, None, c["p"], float("-inf"), 132)
    else:
        y = mod.apply_top_k_top_p_triton(y, c["k"], c["p"])
    return {"y": y, "file": origin}


if __name__ == "__main__":
    import torch

    torch.save(run(torch.load(sys.argv[1], weights_only=False)), sys.argv[2])
