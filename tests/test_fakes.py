"""The CPU kernels' fake implementations, declared beside their ops (:func:`vllm_csv.ops.build.fake`),
and what the CPU offers them (:func:`vllm_csv.ops.build.cpu_supports`)."""

from __future__ import annotations

import importlib

import pytest
import torch

from vllm_csv.ops import build

pytestmark = pytest.mark.skipif(not build.kernels_available(), reason="CPU kernels not built here (no compiler)")

# every op with a fake implementation (the others: the *_supported queries, set_prefetch_ahead,
# the int4 GEMM and draw_contenders, which no traced code calls)
FAKES = {"prepare_rows", "abs_max_rows", "outlier_rows", "interval_rows", "quantize_act7", "select_candidates",
         "score_intervals", "certify_topk", "finish_selection", "pack_int8_vnni", "int8_vnni_linear",
         "int8_amx_linear", "int8_avx2_linear", "noise_candidates", "noise_bits", "row_stats", "pack_live", "min_p_cut", "top_k_cut",
         "top_p_sums", "unlisted_masses", "row_topk", "flat_nonzero", "neg_inf_rows"}


def test_each_source_has_its_module_and_every_fake_is_registered():
    assert [f.name for f in build.SOURCES] == list(build.KERNELS)
    for module in build.KERNELS.values():
        importlib.import_module(module)
    assert set(build._fakes) == FAKES
    assert build._state["fakes"] == FAKES  # (registered once the kernels loaded)


@pytest.mark.parametrize("B,V,d", [(1, 65536, 1024), (8, 4099, 100)])
def test_fakes_trace_the_kernels_shapes(B, V, d):
    """The fakes give the kernels' shapes and dtypes, on real and odd shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vllm_csv.ops import bools, masks, rows, topk

    h = torch.randn(B, d, dtype=torch.bfloat16)
    y = torch.randn(B, V)
    real = (rows.prepare_rows(h, True), rows.quantize_act7(h.float(), 2.0**-10, 1.0), rows.abs_max_rows(y),
            topk.row_topk(y, 5), masks.min_p_cut(y, y, y[:, 0], y[:, 0]), bools.neg_inf_rows(y.bfloat16()))
    K = torch.ops.vllm_csv_cpu
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = (K.prepare_rows(h, True), K.quantize_act7(h.float(), 2.0**-10, 1.0), K.abs_max_rows(y),
                K.row_topk(y, 5), K.min_p_cut(y, y, y[:, 0], y[:, 0]), K.neg_inf_rows(y.bfloat16()))
    for r, f in zip(torch.utils._pytree.tree_leaves(real), torch.utils._pytree.tree_leaves(fake)):
        if isinstance(r, torch.Tensor):
            assert (f.shape, f.dtype) == (r.shape, r.dtype)


def test_cpu_supports_asks_the_kernels():
    ops = build.load_ops()
    for feature, op in build.FEATURES.items():
        assert build.cpu_supports(feature) is bool(getattr(ops, op)())
    with pytest.raises(KeyError):
        build.cpu_supports("avx9000")
