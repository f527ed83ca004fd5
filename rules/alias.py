"""alias_removal: drop identity ops that are provably no-ops in an inference graph.

Before -> after: ``alias(x)``, ``detach(x)``, ``lift_fresh_copy(x)``, ``clone(x)``,
``view/reshape/_unsafe_view/expand(x, same shape)`` and ``convert_element_type(x, same dtype)``
-> ``x``.

Why: backends match one op per value; identity ops split regions and hide patterns.

Does not fire when: anything writes to the copy or to its source (dropping a copy that is
mutated would make the write visible elsewhere); the result is a graph output and the source
is a graph input or constant (the caller would get an alias of its own input); a clone changes
the memory layout (a later ``view`` may depend on it); a view changes the shape.
"""

from __future__ import annotations

from fxpass import rule
from fxpass.graph import same_layout
from rules._util import aten, mutated, prims

COPIES = (aten.clone.default, aten.lift_fresh_copy.default, prims.convert_element_type.default)
VIEWS = (aten.alias.default, aten.detach.default)
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default)


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
        if node.target in COPIES and (mutated(node) or mutated(src)):
            return rw.skip("a copy that something writes to")
    if src.op in ("placeholder", "get_attr") and any(u.op == "output" for u in node.users):
        return rw.skip("would make a graph output alias a graph input")
    rw.replace(node, src)
    return True
