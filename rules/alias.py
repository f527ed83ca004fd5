"""alias_removal: drop identity ops that are provably no-ops in an inference graph.

Before -> after: ``alias(x)``, ``detach(x)``, ``lift_fresh_copy(x)``, ``clone(x)``,
``view/reshape/_unsafe_view/expand(x, same shape)`` and casts to the same dtype
-> ``x``.

Why: backends match one op per value; identity ops split regions and hide patterns.

Does not fire when: anything writes to the copy or to its source (dropping a copy that is
mutated would make the write visible elsewhere); the result is a graph output and the source
is a graph input or constant (the caller would get an alias of its own input); a clone changes
the memory layout (a later ``view`` may depend on it); a view changes the shape.
"""

from __future__ import annotations

from fxpass import rule
from fxpass.graph import is_view, same_layout, writes
from fxpass.rules._util import aten, prims

COPIES = (
    aten.clone.default,
    aten.lift_fresh_copy.default,
    aten._to_copy.default,
    prims.convert_element_type.default,
)
VIEWS = (aten.alias.default, aten.detach.default)
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default)


def _aliases(node):
    """``node`` and every value that views it, transitively (views share its storage)."""
    seen, stack = [node], [node]
    while stack:
        for u in stack.pop().users:
            if u.op == "call_function" and is_view(u.target) and u not in seen:
                seen.append(u)
                stack.append(u)
    return seen


def _base(node):
    """The tensor whose storage ``node`` views (``s[0]`` of an input is the input's storage)."""
    while node.op == "call_function" and is_view(node.target) and node.args:
        node = node.args[0]
    return node


def _written(node) -> bool:
    users = (u for a in _aliases(node) for u in a.users)
    return any(u.op == "call_function" and writes(u.target) for u in users)


@rule(*COPIES, *VIEWS, *RESHAPES, name="alias_removal", priority=10)
def alias_removal(node, rw):
    """Drop alias/detach/fresh copies/unmutated clones and same-shape views or same-dtype casts."""
    src = node.args[0]
    out, inp = node.meta["val"], src.meta.get("val")
    if inp is None or out.dtype != inp.dtype or out.shape != inp.shape:
        return False
    if node.target in COPIES or node.target in RESHAPES:
        if node.target is aten.clone.default and not same_layout(out, inp):
            return rw.skip("clone changes the memory layout")
        if node.target in COPIES and (_written(node) or _written(src)):
            return rw.skip("a copy that something writes to (directly or through a view)")
    if _base(src).op in ("placeholder", "get_attr") and any(
        u.op == "output" for a in _aliases(node) for u in a.users
    ):
        return rw.skip("would make a graph output alias a graph input")
    rw.replace(node, src)
    return True
