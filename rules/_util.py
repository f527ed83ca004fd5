"""Helpers shared by the built-in rules (schema facts, dtype tests)."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fxpass.graph import writes  # noqa: F401 - re-exported for the rules

aten, prims = torch.ops.aten, torch.ops.prims
CAST = prims.convert_element_type.default


def mutated(node: Node) -> bool:
    """Whether anything writes to ``node``'s value (directly, through a user)."""
    return any(u.op == "call_function" and writes(u.target) for u in node.users)


def dtype_of(node: Any) -> torch.dtype | None:
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None
