"""group_norm: ``native_group_norm`` -> mean / variance / rsqrt over each group.

Before -> after: ``native_group_norm(x, w, b, N, C, HxW, G, eps)`` -> ``x`` viewed as
``[N, G, -1]``, ``mean``, ``(x - mean)**2`` averaged, ``rsqrt(var + eps)``, the affine ``w``/``b``
per channel; the op's ``mean`` and ``rstd`` outputs come from the same nodes.

Why: group norm is not on the BPU's operator list, while ``mean.dim``, ``rsqrt`` and the
elementwise ops are. wav2vec2's feature encoder (and diffusion U-Nets) normalize by group;
the one op split the region. The reduction limits of the table still apply per group.

Exact up to float rounding (a two-pass variance, as aten's CPU kernel). Half-precision inputs
are normalized in float32 and cast back, as aten accumulates in float32.
"""

from __future__ import annotations

import operator

import torch

from fxpass import rule
from fxpass.rules._util import aten


def _group_norm(x, w, b, n: int, c: int, g: int, eps: float):
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    xs = x.reshape(n, g, -1)
    mean = xs.mean(-1, keepdim=True)
    centered = xs - mean
    rstd = torch.rsqrt((centered * centered).mean(-1, keepdim=True) + eps)
    y = (centered * rstd).reshape(x.shape)
    shape = [1, c] + [1] * (x.dim() - 2)
    if w is not None:
        y = y * w.reshape(shape)
    if b is not None:
        y = y + b.reshape(shape)
    return y.to(dtype), mean.reshape(n, g).to(dtype), rstd.reshape(n, g).to(dtype)


@rule(aten.native_group_norm.default, name="group_norm")
def group_norm(node, rw) -> bool:
    """native_group_norm -> per-group mean, variance and rsqrt."""
    x, w, b, n, c, _hw, g, eps = node.args
    if not rw.static(x):
        return False
    if rw.val(x).numel() == 0:
        return rw.skip("an empty input")
    if any(t is not None and rw.val(t).dtype != rw.val(x).dtype for t in (w, b)):
        return rw.skip("weight or bias of another dtype than the input (aten promotes them)")
    users = list(node.users)
    if any(u.target is not operator.getitem for u in users):
        return rw.skip("a user takes the whole tuple, not one element")
    outs = rw.inline(_group_norm, x, w, b, n, c, g, eps, key=("group_norm", n, c, g, eps))
    for u in users:
        rw.replace(u, outs[u.args[1]])
    rw.erase(node)
    return True
