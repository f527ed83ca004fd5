"""max_dim_values: ``max(x, d, keepdim)[0]`` -> ``amax(x, [d], keepdim)`` (and ``min`` -> ``amin``).

Why: ``max.dim`` returns values *and* indices, and the indices (an int64 argmax) are on no
accelerator's list, so the whole tuple stays on the CPU even when only the values are read.
Hiera's mask-unit pooling (``x.max(dim=...).values``) split every stage's region this way.
``amax``/``amin`` are the BPU's ReduceMax/ReduceMin.

Exact up to the sign of a zero: both propagate NaN and give the same value, but on a tie of
``-0.0`` and ``0.0`` (equal numbers) the two kernels may pick different ones, as eager's own
``max`` and ``amax`` do. Fires only when every user reads element 0 (the values); a graph that
reads the indices keeps ``max.dim``.
"""

from __future__ import annotations

import operator

from fxpass import rule
from fxpass.graph import bind_args
from fxpass.rules._util import aten

_REDUCE = {aten.max.dim: aten.amax.default, aten.min.dim: aten.amin.default}


@rule(aten.max.dim, aten.min.dim, name="max_dim_values")
def max_dim_values(node, rw) -> bool:
    """The values of a max/min over one dim, when nobody reads the indices."""
    a = bind_args(node)
    x, d, keepdim = a["self"], a["dim"], a["keepdim"]
    users = list(node.users)
    if not users or any(u.target is not operator.getitem or u.args[1] != 0 for u in users):
        return rw.skip("the indices are read (or the whole tuple is used)")
    values = rw.call(_REDUCE[node.target], x, [d], keepdim)
    for u in users:
        rw.replace(u, values)
    rw.erase(node)
    return True
