"""unbind_to_select: ``unbind(x, d)[i]`` -> ``select(x, d, i)``.

Why: ``unbind`` returns a tuple, and is on no accelerator's operator list; ``select`` (a view)
is. ModernBERT unbinds its fused QKV in every layer, which split each layer's region in three.

Exact: ``unbind`` is defined as the selects. Fires when every user takes one element
(``getitem``), which is how traced graphs use a tuple.
"""

from __future__ import annotations

import operator

from fxpass import rule
from fxpass.rules._util import aten


@rule(aten.unbind.int, name="unbind_to_select")
def unbind_to_select(node, rw) -> bool:
    """Each element of unbind becomes a select."""
    x = node.args[0]
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    users = list(node.users)
    if not users or any(u.target is not operator.getitem for u in users):
        return rw.skip("a user takes the whole tuple, not one element")
    for u in users:
        rw.replace(u, rw.call(aten.select.int, x, d, u.args[1]))
    rw.erase(node)
    return True
