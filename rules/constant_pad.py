"""constant_pad: ``constant_pad_nd(x, pad, value)`` -> ``cat`` with constant blocks (and slices).

Before -> after: per padded dim, ``cat([full(before, value), x, full(after, value)], d)``; a
negative pad (a crop) is a ``slice``.

Why: ``constant_pad_nd`` is not on the BPU's operator list; ``cat`` and ``slice`` are. Models
ported from TensorFlow pad explicitly before every strided conv ("SAME" padding, often one
pixel more on one side): MobileNetV2 became 52 regions, Swin pads its windows.

Exact: the same values; the blocks are constants of the pad's shape (small: one side's slab).

Does not fire when: shapes are symbolic; a block would be larger than ``MAX_BLOCK`` elements
(a huge pad is cheaper as the op than as a constant).
"""

from __future__ import annotations

import torch

from fxpass import rule
from fxpass.rules._util import aten, fresh

MAX_BLOCK = 1 << 20


@rule(aten.constant_pad_nd.default, name="constant_pad")
def constant_pad(node, rw) -> bool:
    """constant_pad_nd -> per-dim cat of constant blocks, slices for negative pads."""
    x, pad = node.args[:2]
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    if not rw.static(x):
        return False
    v = rw.val(x)
    shape, out, joined = list(v.shape), x, False
    # pad lists (before, after) pairs from the last dim backwards
    for i in range(len(pad) // 2):
        d = v.dim() - 1 - i
        lo, hi = pad[2 * i], pad[2 * i + 1]
        if lo < 0 or hi < 0:
            start, stop = max(-lo, 0), shape[d] - max(-hi, 0)
            out = rw.call(aten.slice.Tensor, out, d, start, stop)
            shape[d] = max(stop - start, 0)
            lo, hi = max(lo, 0), max(hi, 0)
        parts = []
        for n, where in ((lo, 0), (hi, 1)):
            if n == 0:
                continue
            block = list(shape)
            block[d] = n
            if torch.Size(block).numel() > MAX_BLOCK:
                return rw.skip(f"a pad block of {torch.Size(block).numel()} elements")
            c = rw.const(torch.full(block, value, dtype=v.dtype), hint="pad")
            parts.append((where, c))
        if parts:
            seq = [c for w, c in parts if w == 0] + [out] + [c for w, c in parts if w == 1]
            out, joined = rw.call(aten.cat.default, seq, d), True
            shape[d] += lo + hi
    if not joined:  # only zeros and crops: a copy (constant_pad_nd never returns a view)
        out = fresh(rw, node, out)
    rw.replace(node, out)
    return True
