"""index_put_to_copy: ``x[..., idx] = v`` on one dim -> ``index_copy(x, d, idx, v)``.

Before -> after: ``index_put(x, [None] * d + [idx], v)`` with ``idx`` a 1-D integer tensor and no
accumulation -> ``index_copy(x, d, idx mod n, expand(v))``, which ``kv_cache_update`` then turns
into device ops (``where`` over a position mask).

Why: HF's full sliding-window cache writes the newest key with ``keys[:, :, tensor([-1])] = k``
in every layer; ``index_put`` is on no accelerator's operator list and split the decode region.

Exact: both write ``v`` at the same positions; negative positions count from the end in
``index_put`` and are wrapped first, and a position outside ``[-n, n)`` still raises.

Does not fire when: accumulating; more than one index, or a boolean index; more than one
position (``index_put`` keeps one write where positions repeat, undefined which, and the
several-position form of ``kv_cache_update`` spreads a NaN in one new value to the others;
one position is exact in both); shapes are symbolic.
"""

from __future__ import annotations

import torch

from fxpass import rule
from fxpass.rules._util import aten


@rule(aten.index_put.default, name="index_put_to_copy")
def index_put_to_copy(node, rw) -> bool:
    """index_put of one position on one dim -> index_copy."""
    x, indices, v = node.args[:3]
    if (node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)):
        return rw.skip("accumulating index_put (a scatter-add)")
    if not rw.static(x, v):
        return False
    used = [i for i, t in enumerate(indices) if t is not None]
    if len(used) != 1:
        return rw.skip("more than one indexed dim")
    d = used[0]
    idx = indices[d]
    iv = rw.val(idx)
    if iv.dim() != 1 or iv.dtype not in (torch.int64, torch.int32):
        return rw.skip("the index is not a 1-D integer tensor")
    if iv.numel() != 1:
        return rw.skip("more than one position (repeats are undefined in index_put)")
    n = rw.val(x).shape[d]
    shape = list(rw.val(x).shape)
    shape[d] = iv.numel()
    if list(torch.broadcast_shapes(rw.val(v).shape, shape)) != shape:
        return rw.skip("values that do not broadcast to the indexed slots")
    if rw.val(v).dtype != rw.val(x).dtype:
        return rw.skip("values of another dtype than the destination")
    pos = rw.inline(_wrap, idx, n, key=("index_put_to_copy", n))
    vals = v if list(rw.val(v).shape) == shape else rw.call(aten.expand.default, v, shape)
    rw.replace(node, rw.call(aten.index_copy.default, x, d, pos, vals))
    return True


def _wrap(idx: torch.Tensor, n: int) -> torch.Tensor:
    """Negative positions counted from the end, as index_put reads them (out of range stays
    out of range, so index_copy raises as index_put does)."""
    return torch.where(idx < 0, idx + n, idx).long()  # index_copy takes int64 only
