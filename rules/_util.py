"""Helpers shared by the built-in rules (schema facts, dtype tests)."""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch.fx import Node

aten, prims = torch.ops.aten, torch.ops.prims
CAST = prims.convert_element_type.default


@cache
def writes(target: Any) -> bool:
    """Whether an op's schema writes to any of its arguments (in-place / out= / copy_)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def mutated(node: Node) -> bool:
    """Whether anything writes to ``node``'s value (directly, through a user)."""
    return any(u.op == "call_function" and writes(u.target) for u in node.users)


def dtype_of(node: Any) -> torch.dtype | None:
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None
