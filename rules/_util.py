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
    """Whether anything writes to ``node``'s value (directly, through a user)."""
    return any(u.op == "call_function" and writes(u.target) for u in node.users)


def dtype_of(node: Any) -> torch.dtype | None:
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None
