"""roll_to_cat: ``roll(x, s, d)`` -> ``cat([x[.., n-s:, ..], x[.., :n-s, ..]], d)``.

Why: ``roll`` is on no accelerator's operator list; ``slice`` and ``cat`` are on all of them.
HF's static sliding-window cache rolls every layer's keys and values by one on each decode step
once the window is full, which split the decode region per layer.

Exact: both forms move the same elements. Several dims roll one after another; ``roll`` with no
dims rolls the flattened tensor, so it becomes reshape(-1), the same split, and a view back.

Does not fire when: shapes are symbolic (the split point must be a number).
"""

from __future__ import annotations

from fxpass import rule
from fxpass.rules._util import aten, fresh


@rule(aten.roll.default, name="roll_to_cat")
def roll_to_cat(node, rw) -> bool:
    """roll -> two slices and a cat per rolled dim."""
    x = node.args[0]
    shifts = list(node.args[1]) if len(node.args) > 1 else list(node.kwargs["shifts"])
    dims = list(node.args[2]) if len(node.args) > 2 else list(node.kwargs.get("dims", []))
    if not rw.static(x):
        return False
    shape = list(rw.val(x).shape)
    out, moved = x, False
    if not dims:  # flattened roll
        out, dims, shape = rw.call(aten.reshape.default, x, [-1]), [0], [rw.val(x).numel()]
    if len(shifts) != len(dims):
        return rw.skip("shifts and dims differ in length")
    for s, d in zip(shifts, dims, strict=True):
        n = shape[d % len(shape)]
        k = s % n if n else 0
        if k == 0:
            continue
        d %= len(shape)
        tail = rw.call(aten.slice.Tensor, out, d, n - k, n)
        head = rw.call(aten.slice.Tensor, out, d, 0, n - k)
        out, moved = rw.call(aten.cat.default, [tail, head], d), True
    if not moved:  # every shift a multiple of its dim: a copy (roll never aliases its input)
        out = fresh(rw, node, x)
    elif len(shape) == 1 and rw.val(x).dim() != 1:
        out = rw.call(aten.view.default, out, list(rw.val(x).shape))
    rw.replace(node, out)
    return True
