"""im2col_to_slices: ``im2col`` (``F.unfold``) -> a zero pad, one strided slice per kernel tap, cat.

Before -> after: ``im2col(x[N, C, H, W], (kh, kw), dilation, padding, stride)`` -> ``x`` padded
with zeros, for each tap ``(i, j)`` (row-major) the strided slice of the output positions it
reads (``[N, C, 1, oh, ow]``), concatenated on dim 2 to ``[N, C, kh*kw, oh, ow]`` and reshaped to
``[N, C*kh*kw, oh*ow]`` (channel-major: im2col's order).

Why: ``im2col`` is on no accelerator's list; pads, slices, cat and reshapes are on every one.
ConvBERT's span-based dynamic convolution unfolds its keys in every layer (3 regions per
forward); ``nn.Unfold`` patch embeddings do the same.

Exact: pure data movement, the same elements in the same order (the pad is zeros, as
im2col's). Left alone: symbolic shapes, unbatched (3-D) input, more than ``MAX_TAPS`` taps,
integer inputs (eager's im2col raises on them).
"""

from __future__ import annotations

import torch

from fxpass import rule
from fxpass.graph import bind_args
from fxpass.rules._util import aten

MAX_TAPS = 64


def _out_hw(h: int, w: int, k: tuple, dil: tuple, pad: tuple, st: tuple) -> tuple[int, int]:
    return tuple((size + 2 * p - d * (kk - 1) - 1) // s + 1
                 for size, kk, d, p, s in zip((h, w), k, dil, pad, st, strict=True))


def _unfold(x, k: tuple, dil: tuple, pad: tuple, st: tuple):
    n, c, h, w = x.shape
    oh, ow = _out_hw(h, w, k, dil, pad, st)
    xp = torch.nn.functional.pad(x, (pad[1], pad[1], pad[0], pad[0])) if any(pad) else x
    taps = []
    for i in range(k[0]):
        for j in range(k[1]):
            r, q = i * dil[0], j * dil[1]
            taps.append(xp[:, :, r:r + st[0] * (oh - 1) + 1:st[0],
                           q:q + st[1] * (ow - 1) + 1:st[1]].unsqueeze(2))
    return torch.cat(taps, 2).reshape(n, c * k[0] * k[1], oh * ow)


@rule(aten.im2col.default, name="im2col_to_slices")
def im2col_to_slices(node, rw) -> bool:
    """im2col -> pad, one strided slice per kernel tap, cat, reshape."""
    a = bind_args(node)
    x = a["self"]
    k, dil, pad, st = (tuple(a[n]) for n in ("kernel_size", "dilation", "padding", "stride"))
    if not rw.static(x):
        return False
    v = rw.val(x)
    if not v.dtype.is_floating_point:
        return rw.skip(f"a {v.dtype} input (eager's im2col raises on it; kept so it still does)")
    if v.dim() != 4:
        return rw.skip("an unbatched (3-D) input")
    if k[0] * k[1] > MAX_TAPS:
        return rw.skip(f"{k[0] * k[1]} kernel taps (more than {MAX_TAPS} slices)")
    oh, ow = _out_hw(v.shape[2], v.shape[3], k, dil, pad, st)
    if oh < 1 or ow < 1 or tuple(rw.val(node).shape) != (v.shape[0], v.shape[1] * k[0] * k[1],
                                                         oh * ow):
        return rw.skip("an output shape im2col's formula does not give")
    rw.replace(node, rw.inline(_unfold, x, k, dil, pad, st, key=("im2col", k, dil, pad, st)))
    return True
