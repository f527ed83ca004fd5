"""Helpers shared by the built-in rules (schema facts, dtype tests)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.fx import Node

from fxpass.graph import is_view, writes

aten, prims = torch.ops.aten, torch.ops.prims
#: The canonical dtype cast: ``_to_copy(x, dtype=d)`` with no other argument. A C++ op, so a
#: cast left on the CPU costs a few microseconds (``prims.convert_element_type`` goes through
#: a Python autograd wrapper, ~80 us a call).
CAST = aten._to_copy.default
#: meta flag on a cast a decomposition inserted to compute in float32 as the fused kernel it
#: replaces does (SDPA reads BF16 and accumulates in F32). Under BF16 promotion such a cast
#: is the promotion of the fused op, so ``bf16_cast_cancel`` may undo a round trip through it.
COMPUTE_F32 = "fxpass_compute_f32"


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
    (``torch.tensor([..])`` becomes ``lift_fresh_copy(_tensor_constant)``) and the views taken
    of it (``rows[:, None]``, evaluated on the constant). None if one of those is written or
    viewed elsewhere (``c = torch.tensor([0, 2]); c[0] = 3``): its value is then not the
    constant's."""
    if not isinstance(node, Node) or node.op != "call_function":
        return rw.constant(node)
    fresh_copy = node.target in _FRESH
    if not fresh_copy and not is_view(node.target):
        return rw.constant(node)
    if _written_through(node):
        return None
    base = literal(rw, node.args[0]) if node.args else None
    if base is None or fresh_copy:
        return base
    with contextlib.suppress(Exception):  # a view that does not apply: not a literal
        return node.target(base, *node.args[1:], **node.kwargs)
    return None


def _written_through(node: Node) -> bool:
    """Whether something writes to ``node``, directly or through a view of it."""
    for u in node.users:
        if u.op != "call_function":
            continue
        if writes(u.target) or (is_view(u.target) and _written_through(u)):
            return True
    return False


def fresh(rw: Any, node: Node, x: Any) -> Node:
    """``x`` as a new tensor laid out as ``node``'s value: a rule that replaces an op which
    returns a new tensor (roll, pad, index) must not return a view of its input (a later write
    would reach the input), nor other strides (a later ``view`` was traced against them)."""
    fmt = torch.contiguous_format if rw.val(node).is_contiguous() else torch.preserve_format
    return rw.call(aten.clone.default, x, memory_format=fmt)
