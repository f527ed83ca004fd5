"""The host executor's bound outputs (``OrtExecutor._bound``): a region that updates an input in
place returns its other outputs in new tensors bound before each run. What a caller got from
one call never changes under a later call; a change of input shape learns the output shapes
again; an output whose shape follows input values is never written into a stale buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from fxpass.backends.onnx.host import binding as binding_mod
from fxpass.backends.onnx.host.ort import IN_PLACE, OK_OUTPUT, ROWS_KEY, OrtExecutor, RegionDeclined


def _executor(nonzero: bool = False, rows: bool = False) -> OrtExecutor:
    """``cache`` (updated in place: + 1) and ``x`` -> ``relu(x)`` (or ``NonZero(x)``, whose
    shape follows the values of ``x``)."""
    cache = helper.make_tensor_value_info("cache", TensorProto.FLOAT, [4])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    if nonzero:
        node = helper.make_node("NonZero", ["x"], ["y"])
        y = helper.make_tensor_value_info("y", TensorProto.INT64, [1, "k"])
    else:
        node = helper.make_node("Relu", ["x"], ["y"])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    updated = helper.make_tensor_value_info(IN_PLACE + "cache", TensorProto.FLOAT, [4])
    graph = helper.make_graph(
        [node, helper.make_node("Add", ["cache", "one"], [IN_PLACE + "cache"])], "g",
        [cache, x], [y, updated], [one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    if rows:  # as if ``y`` were the row the kernel writes into ``cache`` (declare_rows)
        helper.set_model_props(model, {ROWS_KEY: f'{{"{IN_PLACE}cache": ["y", 0]}}'})
    ex = OrtExecutor(model.SerializeToString(), ["cache", "x"])
    assert ex.in_place_inputs() == {0}
    if rows:
        assert ex.in_place_rows() == {0: (0, 0)}
        ex.grant({0}, {0})
    else:
        ex.grant({0})
    return ex


@pytest.fixture(params=["C binding", "wrapper"])
def binding(request, monkeypatch):
    """Both ways ``Binding`` binds: straight to onnxruntime's C object, and through its Python
    wrapper (an onnxruntime without the private attributes)."""
    monkeypatch.setattr(binding_mod.Binding, "fast", request.param == "C binding")
    return request.param


def test_outputs_of_one_call_survive_the_next_and_the_cache_updates_in_place(binding):
    ex = _executor()
    cache = torch.zeros(4)
    got = []
    for k in range(4):
        x = torch.linspace(-1, 1, 5) * (k + 1)
        (y,) = ex(cache, x)
        held = y.detach()  # a tensor sharing the output's memory, kept across calls
        got.append((x, y, held, y.clone()))
    assert isinstance(ex._local.outs, list)  # the bound path ran after the first call
    assert len({y.data_ptr() for _, y, _, _ in got}) == 4
    for x, y, held, snapshot in got:
        torch.testing.assert_close(y, torch.relu(x), rtol=0, atol=0)
        torch.testing.assert_close(held, snapshot, rtol=0, atol=0)
    torch.testing.assert_close(cache, torch.full((4,), 4.0))


def test_an_input_shape_change_learns_the_output_shapes_again():
    ex = _executor()
    cache = torch.zeros(4)
    for n in (3, 3, 7, 7, 7, 2, 3):
        x = torch.randn(n)
        (y,) = ex(cache, x)
        assert y.shape == (n,)
        torch.testing.assert_close(y, torch.relu(x), rtol=0, atol=0)
    torch.testing.assert_close(cache, torch.full((4,), 7.0))


def test_an_output_shape_that_follows_values_raises_once_then_runs_unbound():
    ex = _executor(nonzero=True)
    cache = torch.zeros(4)
    x2 = torch.tensor([0.0, 1.0, 0.0, 2.0])
    for _ in range(2):
        (y,) = ex(cache, x2)
        assert y.tolist() == [[1, 3]]
    x3 = torch.tensor([5.0, 1.0, 0.0, 2.0])  # same shape, three nonzeros: the bound buffer is
    with pytest.raises(Exception, match="shape"):  # too small, and onnxruntime says so
        ex(cache, x3)
    assert ex._local.outs is False
    for x in (x3, x2, x3):
        (y,) = ex(cache, x)
        assert y.tolist() == [np.nonzero(x.numpy())[0].tolist()]


def test_a_row_written_into_a_copy_of_a_strided_input_is_returned():
    """A strided cache is bound as a contiguous copy, so the kernel's row lands in the copy:
    the row must come back for the caller's own write (found in review)."""
    ex = _executor(rows=True)
    x = torch.randn(4)
    cache = torch.zeros(4)
    for _ in range(2):
        (y,) = ex(cache, x)
    assert y is None  # written in place, left out
    strided = torch.zeros(8)[::2]
    (y,) = ex(strided, x)
    assert y is not None
    torch.testing.assert_close(y, torch.relu(x), rtol=0, atol=0)
    kept = y.clone()  # the returned row is the caller's: later calls never write into it
    for _ in range(2):
        (z,) = ex(cache, torch.randn(4) + 5)
        assert z is None
        torch.testing.assert_close(y, kept, rtol=0, atol=0)


def test_the_check_flag_is_read_afresh_on_every_call(binding):
    """The model's own exactness flag (``fxpass_ok``) lands in one buffer bound once: a call
    that fails the check after calls that passed is still declined, and one after it runs."""
    cache = helper.make_tensor_value_info("cache", TensorProto.FLOAT, [4])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]),
         helper.make_node("ReduceMin", ["x"], ["low"], keepdims=0),
         helper.make_node("Less", ["low", "zero"], ["negative"]),
         helper.make_node("Not", ["negative"], [OK_OUTPUT]),
         helper.make_node("Add", ["cache", "zero"], [IN_PLACE + "cache"])], "g", [cache, x],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info(OK_OUTPUT, TensorProto.BOOL, []),
         helper.make_tensor_value_info(IN_PLACE + "cache", TensorProto.FLOAT, [4])], [zero])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    ex = OrtExecutor(model.SerializeToString(), ["cache", "x"])
    ex.grant({0})
    cache = torch.zeros(4)
    declined = 0
    for k, sign in enumerate([1, 1, 1, -1, 1, -1, -1, 1]):
        x = (torch.tensor([1.0, 2.0, 3.0]) + k) * sign
        if sign < 0:
            with pytest.raises(RegionDeclined):
                ex(cache, x)
            declined += 1
        else:
            (y,) = ex(cache, x)
            torch.testing.assert_close(y, torch.relu(x), rtol=0, atol=0)
    assert declined == 3
    assert isinstance(ex._local.outs, list) and ex._local.kept  # the flag's buffer was bound
    fast = ex._local.binding.bind_input == ex._local.binding.py._iobinding.bind_input
    assert fast == (binding == "C binding")
