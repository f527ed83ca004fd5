"""kv_cache_update: an in-place KV-cache write -> an out-of-place read and a small write-back.

Before (a static cache, as AOTAutograd hands it over with input mutations kept in the graph)::

    upd = index_copy(cache, d, pos, new)        # the whole cache, rewritten every step
    ... attention reads upd ...
    copy_(cache, upd)                           # write-back of the whole cache

After::

    hit = arange(S) == pos                      # integer index arithmetic (host side)
    upd = where(hit, new, cache)                # L == 1 (decode): one position
    upd = where(any(hit), hit @ new, cache)     # L > 1 (prefill): one-hot spread, exact
    ... attention reads upd ...
    index_copy_(cache, d, pos, new)             # writes only the L new positions, in place

Why: ``index_copy`` is in no accelerator's operator table, so every layer's cache write split
the device region (a 4-layer decoder became 5 regions). ``where``, ``eq``, ``any`` and
``matmul`` are standard; the mask depends only on positions, so it is computed beside the
embedding and enters the region as an input. The mask reads the positions through
``index_select``, so a position outside the cache raises as eager's ``index_copy`` does, also
when there is no write-back (a cache created inside the graph). The write-back touches L
slots instead of copying S (AOTAutograd's epilogue copied the whole cache).

Exactness: L == 1 selects values; L > 1 multiplies by a 0/1 matrix, which is exact for finite
values (``x * 1 + 0 * y``); a NaN or inf *in the new keys/values* would spread to the other
new positions of that step (eager's attention output is non-finite there anyway).

Without a write-back (a cache created inside the graph, as on the prefill call that allocates
it) the same out-of-place form replaces ``index_copy`` and the region returns the new cache.

Does not fire (with the reason in the report): the updated cache is a graph output aliasing a
graph input (AOTAutograd without kept input mutations: the whole tensor must leave the graph);
shapes are symbolic; ``pos`` is not a 1-D integer tensor; more than one position on a
non-float cache; a 0-dim cache, or several positions into a 1-D cache (found by the fuzz
benchmark's OpInfo sweep: these raised inside the rule and failed the compile).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from fxpass import rule
from fxpass.rules._util import aten


def _out_of_place(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor, dim: int):
    size = cache.shape[dim]
    shape = [1] * cache.dim()
    shape[dim] = size
    slots = torch.arange(size, dtype=pos.dtype, device=pos.device)
    # index_select raises on a position outside the cache, as eager's index_copy does: a
    # prompt longer than the cache is an error, never silently dropped keys
    hit = slots.unsqueeze(-1) == slots.index_select(0, pos)  # [S, L]
    if new.shape[dim] == 1:
        return torch.where(hit.view(shape), new, cache)
    spread = torch.matmul(hit.to(new.dtype), new.movedim(dim, -2)).movedim(-2, dim)
    return torch.where(hit.any(-1).view(shape), spread, cache)


@rule(aten.index_copy.default, name="kv_cache_update")
def kv_cache_update(node: Node, rw) -> bool:
    """index_copy(cache) + copy_ write-back -> where(arange == pos, new, cache) + index_copy_."""
    cache, dim, pos, new = node.args
    if not rw.static(cache, pos, new):
        return False
    p, c, v = rw.val(pos), rw.val(cache), rw.val(new)
    if p.dim() != 1 or p.dtype not in (torch.int64, torch.int32):
        return rw.skip("positions are not a 1-D integer tensor")
    if c.dim() == 0 or v.dim() != c.dim():
        return rw.skip("a 0-dim cache, or new values of another rank than the cache")
    dim = dim % c.dim()
    if v.shape[dim] > 1 and c.dim() < 2:
        return rw.skip("several positions into a 1-D cache (the spread needs a matrix)")
    if v.shape[dim] > 1 and not v.dtype.is_floating_point:
        return rw.skip("several positions into a non-float cache (the spread needs a matmul)")
    write_backs = [
        u for u in node.users if u.target is aten.copy_.default and u.args[:2] == (cache, node)
    ]
    returned = any(u.op == "output" for u in node.users)
    is_input = cache.op == "placeholder" and rw.constant(cache) is None
    if is_input and returned:
        return rw.skip(
            "the updated cache is a graph output aliasing an input: the whole tensor must leave "
            "the graph; capture with input mutations kept (fxpass.capture does) so the "
            "write-back is an in-graph copy_"
        )
    if len(write_backs) > 1:
        return rw.skip("the update is written back more than once")
    upd = rw.inline(_out_of_place, cache, pos, new, dim, key=("kv_cache_update", dim))
    if write_backs:  # the in-place write of the L new slots replaces the whole-cache copy_
        rw.retarget(write_backs[0], aten.index_copy_.default, cache, dim, pos, new)
    rw.replace(node, upd)
    return True
