"""functional_copy: ``copy(dst, src)`` -> ``src`` (broadcast and cast to ``dst`` if needed).

Why: functionalization turns ``dst.copy_(src)`` into the out-of-place ``copy(dst, src)``,
whose value is ``src`` expanded to ``dst``'s shape in ``dst``'s dtype; ``dst``'s values are never
read. HF's full sliding-window cache does ``keys.copy_(rolled)`` in every layer, and the op is
on no accelerator's operator list.

The result is a ``clone`` (a new tensor, as ``copy``'s is): ``alias_removal`` drops it where no
write and no graph output can tell the difference, with its alias checks.

Does not fire when: devices differ; the destination is not contiguous (the result keeps its
strides).
"""

from __future__ import annotations

import torch

from fxpass import rule
from fxpass.rules._util import CAST, aten


@rule(aten.copy.default, name="functional_copy")
def functional_copy(node, rw) -> bool:
    """copy(dst, src) -> a copy of src, expanded and cast to dst's shape and dtype."""
    dst, src = node.args[:2]
    d, s = rw.val(dst), rw.val(src)
    if d.device != s.device:
        return rw.skip("a copy across devices")
    if not d.is_contiguous():
        return rw.skip("a non-contiguous destination (the result keeps its strides)")
    out = src
    if s.shape != d.shape:
        if not rw.static(dst, src):
            return False
        out = rw.call(aten.expand.default, out, list(d.shape))
    if s.dtype != d.dtype:
        out = rw.call(CAST, out, dtype=d.dtype)
    # a new tensor, as copy's result is: alias_removal drops the clone where no write and no
    # graph output can tell the difference
    rw.replace(node, rw.call(aten.clone.default, out, memory_format=torch.contiguous_format))
    return True
