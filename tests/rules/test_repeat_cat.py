"""pointwise_before_repeat_cat: a pointwise op over a repeated cat runs once, before the cat."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from fxpass import PassManager
from fxpass.rules import pointwise_before_repeat_cat
from fxpass.testing import T, check_rule, trace, traced_graphs

aten = torch.ops.aten
_OPS = {
    "cos": torch.cos, "sin": torch.sin, "exp": torch.exp, "neg": torch.neg,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "rsqrt": torch.rsqrt,
    "scale": lambda x: x * 0.7, "shift": lambda x: 1.5 - x, "halve": lambda x: x / 2,
    "to_f64": lambda x: x.to(torch.float64),
}


@st.composite
def _cases(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 5)) for _ in range(rank))
    d = draw(st.integers(-rank, rank - 1))
    ops = draw(st.lists(st.sampled_from(sorted(_OPS)), min_size=1, max_size=3))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return [T(shape, dtype)], {"d": d, "n": draw(st.integers(2, 3)), "ops": ops}


def _rope_like(x, d, n, ops):
    y = torch.cat([x * 2] * n, d)  # HF: emb = cat((freqs, freqs), -1); emb.cos() * scaling
    for op in ops:
        y = _OPS[op](y)
    return y


def test_pointwise_before_repeat_cat_property():
    fired = check_rule(pointwise_before_repeat_cat, traced_graphs(_rope_like, _cases()),
                       max_examples=60)
    assert fired >= 40


def _after(fn, *xs):
    gm = trace(fn, *xs)
    PassManager([pointwise_before_repeat_cat]).run(gm)
    return gm


def test_the_op_runs_once_on_the_half():
    gm = _after(lambda f: torch.cat([f, f], -1).cos() * 0.5, torch.randn(1, 3, 4))
    (cos,) = gm.graph.find_nodes(op="call_function", target=aten.cos.default)
    assert tuple(cos.meta["val"].shape) == (1, 3, 4)  # the half, not the [1, 3, 8] cat
    (cat,) = gm.graph.find_nodes(op="call_function", target=aten.cat.default)
    assert list(gm.graph.nodes)[-2] is cat  # the cat is last: after the cos and the scale


def test_distinct_operands_or_a_tensor_operand_are_left_alone():
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    gm = _after(lambda a, b: torch.cat([a, b], -1).cos(), a, b)  # two tensors: no repeat
    (cos,) = gm.graph.find_nodes(op="call_function", target=aten.cos.default)
    assert cos.args[0].target is aten.cat.default
    gm = _after(lambda a, b: torch.cat([a, a], -1) * torch.cat([b, b], -1), a, b)
    (mul,) = gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)
    assert mul.args[0].target is aten.cat.default  # a tensor operand rides along: not moved
