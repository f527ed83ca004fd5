"""The host's row-write fusion (``backends/onnx/host/row_write.py``): a masked row overwrite
``Where(hit, row, t)`` becomes ``ScatterElements``, bit for bit the same data for any mask (no
true slot, one, several; NaN and inf in the tensor), and forms it must not take stay. Through
``torch.compile``, a static-cache write (the ``kv_cache_update`` rule's ``where``) fuses and
matches eager: the slots it keeps exactly (a copy), the written row at float32's rtol 1e-5,
atol 1e-5 (it comes out of a Gemm, which may round differently from torch's)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

import fxpass
from fxpass.backends.onnx.host.row_write import fuse_row_writes

H, S, D = 2, 6, 3


def _model(row_shape=(1, H, 1, D), hit_shape=(1, 1, S, 1), outputs=1):
    """Where(hit, row, t) ``outputs`` times with the same mask, each of a row of its own."""
    inputs = [helper.make_tensor_value_info("hit", TensorProto.BOOL, list(hit_shape)),
              helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, H, S, D])]
    nodes, outs = [], []
    for k in range(outputs):
        inputs.append(helper.make_tensor_value_info(f"row{k}", TensorProto.FLOAT, list(row_shape)))
        nodes.append(helper.make_node("Where", ["hit", f"row{k}", "t"], [f"out{k}"]))
        outs.append(helper.make_tensor_value_info(f"out{k}", TensorProto.FLOAT, [1, H, S, D]))
    graph = helper.make_graph(nodes, "g", inputs, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def _run(proto, feeds):
    import onnxruntime as ort

    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _fused(proto):
    model = ir.from_proto(proto)
    count = fuse_row_writes(model)
    return ir.to_proto(model), count, [n.op_type for n in model.graph]


@pytest.mark.parametrize("slots", [[], [0], [4], [1, 5], list(range(S))],
                         ids=["none", "first", "one", "two", "all"])
def test_any_mask_writes_what_where_writes(slots):
    proto = _model(outputs=2)
    fused, count, ops = _fused(proto)
    assert count == 2 and "Where" not in ops and ops.count("NonZero") == 1  # indices shared
    rng = np.random.default_rng(0)
    hit = np.zeros((1, 1, S, 1), bool)
    hit[0, 0, slots, 0] = True
    t = rng.standard_normal((1, H, S, D)).astype(np.float32)
    t[0, 0, 2, 1], t[0, 1, 3, 0] = np.nan, -np.inf  # kept where not overwritten
    feeds = {"hit": hit, "t": t,
             "row0": rng.standard_normal((1, H, 1, D)).astype(np.float32),
             "row1": np.full((1, H, 1, D), np.inf, np.float32)}
    for before, after in zip(_run(proto, feeds), _run(fused, feeds), strict=True):
        np.testing.assert_array_equal(after, before)  # NaN == NaN for this assert


@pytest.mark.parametrize("row_shape,hit_shape", [
    ((1, 1, 1, D), (1, 1, S, 1)),   # the row broadcasts over heads too: not one row per slot
    ((1, H, 1, D), (1, H, S, 1)),   # the mask varies on two axes
    ((1, H, S, D), (1, 1, S, 1)),   # a whole tensor, not a row
], ids=["row-broadcast", "mask-2-axes", "not-a-row"])
def test_other_wheres_are_left_alone(row_shape, hit_shape):
    _, count, ops = _fused(_model(row_shape=row_shape, hit_shape=hit_shape))
    assert count == 0 and ops == ["Where"]


@pytest.mark.parametrize("pos", [0, 7])
def test_a_static_cache_write_fuses_and_matches_eager(pos, opts):
    w = torch.randn(8, 8) / 3

    def step(cache, x, p):  # a decode step's key write into a static cache, then a read
        new = torch.nn.functional.linear(x, w).view(1, 2, 1, 4)
        cache.index_copy_(2, p, new)
        return cache * 2.0

    cache = torch.randn(1, 2, 8, 4)
    cache[0, 1, 5, 2] = float("nan")
    x, p = torch.randn(1, 8), torch.tensor([pos])
    expected_cache = cache.clone()
    expected = step(expected_cache, x, p)
    before = len(fxpass.compile_reports())
    compiled = torch.compile(step, backend="fxpass_bpu", dynamic=False,
                             options={**opts, "strict": True})
    got_cache = cache.clone()
    got = compiled(got_cache, x, p)
    (report,) = fxpass.compile_reports()[before:]
    assert report.regions and all(r.fallback is None for r in report.regions), str(report)
    assert sum(r.fusions.get("row_write", 0) for r in report.regions) == 1, str(report)
    kept = torch.arange(8) != pos
    for g, e in ((got, expected), (got_cache, expected_cache)):
        torch.testing.assert_close(g[:, :, kept], e[:, :, kept], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("shape,axis", [((S, 3), 0), ((2, 3, S), 2), ((2, S, 1, 3), 1)],
                         ids=["first-axis", "last-axis", "middle-axis"])
def test_rows_on_any_axis(shape, axis):
    hit_shape = [1] * len(shape)
    hit_shape[axis] = S
    row_shape = list(shape)
    row_shape[axis] = 1
    inputs = [helper.make_tensor_value_info("hit", TensorProto.BOOL, hit_shape),
              helper.make_tensor_value_info("t", TensorProto.FLOAT, list(shape)),
              helper.make_tensor_value_info("row", TensorProto.FLOAT, row_shape)]
    graph = helper.make_graph([helper.make_node("Where", ["hit", "row", "t"], ["out"])], "g",
                              inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT,
                                                                     list(shape))])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    proto.ir_version = 10
    fused, count, _ = _fused(proto)
    assert count == 1
    rng = np.random.default_rng(2)
    for slots in ([3], [0, 5]):
        hit = np.zeros(hit_shape, bool)
        hit.reshape(-1)[slots] = True
        feeds = {"hit": hit, "t": rng.standard_normal(shape).astype(np.float32),
                 "row": rng.standard_normal(row_shape).astype(np.float32)}
        np.testing.assert_array_equal(_run(fused, feeds)[0], _run(proto, feeds)[0])
