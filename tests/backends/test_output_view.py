"""The host's output-view pass (``backends/onnx/host/output_view.py``): a region output that is a
``Reshape`` leaves onnxruntime unreshaped (no copy) and ``RegionCall`` views it back.

End to end: the outputs keep eager's shapes and values (float32: rtol 1e-5, atol 1e-5). On
the ONNX level: the rewritten model computes the same data as the original (also when two
outputs read one value), and outputs the pass must not touch (a graph input, a dynamic
shape) stay."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

import fxpass
from fxpass.backends.onnx.host.output_view import output_views


def _compile(fn, *args, opts):
    before = len(fxpass.compile_reports())
    got = torch.compile(fn, backend="fxpass_bpu", dynamic=False,
                        options={**opts, "strict": True})(*args)
    (report,) = fxpass.compile_reports()[before:]
    assert report.regions and all(r.fallback is None for r in report.regions), str(report)
    return got, sum(r.fusions.get("output_view", 0) for r in report.regions)


@pytest.mark.parametrize("tokens", [1, 6])
def test_logits_leave_unreshaped_and_match_eager(tokens, opts):
    w1, w2 = torch.randn(16, 32) / 4, torch.randn(40, 16) / 4

    def fn(x):  # a decoder's tail: [B, T, H] -> Gemm on [B*T, H] -> [B, T, vocab]
        h = torch.nn.functional.linear(x, w1)  # an output, and read on (a Reshape kept)
        return torch.nn.functional.linear(h.relu(), w2), h

    x = torch.randn(1, tokens, 32)
    (logits, h), views = _compile(fn, x, opts=opts)
    e_logits, e_h = fn(x)
    assert views == 2  # both outputs are Gemm results reshaped to 3-D
    for g, e in ((logits, e_logits), (h, e_h)):
        assert g.shape == e.shape and g.is_contiguous()
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_host_fusions_off_keeps_the_reshape(opts):
    w = torch.randn(24, 8)

    def fn(x):
        return torch.nn.functional.linear(x, w)

    x = torch.randn(1, 3, 8)
    got, views = _compile(fn, x, opts={**opts, "host_fusions": False})
    assert views == 0
    torch.testing.assert_close(got, fn(x), rtol=1e-5, atol=1e-5)


def _model(outputs, reshape_input="mm", shape=(2, 3, 4)):
    """x[6, 4] @ w -> mm[6, 4]; outputs named out0.. are Identity(Reshape(<input>))."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype=np.float32).ravel())
    s = helper.make_tensor("s", TensorProto.INT64, [3], list(shape))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"])]
    outs = []
    for k, kind in enumerate(outputs):
        if kind == "reshape":
            nodes += [helper.make_node("Reshape", [reshape_input, "s"], [f"r{k}"]),
                      helper.make_node("Identity", [f"r{k}"], [f"out{k}"])]
            outs.append(helper.make_tensor_value_info(f"out{k}", TensorProto.FLOAT, shape))
        else:  # the matmul itself, already an output
            nodes.append(helper.make_node("Identity", ["mm"], [f"out{k}"]))
            outs.append(helper.make_tensor_value_info(f"out{k}", TensorProto.FLOAT, [6, 4]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 4])], outs, [w, s])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def _run(proto, x):
    import onnxruntime as ort

    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def test_rewritten_model_computes_the_same_data():
    proto = _model(["reshape"])
    model = ir.from_proto(proto)
    assert output_views(model) == 1
    out = model.graph.outputs[0]
    assert out.name == "out0" and out.producer().op_type == "MatMul"
    x = np.random.default_rng(0).standard_normal((6, 4), dtype=np.float32)
    (before,) = _run(proto, x)
    (after,) = _run(ir.to_proto(model), x)
    assert after.shape == (6, 4) and before.shape == (2, 3, 4)
    np.testing.assert_array_equal(after.reshape(before.shape), before)


@pytest.mark.parametrize("outputs", [["reshape", "reshape"], ["mm", "reshape"]])
def test_data_read_by_two_outputs(outputs):
    """One value can be one graph output: viewed twice, the second view keeps its Reshape;
    an output already (through the lowering's Identity), its view keeps its Reshape too, else
    the cleanup would merge the two outputs into one buffer."""
    proto = _model(outputs)
    model = ir.from_proto(proto)
    assert output_views(model) == (1 if outputs[0] == "reshape" else 0)
    assert len({id(o) for o in model.graph.outputs}) == len(outputs)
    x = np.random.default_rng(1).standard_normal((6, 4), dtype=np.float32)
    for before, after in zip(_run(proto, x), _run(ir.to_proto(model), x), strict=True):
        np.testing.assert_array_equal(after.reshape(before.shape), before)


@pytest.mark.parametrize("case", ["graph_input", "dynamic"])
def test_outputs_it_must_not_touch(case):
    if case == "graph_input":
        proto = _model(["reshape"], reshape_input="x")
    else:
        proto = _model(["reshape"])
        proto.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "B"
    model = ir.from_proto(proto)
    assert output_views(model) == 0
    assert [o.name for o in model.graph.outputs] == [o.name for o in proto.graph.output]
    onnx.checker.check_model(ir.to_proto(model))
