"""safe_softmax: ``aten._safe_softmax`` -> softmax plus an explicit fully-masked-row fix-up.

Before -> after: ``_safe_softmax(x, dim, dtype)`` -> ``where(all(x == -inf, dim), 0, softmax(x))``
using ``torch._decomp``'s own decomposition, so the semantics are PyTorch's: a row that is all
``-inf`` gives 0 (plain softmax would give NaN), and the ``dtype`` argument is honoured.

Why: ``_safe_softmax`` is what SDPA's math path emits; exporters and device op tables know
softmax, eq, all, zeros_like and where, not this private op.

Does not fire: never refuses; every input it accepts is decomposable.
"""

from __future__ import annotations

from torch._decomp import decomposition_table

from fxpass import rule
from fxpass.rules._util import aten

_DECOMP = {aten._safe_softmax.default: decomposition_table[aten._safe_softmax.default]}


@rule(aten._safe_softmax.default, name="safe_softmax")
def safe_softmax(node, rw):
    """_safe_softmax -> softmax + where(all(x == -inf), 0, .), keeping all -inf rows at 0."""
    x, dim = node.args[0], node.args[1]
    dtype = node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype")
    out = rw.inline(
        lambda t: aten._safe_softmax.default(t, dim, dtype),
        x,
        decomposition_table=_DECOMP,
        key=("safe_softmax", dim, dtype),
    )
    rw.replace(node, out)
    return True
