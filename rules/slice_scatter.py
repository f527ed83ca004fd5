"""slice_scatter_to_cat: ``slice_scatter(base, src, d, a, b)`` -> ``cat([base[:a], src, base[b:]])``
(along ``d``).

Why: ``x[..., a:b] = y`` on a tensor the graph made is functionalized to ``slice_scatter``,
which is on no accelerator's list; ``slice`` and ``cat`` are on every one. Funnel's relative
attention shifts write its score slices this way (8 per forward, 6 regions).

Exact: the same elements in the same places, a new tensor like ``slice_scatter``'s. Step 1
only (a strided write interleaves; left alone); ``src`` must be exactly the written slice (the
same dtype, the slice's shape); the result keeps ``slice_scatter``'s strides (the ``cat`` runs
in its memory order, permuted back). Where ``base`` had gaps (a slice of a larger tensor, as in
Funnel) the result is contiguous instead, which every later view accepts; that is left alone
if a graph output or an ``as_strided`` reads those strides. Symbolic shapes are left alone.
"""

from __future__ import annotations

from fxpass import rule
from fxpass.graph import is_view
from fxpass.rules._util import aten, fresh


def _bound(v: int | None, n: int, default: int) -> int:
    """aten's slice bound: None is the default, negatives count from the end, then clamped."""
    if v is None:
        return default
    return min(max(v + n if v < 0 else v, 0), n)


def _strides_unread(node) -> bool:
    """No graph output and no ``as_strided`` sees ``node``'s strides (through views of it):
    a contiguous tensor of the same values then serves every user."""
    for u in node.users:
        if u.op == "output" or u.target is aten.as_strided.default:
            return False
        if u.op == "call_function" and is_view(u.target) and not _strides_unread(u):
            return False
    return True


@rule(aten.slice_scatter.default, name="slice_scatter_to_cat")
def slice_scatter_to_cat(node, rw) -> bool:
    """A contiguous slice written into a copy of base -> base's two outer slices around src."""
    base, src = node.args[:2]
    rest = list(node.args[2:]) + [None] * (4 - len(node.args[2:]))
    d, start, end, step = (node.kwargs.get(k, v) for k, v in
                           zip(("dim", "start", "end", "step"), rest, strict=True))
    d, step = d or 0, step or 1
    if not rw.static(base, src):
        return False
    vb, vs = rw.val(base), rw.val(src)
    if step != 1:
        return rw.skip(f"a strided write (step {step})")
    if vb.dim() == 0 or vb.dtype != vs.dtype:
        return rw.skip("a 0-d base, or src of another dtype")
    vo = rw.val(node)  # slice_scatter keeps base's layout; later views were traced against it
    order = sorted(range(vo.dim()), key=lambda i: (-vo.stride(i), i))
    if not vo.permute(order).is_contiguous():  # base had gaps (a slice of a larger tensor)
        if not _strides_unread(node):
            return rw.skip("a result with gaps in its layout that an output or as_strided reads")
        order = list(range(vo.dim()))  # contiguous: every view traced on it stays valid
    d %= vb.dim()
    n = vb.shape[d]
    a = _bound(start, n, 0)
    b = max(_bound(end, n, n), a)
    if list(vs.shape) != [*vb.shape[:d], b - a, *vb.shape[d + 1:]]:
        return rw.skip("src is not the written slice's shape")
    if a == 0 and b == n:
        rw.replace(node, fresh(rw, node, src))
        return True
    # cat in the result's memory order (a contiguous cat, permuted back), so the strides match
    perm = order != list(range(vo.dim()))
    if perm:
        base, src = (rw.call(aten.permute.default, t, order) for t in (base, src))
        d = order.index(d)
    parts = ([rw.call(aten.slice.Tensor, base, d, 0, a)] if a > 0 else []) + [src] + (
        [rw.call(aten.slice.Tensor, base, d, b, n)] if b < n else [])
    out = rw.call(aten.cat.default, parts, d)
    if perm:
        out = rw.call(aten.permute.default, out, sorted(range(len(order)), key=order.__getitem__))
    rw.replace(node, out)
    return True
