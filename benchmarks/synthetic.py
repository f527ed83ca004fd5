"""Synthetic aten graphs of a chosen size, shaped like transformer blocks, with meta['val'].

Each block is ~20 nodes: a linear (t + mm), RMSNorm (pow/mean/rsqrt/mul), an alias, a
``mul.Scalar``, a ``_to_copy`` cast pair, a ``_safe_softmax`` and an input-independent
``arange`` chain, so the built-in rules all find work, as in a real model graph.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule

from fxpass.graph import FROZEN

aten, prims = torch.ops.aten, torch.ops.prims


def build(n_nodes: int, width: int = 16) -> GraphModule:
    """A GraphModule of about ``n_nodes`` nodes (fake vals; weights frozen placeholders)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    g = Graph()

    def ph(name, t, frozen=None):
        n = g.placeholder(name)
        with mode:
            n.meta["val"] = mode.from_tensor(t)
        if frozen is not None:
            n.meta[FROZEN] = frozen
        return n

    def op(target, *args, **kwargs):
        n = g.call_function(target, args, kwargs)
        fa, fk = torch.fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
        with mode:
            n.meta["val"] = target(*fa, **fk)
        return n

    w = torch.randn(width, width)
    x = ph("x", torch.randn(4, width))
    weight = ph("w", w, frozen=w)
    i = 0
    while len(g.nodes) < n_nodes:
        i += 1
        h = op(aten.mm.default, x, op(aten.t.default, weight))
        sq = op(aten.pow.Tensor_Scalar, h, 2)
        var = op(aten.mean.dim, sq, [-1], True)
        r = op(aten.rsqrt.default, op(aten.add.Tensor, var, 1e-6))
        h = op(aten.mul.Tensor, h, r)
        h = op(aten.alias.default, h)
        h = op(aten.mul.Scalar, h, 0.5)
        h16 = op(aten._to_copy.default, h, dtype=torch.float16)
        h = op(aten._to_copy.default, h16, dtype=torch.float32)
        s = op(aten._safe_softmax.default, h, -1)
        pos = op(aten.arange.start_step, 0, width, 1, dtype=torch.float32)
        pos = op(aten.mul.Tensor, op(aten.unsqueeze.default, pos, 0), 0.01)
        x = op(aten.add.Tensor, op(aten.relu.default, s), pos)
    g.output((x,))
    return GraphModule(torch.nn.Module(), g)
