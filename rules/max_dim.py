"""max_dim_values: ``max(x, d, keepdim)[0]`` -> ``amax(x, [d], keepdim)`` (and ``min`` -> ``amin``).

Why: ``max.dim`` returns values *and* indices, and the indices (an int64 argmax) are on no
accelerator's list, so the whole tuple stays on the CPU even when only the values are read.
Hiera's mask-unit pooling (``x.max(dim=...).values``) split every stage's region this way.
``amax``/``amin`` are the BPU's ReduceMax/ReduceMin.

Exact: both reduce with the same comparison (NaN propagates, the first of equal values wins, so
``-0.0``/``0.0`` ties keep the same element). Fires only when every user reads element 0 (the
values); a graph that reads the indices keeps ``max.dim``.
"""

from __future__ import annotations

import operator

from fxpass import rule
from fxpass.rules._util import aten

_REDUCE = {aten.max.dim: aten.amax.default, aten.min.dim: aten.amin.default}


@rule(aten.max.dim, aten.min.dim, name="max_dim_values")
def max_dim_values(node, rw) -> bool:
    """The values of a max/min over one dim, when nobody reads the indices."""
    x, d = node.args[:2]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    users = list(node.users)
    if not users or any(u.target is not operator.getitem or u.args[1] != 0 for u in users):
        return rw.skip("the indices are read (or the whole tuple is used)")
    values = rw.call(_REDUCE[node.target], x, [d], keepdim)
    for u in users:
        rw.replace(u, values)
    rw.erase(node)
    return True
