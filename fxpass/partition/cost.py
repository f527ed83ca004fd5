"""Compute cost: multiply-accumulates per node, from static shapes in ``meta['val']``.

The system this replaces read the wrong operand for addmm/linear and the wrong weight
dimension for convolution and ignored groups; each formula here says which operand it reads.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import Node

aten = torch.ops.aten


def _shape(n: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in n.meta["val"].shape)


def macs(node: Node) -> int:
    """MACs of one node (0 for anything that is not a tensor-engine op)."""
    t = node.target
    if node.op != "call_function":
        return 0
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return 0
    if t in (aten.mm.default, aten.bmm.default, aten.matmul.default):
        # out [..., M, N], K = last dim of the first operand
        return math.prod(_shape(node)) * _shape(node.args[0])[-1]
    if t is aten.addmm.default:  # addmm(bias, mat1 [M,K], mat2 [K,N])
        return math.prod(_shape(node)) * _shape(node.args[1])[-1]
    if t is aten.baddbmm.default:  # baddbmm(bias, b1 [B,M,K], b2 [B,K,N])
        return math.prod(_shape(node)) * _shape(node.args[1])[-1]
    if t is aten.linear.default:  # linear(x [..., K], w [N, K], b)
        return math.prod(_shape(node)) * _shape(node.args[1])[-1]
    if t is aten.convolution.default:
        # convolution(x, w [Cout, Cin/groups, *k], b, stride, padding, dilation, transposed, ...)
        # each output element needs Cin/groups * prod(k) MACs; stride/dilation/padding are
        # already in the output shape.
        w = _shape(node.args[1])
        if len(node.args) > 6 and node.args[6]:  # transposed: w [Cin, Cout/groups, *k]
            return math.prod(_shape(node.args[0])) * w[1] * math.prod(w[2:])
        return math.prod(_shape(node)) * w[1] * math.prod(w[2:])
    return 0
