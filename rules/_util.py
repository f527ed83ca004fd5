"""Helpers shared by the built-in rules (schema facts, dtype tests)."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fxpass.graph import writes  # noqa: F401 - re-exported for the rules

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


def mutated(node: Node) -> bool:
    """Whether a user writes to ``node``'s value (as the written argument, not as a source:
    ``copy_(cache, node)`` writes ``cache``)."""
    return any(u.op == "call_function" and _writes_to(u, node) for u in node.users)


def _writes_to(user: Node, node: Node) -> bool:
    schema = getattr(user.target, "_schema", None)
    if schema is None:
        return False
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = user.args[i] if i < len(user.args) else user.kwargs.get(a.name)
            if v is node:
                return True
    return False


def dtype_of(node: Any) -> torch.dtype | None:
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None


_FRESH = (aten.lift_fresh_copy.default, aten.clone.default, aten.alias.default)


def literal(rw: Any, node: Any) -> torch.Tensor | None:
    """The constant behind ``node``, through the copies a literal gets when traced
    (``torch.tensor([..])`` becomes ``lift_fresh_copy(_tensor_constant)``)."""
    while isinstance(node, Node) and node.op == "call_function" and node.target in _FRESH:
        node = node.args[0]
    return rw.constant(node)
