"""Helpers shared by the built-in rules (schema facts, dtype tests)."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fxpass.graph import is_view, writes

aten, prims = torch.ops.aten, torch.ops.prims
#: The canonical dtype cast: ``_to_copy(x, dtype=d)`` with no other argument. A C++ op, so a
#: cast left on the CPU costs a few microseconds (``prims.convert_element_type`` goes through
#: a Python autograd wrapper, ~80 us a call).
CAST = aten._to_copy.default


def cast_to(node: Node) -> torch.dtype | None:
    """The target dtype if ``node`` is a canonical cast, else None."""
    if node.op != "call_function" or node.target is not CAST or node.args[1:]:
        return None
    return node.kwargs.get("dtype") if set(node.kwargs) == {"dtype"} else None


def dtype_of(node: Any) -> torch.dtype | None:
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None


_FRESH = (aten.lift_fresh_copy.default, aten.clone.default, aten.alias.default)


def literal(rw: Any, node: Any) -> torch.Tensor | None:
    """The constant behind ``node``, through the copies a literal gets when traced
    (``torch.tensor([..])`` becomes ``lift_fresh_copy(_tensor_constant)``). None if one of
    those copies is viewed or written (``c = torch.tensor([0, 2]); c[0] = 3``): its value is
    then not the constant's."""
    while isinstance(node, Node) and node.op == "call_function" and node.target in _FRESH:
        if any(u.op == "call_function" and (is_view(u.target) or writes(u.target))
               for u in node.users):
            return None
        node = node.args[0]
    return rw.constant(node)


def fresh(rw: Any, node: Node, x: Any) -> Node:
    """``x`` as a new tensor laid out as ``node``'s value: a rule that replaces an op which
    returns a new tensor (roll, pad, index) must not return a view of its input (a later write
    would reach the input), nor other strides (a later ``view`` was traced against them)."""
    fmt = torch.contiguous_format if rw.val(node).is_contiguous() else torch.preserve_format
    return rw.call(aten.clone.default, x, memory_format=fmt)
