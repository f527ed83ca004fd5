"""amax_to_max_pool: ``amax(x, dims)`` -> a max-pool over the reduced elements (``amin``: negated).

Before -> after: the reduced dims are moved last and flattened to ``K``, the rest to ``M``;
``max_pool2d`` over ``[1, M, 1, K]`` with a ``1 x K`` window and stride, then the output shape.
``amin(x)`` is ``-amax(-x)``.

Why: the BPU reduces a max only through its pooling unit (``max_pool2d`` is on its list,
``amax`` is not), so a max over a dim split the region: Hiera's mask-unit pooling
(``x.max(dim=...).values``, made ``amax`` by ``max_dim_values``), global max pooling written as
``amax``. A BPU-target rule: another device with a max reduction keeps ``amax``.

Exact up to the sign of a zero: a window's max is the max of its elements, NaN propagates (the
lowering's max-pool keeps aten's NaN semantics), negation is exact; on a tie of ``-0.0`` and
``0.0`` (equal numbers) the pool may keep the other one. Float dtypes only (pooling has no
int64 path); not a 0-d input or a full reduction over no dims, not an empty input, window at
most 65535 (the BPU pool limit).
"""

from __future__ import annotations

import math

from fxpass import rule
from fxpass.graph import bind_args
from fxpass.rules._util import aten

MAX_WINDOW = 65535  # FACTS.md: pool reduce axis size in [1, 65535]


def _pool_max(x, dims: tuple[int, ...], keepdim: bool, negate: bool):
    rest = [d for d in range(x.dim()) if d not in dims]
    y = x.permute(rest + list(dims))
    k = math.prod(x.shape[d] for d in dims)
    y = y.reshape(1, -1, 1, k)
    if negate:
        y = -y
    m = aten.max_pool2d_with_indices(y, [1, k], [1, k])[0]
    if negate:
        m = -m
    shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
    return m.reshape(shape if keepdim else [x.shape[d] for d in rest])


@rule(aten.amax.default, aten.amin.default, name="amax_to_max_pool", default=False,
      targets=["bpu"])
def amax_to_max_pool(node, rw) -> bool:
    """amax/amin over dims -> max_pool2d over a [1, M, 1, K] view."""
    a = bind_args(node)
    x, dims, keepdim = a["self"], a["dim"], a["keepdim"]
    if not rw.static(x):
        return False
    v = rw.val(x)
    if not v.dtype.is_floating_point:
        return rw.skip(f"a {v.dtype} reduction (max_pool2d takes floats)")
    if v.dim() == 0 or not dims:
        return rw.skip("a 0-d input or a full reduction (no dims)")
    if v.numel() == 0:
        return rw.skip("an empty input")
    ds = sorted({d % v.dim() for d in dims})
    k = math.prod(v.shape[d] for d in ds)
    if k > MAX_WINDOW:
        return rw.skip(f"a window of {k} elements (the BPU pools at most {MAX_WINDOW})")
    neg = node.target is aten.amin.default
    out = rw.inline(_pool_max, x, tuple(ds), bool(keepdim), neg,
                    key=("amax_to_max_pool", tuple(ds), bool(keepdim), neg))
    rw.replace(node, out)
    return True
