"""sum_to_mean, vector_norm: float sums and 2-norms as ``mean`` (the BPU's reduction).

Before -> after: ``sum(x, dims, keepdim)`` -> ``mean(x, dims, keepdim) * n`` (``n`` the number of
reduced elements); ``linalg_vector_norm(x, 2, dims, keepdim)`` -> ``sqrt(sum(x * x, dims))``,
which the first rule then turns into a mean.

Why: the BPU reduces with ``mean.dim`` (its pooling unit) and has no ``sum``; WavLM sums over a
dim, and ``F.normalize`` (Swin v2's cosine attention) and ConvNeXt V2's GRN take 2-norms, each
splitting the region.

Float32/float64 only: ``mean * n`` rounds once more than ``sum`` (within the dtype's tolerance);
in half precision that extra rounding is as large as the dtype's own step, and the BPU target
promotes bf16 graphs to float32 first anyway. Does not fire on integer or bool sums (``mean``
needs floats), a ``dtype=`` argument, an empty dim list (a full reduction), symbolic shapes.
"""

from __future__ import annotations

import math

import torch

from fxpass import rule
from fxpass.rules._util import aten

FLOATS = (torch.float32, torch.float64)


def _dims(x: torch.Tensor, dims: list[int] | None) -> list[int] | None:
    if not dims:
        return None
    return sorted({d % max(x.dim(), 1) for d in dims})


@rule(aten.sum.dim_IntList, name="sum_to_mean")
def sum_to_mean(node, rw) -> bool:
    """sum over dims -> mean over the same dims times the count."""
    x, dims = node.args[:2]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if node.kwargs.get("dtype") is not None or len(node.args) > 3:
        return rw.skip("a dtype= argument")
    v = rw.val(x)
    if v.dtype not in FLOATS:
        return rw.skip(f"a {v.dtype} sum (mean needs float32/float64)")
    if not rw.static(x):
        return False
    ds = _dims(v, dims)
    if ds is None or v.dim() == 0:
        return rw.skip("a full reduction (no dims)")
    n = math.prod(v.shape[d] for d in ds)
    if n == 0:
        return rw.skip("an empty reduction (mean of nothing is NaN, the sum is 0)")
    mean = rw.call(aten.mean.dim, x, ds, keepdim)
    rw.replace(node, rw.call(aten.mul.Tensor, mean, float(n)))
    return True


@rule(aten.linalg_vector_norm.default, name="vector_norm")
def vector_norm(node, rw) -> bool:
    """2-norm over dims -> sqrt of the sum of squares."""
    x = node.args[0]
    order = node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2)
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    keepdim = node.args[3] if len(node.args) > 3 else node.kwargs.get("keepdim", False)
    if order != 2:
        return rw.skip(f"a {order}-norm (only the 2-norm is a sum of squares)")
    if node.kwargs.get("dtype") is not None or len(node.args) > 4:
        return rw.skip("a dtype= argument")
    v = rw.val(x)
    if v.dtype not in FLOATS:
        return rw.skip(f"a {v.dtype} norm")
    if not dims or v.dim() == 0:
        return rw.skip("a full reduction (no dims)")
    sq = rw.call(aten.mul.Tensor, x, x)
    total = rw.call(aten.sum.dim_IntList, sq, list(dims), keepdim)
    rw.replace(node, rw.call(aten.sqrt.default, total))
    return True
