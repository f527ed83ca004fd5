"""new_full: ``x.new_ones(size)`` / ``new_zeros`` / ``new_full`` -> ``full(size, v, dtype)``.

Why: the ``new_*`` factories take ``x`` only for its dtype and device, but ``x`` is a graph
input to them, so constant folding (which folds what depends on no input) could not fold them
and they stayed on the CPU, where a region needed the constant (Funnel builds its attention
masks with ``new_ones``, 2 per forward). ``full`` with the dtype written out depends on
nothing and folds.

Exact: the same values, dtype, device and shape. Left alone: symbolic sizes, a non-strided
layout or pinned memory.
"""

from __future__ import annotations

import torch

from fxpass import rule
from fxpass.graph import bind_args
from fxpass.rules._util import aten

_FILL = {aten.new_ones.default: 1, aten.new_zeros.default: 0}


@rule(aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, name="new_full")
def new_full(node, rw) -> bool:
    """x.new_*(size) -> full(size, value) with x's dtype and device made explicit."""
    a = bind_args(node)
    fill = _FILL.get(node.target, a.get("fill_value"))
    if a["layout"] not in (None, torch.strided) or a["pin_memory"]:
        return rw.skip("a layout or pinned memory other than the default")
    if not rw.static(node):
        return False
    out = rw.val(node)
    rw.replace(node, rw.call(aten.full.default, list(out.shape), fill, dtype=out.dtype,
                             device=out.device))
    return True
