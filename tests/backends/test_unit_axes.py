"""The host's unit-axes fusion (``backends/onnx/host/unit_axes.py``): a transpose that moves
only size-1 axes becomes a reshape, reshape chains become one, identity reshapes go; every
output is bit for bit onnxruntime's answer on the unfused model, and what must stay stays."""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

import fxpass
from fxpass.backends.onnx.host.unit_axes import fuse_unit_axes


def _run(proto, feeds):
    import onnxruntime as ort

    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _model(nodes, inputs, outputs, values=(), inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits),
                              value_info=list(values))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def _info(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _fused(proto):
    model = ir.from_proto(proto)
    count = fuse_unit_axes(model)
    return ir.to_proto(model), count, [n.op_type for n in model.graph]


SHAPES = [(1, 4, 1, 3), (2, 1, 5), (1, 1, 1), (3, 1, 1, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_permutation_rewritten_exactly_when_it_moves_no_data(shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    for perm in itertools.permutations(range(len(shape))):
        out = tuple(shape[p] for p in perm)
        proto = _model([helper.make_node("Transpose", ["x"], ["t"], perm=list(perm)),
                        helper.make_node("Neg", ["t"], ["y"])],
                       [_info("x", shape)], [_info("y", out)], [_info("t", out)])
        fused, count, ops = _fused(proto)
        free = [a for a in perm if shape[a] != 1] == sorted(a for a in perm if shape[a] != 1)
        # a transpose to the same shape is a reshape to it, which then goes too
        want = (["Neg"] if out == shape else ["Reshape", "Neg"]) if free else ["Transpose", "Neg"]
        assert ops == want and count == 3 - len(want) - (not free), (shape, perm)
        (got,) = _run(fused, {"x": x})
        np.testing.assert_array_equal(got, -np.transpose(x, perm))  # bit for bit


def _shape(name, dims):
    return helper.make_tensor(name, TensorProto.INT64, [len(dims)], list(dims))


def test_chains_collapse_identities_go_and_outputs_keep_their_names():
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Reshape", ["x", "s1"], ["a"]),       # [6, 4]
        helper.make_node("Reshape", ["a", "s2"], ["b"]),       # [24] (-1)
        helper.make_node("Reshape", ["b", "s3"], ["c"]),       # [2, 12]
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Reshape", ["r", "s3"], ["same"]),    # identity: dropped
        helper.make_node("Neg", ["same"], ["y"]),
        helper.make_node("Reshape", ["y", "s3"], ["out"]),     # identity, but an output
        helper.make_node("Transpose", ["a"], ["tout"], perm=[1, 0]),  # moves data: stays
    ]
    inits = [_shape("s1", [6, 4]), _shape("s2", [-1]), _shape("s3", [2, 12])]
    values = [_info("a", (6, 4)), _info("b", (24,)), _info("c", (2, 12)), _info("r", (2, 12)),
              _info("same", (2, 12)), _info("y", (2, 12))]
    proto = _model(nodes, [_info("x", (2, 3, 4))], [_info("out", (2, 12)), _info("tout", (4, 6))],
                   values, inits)
    fused, count, ops = _fused(proto)
    # b folds into c (x -> c), "same" goes; a stays for the transpose, "out" is an output
    assert count == 2 and ops == ["Reshape", "Reshape", "Relu", "Neg", "Reshape", "Transpose"]
    assert [o.name for o in fused.graph.output] == ["out", "tout"]
    want = _run(proto, {"x": x})
    for g, w in zip(_run(fused, {"x": x}), want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_a_transposed_graph_output_keeps_its_name():
    x = np.arange(6, dtype=np.float32).reshape(1, 6, 1)
    proto = _model([helper.make_node("Transpose", ["x"], ["y"], perm=[2, 0, 1])],
                   [_info("x", (1, 6, 1))], [_info("y", (1, 1, 6))])
    fused, count, ops = _fused(proto)
    assert count == 1 and ops == ["Reshape"] and fused.graph.output[0].name == "y"
    np.testing.assert_array_equal(_run(fused, {"x": x})[0], x.reshape(1, 1, 6))


def test_views_around_a_matmul_by_a_weight_go_and_the_values_stay():
    """[1, 1, K] -> [1, K] -> MatMul(W) -> Split -> [1, 1, n] each: the views go, the
    product takes [1, 1, K] as it is, the split cuts its last axis; bit for bit the same."""
    k, n = 8, 6
    w = np.random.default_rng(2).standard_normal((k, n)).astype(np.float32)
    nodes = [helper.make_node("Reshape", ["x", "s2"], ["flat"]),
             helper.make_node("MatMul", ["flat", "w"], ["mm"]),
             helper.make_node("Split", ["mm", "sizes"], ["a", "b"], axis=1),
             helper.make_node("Reshape", ["a", "sa"], ["ya"]),
             helper.make_node("Reshape", ["b", "sb"], ["yb"]),
             helper.make_node("Concat", ["ya", "yb"], ["y"], axis=-1)]
    inits = [_shape("s2", [1, k]), _shape("sa", [1, 1, 2]), _shape("sb", [1, 1, 4]),
             helper.make_tensor("sizes", TensorProto.INT64, [2], [2, 4]),
             helper.make_tensor("w", TensorProto.FLOAT, [k, n], w.reshape(-1).tolist())]
    values = [_info("flat", (1, k)), _info("mm", (1, n)), _info("a", (1, 2)), _info("b", (1, 4)),
              _info("ya", (1, 1, 2)), _info("yb", (1, 1, 4))]
    proto = _model(nodes, [_info("x", (1, 1, k))], [_info("y", (1, 1, n))], values, inits)
    fused, count, ops = _fused(proto)
    assert ops == ["MatMul", "Split", "Concat"] and count == 3, ops  # the view in, both out
    x = np.random.default_rng(3).standard_normal((1, 1, k)).astype(np.float32)
    for g, want in zip(_run(fused, {"x": x}), _run(proto, {"x": x}), strict=True):
        np.testing.assert_array_equal(g, want)


def test_a_matmul_read_by_anything_but_views_keeps_its_view():
    nodes = [helper.make_node("Reshape", ["x", "s2"], ["flat"]),
             helper.make_node("MatMul", ["flat", "w"], ["mm"]),
             helper.make_node("Relu", ["mm"], ["y"])]
    inits = [_shape("s2", [1, 4]),
             helper.make_tensor("w", TensorProto.FLOAT, [4, 3], [0.5] * 12)]
    proto = _model(nodes, [_info("x", (1, 1, 4))], [_info("y", (1, 3))],
                   [_info("flat", (1, 4)), _info("mm", (1, 3))], inits)
    _, count, ops = _fused(proto)
    assert count == 0 and ops == ["Reshape", "MatMul", "Relu"]


def test_a_decode_step_fires_it_and_matches_eager(opts):
    """A single-token attention block through fxpass_ort: its unit-axis transposes go, and the
    answer is eager's (float32: rtol 1e-5, atol 1e-5; the matmuls may round differently)."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(32, 32)
            self.o = torch.nn.Linear(32, 32)

        def forward(self, x):
            q = self.q(x).view(1, 1, 4, 8).transpose(1, 2)      # [1, 4, 1, 8]: no data moves
            return self.o(torch.relu(q).transpose(1, 2).reshape(1, 1, 32))

    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(1, 1, 32)
    before = len(fxpass.compile_reports())
    compiled = torch.compile(model, backend="fxpass_ort", options={**opts, "strict": True})
    with torch.no_grad():
        got, want = compiled(x), model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (report,) = fxpass.compile_reports()[before:]
    assert sum(r.fusions.get("unit_axes", 0) for r in report.regions) >= 2, str(report)


def test_a_chain_back_to_its_own_shape_goes_whole():
    """Reshape(Reshape(x, [6, 4]), [2, 3, 4]) is x: both go, and the values stay."""
    x = np.random.default_rng(2).standard_normal((2, 3, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Reshape", ["r", "s1"], ["a"]),       # [6, 4]
        helper.make_node("Reshape", ["a", "s2"], ["b"]),       # [2, 3, 4]: r's own shape
        helper.make_node("Neg", ["b"], ["y"]),
    ]
    inits = [_shape("s1", [6, 4]), _shape("s2", [2, 3, 4])]
    values = [_info("r", (2, 3, 4)), _info("a", (6, 4)), _info("b", (2, 3, 4))]
    proto = _model(nodes, [_info("x", (2, 3, 4))], [_info("y", (2, 3, 4))], values, inits)
    fused, count, ops = _fused(proto)
    assert count == 2 and ops == ["Relu", "Neg"]
    np.testing.assert_array_equal(_run(fused, {"x": x})[0], _run(proto, {"x": x})[0])
