"""slice_scatter_to_cat: ``slice_scatter(base, src, d, a, b)`` -> ``cat([base[:a], src, base[b:]])``
(along ``d``).

Why: ``x[..., a:b] = y`` on a tensor the graph made is functionalized to ``slice_scatter``,
which is on no accelerator's list; ``slice`` and ``cat`` are on every one. Funnel's relative
attention shifts write its score slices this way (8 per forward, 6 regions).

Exact: the same elements in the same places, a new tensor like ``slice_scatter``'s. Step 1
only (a strided write interleaves; left alone); ``src`` must be exactly the written slice (the
same dtype, the slice's shape); the result keeps ``slice_scatter``'s strides (the ``cat`` runs
in its memory order, permuted back). Where ``base`` had gaps (a slice of a larger tensor, as in
Funnel) the result is contiguous instead, only when its sole readers are views and then
``slice_scatter`` sources (any view of a contiguous tensor is valid; a source's layout does not
reach the result); otherwise it is left alone. Symbolic shapes are left alone.
"""

from __future__ import annotations

import torch

from fxpass import rule
from fxpass.graph import bind_args
from fxpass.rules._util import aten


def _bound(v: int | None, n: int, default: int) -> int:
    """aten's slice bound: None is the default, negatives count from the end, then clamped."""
    if v is None:
        return default
    return min(max(v + n if v < 0 else v, 0), n)


_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


def _layout_free(node) -> bool:
    """Nothing downstream depends on ``node``'s strides: each user is a view (any view of a
    contiguous tensor is valid) whose users are again such views, or a ``slice_scatter``
    writing it as ``src`` (its result takes ``base``'s layout). Elementwise ops, permutes and
    outputs would carry the layout on, so they are not."""
    for u in node.users:
        if u.op == "call_function" and u.target in _VIEWS:
            if not _layout_free(u):
                return False
        elif not (u.op == "call_function" and u.target is aten.slice_scatter.default
                  and u.args[1] is node and u.args[0] is not node):
            return False
    return True


def _parts(base, src, d: int, a: int, b: int, n: int, take) -> list:
    """``[base[a-before], src, base[b-after]]`` along ``d``, empty sides dropped; ``take(t, lo,
    hi)`` slices (fake values for the check below, graph nodes for the rewrite)."""
    return ([take(base, 0, a)] if a > 0 else []) + [src] + ([take(base, b, n)] if b < n else [])


def _cat_is_contiguous(parts: list, d: int) -> bool:
    """cat follows its inputs' memory format when they all suggest the same one (channels
    last, say); the rewrite needs a contiguous cat. Checked on the fake values."""
    if len(parts) == 1:
        return True  # a whole-dim write: a contiguous clone
    with parts[0].fake_mode:
        return torch.cat(parts, d).is_contiguous()


@rule(aten.slice_scatter.default, name="slice_scatter_to_cat")
def slice_scatter_to_cat(node, rw) -> bool:
    """A contiguous slice written into a copy of base -> base's two outer slices around src."""
    args = bind_args(node)
    base, src, d, start, end, step = (args[k] for k in ("self", "src", "dim", "start", "end",
                                                         "step"))
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
        if not _layout_free(node):
            return rw.skip("a result with gaps in its layout whose strides a later op carries on")
        order = list(range(vo.dim()))  # contiguous: every view traced on it stays valid
    d %= vb.dim()
    n = vb.shape[d]
    a = _bound(start, n, 0)
    b = max(_bound(end, n, n), a)
    if list(vs.shape) != [*vb.shape[:d], b - a, *vb.shape[d + 1:]]:
        return rw.skip("src is not the written slice's shape")
    # cat in the result's memory order (a contiguous cat, permuted back), so the strides match
    perm, d = order != list(range(vo.dim())), order.index(d)
    fake = _parts(vb.permute(order), vs.permute(order), d, a, b, n,
                  lambda t, lo, hi: t.narrow(d, lo, hi - lo))
    if not _cat_is_contiguous(fake, d):
        return rw.skip("cat would pick another memory format (channels-last inputs)")
    if perm:
        base, src = (rw.call(aten.permute.default, t, order) for t in (base, src))
    parts = _parts(base, src, d, a, b, n,
                   lambda t, lo, hi: rw.call(aten.slice.Tensor, t, d, lo, hi))
    out = (rw.call(aten.cat.default, parts, d) if len(parts) > 1 else  # a whole-dim write
           rw.call(aten.clone.default, src, memory_format=torch.contiguous_format))
    if perm:
        out = rw.call(aten.permute.default, out, sorted(range(len(order)), key=order.__getitem__))
    rw.replace(node, out)
    return True
