"""as_strided_view: an ``as_strided`` that restates its input's layout -> ``view``.

Before -> after: ``as_strided(x, x.shape, strides)`` where the strides differ from ``x``'s only
on size-1 dims (and the offset is 0) -> ``view(x, x.shape)``, which ``alias_removal`` drops.

Why: decompositions emit it, e.g. ``adaptive_avg_pool1d`` (Swin's pooler) restrides the mean's
``[1, C, 1, 1]`` result. ``as_strided`` is on no accelerator's list, so the final pooling left
the region.

Exact: a size-1 dim's stride never moves to another element. Does not fire on any other
``as_strided`` (a real restride or an offset reads other elements), or on symbolic shapes.
"""

from __future__ import annotations

from fxpass import rule
from fxpass.rules._util import aten


@rule(aten.as_strided.default, name="as_strided_view")
def as_strided_view(node, rw) -> bool:
    """as_strided that only restates size-1 strides -> view."""
    x, size, stride = node.args[:3]
    offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
    if not rw.static(x):
        return False
    v = rw.val(x)
    if offset not in (None, 0) or v.storage_offset() != 0:
        return rw.skip("a storage offset")
    if list(size) != list(v.shape):
        return rw.skip("a new shape (a real restride)")
    if any(n > 1 and s != t for n, s, t in zip(size, stride, v.stride(), strict=True)):
        return rw.skip("other strides on a dim of size > 1 (a real restride)")
    rw.replace(node, rw.call(aten.view.default, x, list(size)))
    return True
