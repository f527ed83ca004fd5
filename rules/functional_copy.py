"""functional_copy: ``copy(dst, src)`` -> ``src`` (broadcast and cast to ``dst`` if needed).

Why: functionalization turns ``dst.copy_(src)`` into the out-of-place ``copy(dst, src)``,
whose value is ``src`` expanded to ``dst``'s shape in ``dst``'s dtype; ``dst``'s values are never
read. HF's full sliding-window cache does ``keys.copy_(rolled)`` in every layer, and the op is
on no accelerator's operator list.

Does not fire when: anything writes to the result or to ``src`` (the result would alias it); the
result is a graph output and ``src`` a graph input (the caller would get its own input back);
devices differ.
"""

from __future__ import annotations

import torch

from fxpass import rule
from fxpass.graph import same_layout
from fxpass.rules._util import CAST, aten, mutated


@rule(aten.copy.default, name="functional_copy")
def functional_copy(node, rw) -> bool:
    """copy(dst, src) -> src, expanded and cast to dst's shape and dtype."""
    dst, src = node.args[:2]
    d, s = rw.val(dst), rw.val(src)
    if d.device != s.device:
        return rw.skip("a copy across devices")
    if mutated(node) or mutated(src):
        return rw.skip("something writes to the copy or its source")
    out = src
    if s.shape != d.shape:
        if not rw.static(dst, src):
            return False
        # a contiguous copy of the broadcast, as copy's result is laid out like dst
        out = rw.call(aten.expand.default, out, list(d.shape))
        out = rw.call(aten.clone.default, out, memory_format=torch.contiguous_format)
    elif not same_layout(d, s):
        return rw.skip("src is laid out unlike dst (a later view may need dst's strides)")
    if s.dtype != d.dtype:
        out = rw.call(CAST, out, dtype=d.dtype)
    if out is src and src.op == "placeholder" and any(u.op == "output" for u in node.users):
        return rw.skip("would make a graph output alias a graph input")
    rw.replace(node, out)
    return True
