"""A step's state writes, made cheap: one copy for all of a step's cache writes, and no write
to state that no program reads.

Why: a decode step writes each layer's new key and value into the static cache
(``index_copy_`` at the step's position, two per layer) and bumps a length counter per layer
that nothing reads (transformers' static cache keeps it for its own bookkeeping). Run after
the device region, each of those small ops costs around ten microseconds cold: a quarter of
the step's time outside the region on a 4-layer model.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten

#: views kept per fused write (a position's view of each cache); past it, they are rebuilt
MAX_VIEWS = 8192


class IndexWrites:
    """``dst.index_copy_(dim, index, src)`` for every (dst, src) pair, for one index: with a
    one-element index, a single ``torch._foreach_copy_`` into each destination's view at that
    position (the views kept per position); with any other index, ``index_copy_`` each."""

    __name__ = __qualname__ = "index_writes"

    def __init__(self, dim: int):
        self.dim = dim
        self.views: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def __call__(self, index: torch.Tensor, *pairs: torch.Tensor) -> None:
        dsts, srcs = pairs[0::2], pairs[1::2]
        if index.numel() == 1:
            i = int(index)
            key = (i, *map(id, dsts))
            views = self.views.get(key)
            if views is None and all(0 <= i < d.shape[self.dim] for d in dsts) and all(
                    d.dtype == s.dtype and s.shape[self.dim] == 1 for d, s in zip(
                        dsts, srcs, strict=True)):
                if len(self.views) >= MAX_VIEWS:
                    self.views.clear()
                views = self.views[key] = [d.narrow(self.dim, i, 1) for d in dsts]
            if views is not None:
                torch._foreach_copy_(views, list(srcs))
                return
        for d, s in zip(dsts, srcs, strict=True):  # anything else: the op itself (and its errors)
            d.index_copy_(self.dim, index, s)


def fuse_index_writes(gm: GraphModule) -> int:
    """Replace the ``index_copy_`` writes into placeholders that share one index and dim, and
    whose results are unused, by one :class:`IndexWrites` call at the last of them. Returns
    how many writes were fused."""
    g = gm.graph
    groups: dict[tuple[Node, int], list[Node]] = {}
    for n in g.find_nodes(op="call_function", target=aten.index_copy_.default):
        dst, dim, index, _src = n.args
        if isinstance(dst, Node) and dst.op == "placeholder" and not n.users and isinstance(
                index, Node) and isinstance(dim, int):
            groups.setdefault((index, dim), []).append(n)
    fused = 0
    for (index, dim), nodes in groups.items():
        if len(nodes) < 2:
            continue
        if len({n.args[0] for n in nodes}) != len(nodes):
            continue  # two writes into one cache: their order matters, leave them
        args: list[Any] = [index]
        for n in nodes:
            args += [n.args[0], n.args[3]]
        with g.inserting_after(nodes[-1]):
            g.call_function(IndexWrites(dim), tuple(args))
        for n in nodes:
            g.erase_node(n)
        fused += len(nodes)
    if fused:
        gm.recompile()
    return fused


def state_reads(gm: GraphModule, state: list[str]) -> set[str]:
    """Which of the placeholders named ``state`` ``gm`` reads (anything but a write into it)."""
    phs = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    read = set()
    for name in state:
        for u in phs[name].users:  # a write whose result is used reads it as well
            if not (_writes(u) and u.args[0] is phs[name]) or u.users:
                read.add(name)
    return read


def drop_writes(gm: GraphModule, names: Collection[str]) -> int:
    """Erase the writes (``copy_``/``index_copy_`` into the placeholder, result unused) into
    the placeholders ``names``: state that no program of the package reads."""
    dropped = 0
    for n in list(gm.graph.nodes):
        if _writes(n) and not n.users and isinstance(n.args[0], Node) and (
                n.args[0].op == "placeholder" and n.args[0].name in names):
            gm.graph.erase_node(n)
            dropped += 1
    if dropped:
        gm.recompile()
    return dropped


def _writes(n: Node) -> bool:
    return n.op == "call_function" and n.target in (aten.copy_.default, aten.index_copy_.default)
