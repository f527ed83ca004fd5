"""A step's state writes, made cheap: one copy for all of a step's cache and counter writes,
and no write to state that no program reads.

Why: a decode step writes each layer's new key and value into the static cache
(``index_copy_`` at the step's position, two per layer) and bumps a length counter per layer
that nothing reads (transformers' static cache keeps it for its own bookkeeping). Run after
the device region, each of those small ops costs around ten microseconds cold: a quarter of
the step's time outside the region on a 4-layer model.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from operator import getitem
from typing import Any

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten

#: view sets kept per fused call (one per combination of positions); past it, they are rebuilt
MAX_VIEWS = 8192


class StateWrites:
    """A step's trailing writes into its inputs, in one call: ``dst.copy_(src)`` (a length
    counter) and ``dst.index_copy_(dim, index, src)`` at one position (a KV cache), each into a
    different tensor. When every write is a plain same-shape copy or a one-position write in
    range, they become one ``torch._foreach_copy_`` (into views of the caches at their
    positions, kept per combination of positions); anything else runs each op as the graph
    would, in order (and raises as it would)."""

    __name__ = __qualname__ = "state_writes"

    def __init__(self, dims: tuple[int | None, ...]):
        self.dims = dims  # per write: the index_copy_'s dim, or None for a copy_
        self.views: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    def __call__(self, *args: torch.Tensor | None) -> None:
        writes, k = [], 0
        for dim in self.dims:  # (dim, index, dst, src) with index None for a copy_
            if dim is None:
                writes.append((None, None, args[k], args[k + 1]))
                k += 2
            else:
                if args[k + 2] is not None:  # None: a row the region's kernel wrote itself
                    writes.append((dim, args[k], args[k + 1], args[k + 2]))
                k += 3
        if not writes:
            return
        at: dict[int, int | None] = {}  # one read per index tensor (a step passes one to all)
        for _, i, _, _ in writes:
            if i is not None and id(i) not in at:
                at[id(i)] = int(i) if i.numel() == 1 else None
        key = tuple((id(d), None if i is None else at[id(i)]) for _, i, d, _ in writes)
        views = self.views.get(key)
        if views is None and all(_fast(*w) for w in writes):
            if len(self.views) >= MAX_VIEWS:
                self.views.clear()
            views = self.views[key] = [d if i is None else d.narrow(dim, int(i), 1)
                                       for dim, i, d, _ in writes]
        if views is not None:
            torch._foreach_copy_(views, [s for *_, s in writes])
            return
        for dim, i, d, s in writes:  # anything else: the ops themselves (and their errors)
            if i is None:
                d.copy_(s)
            else:
                d.index_copy_(dim, i, s)


def _fast(dim: int | None, index: torch.Tensor | None, d: torch.Tensor,
          s: torch.Tensor) -> bool:
    if d.dtype != s.dtype:
        return False
    if index is None:
        return d.shape == s.shape
    if index.numel() != 1 or index.dtype != torch.int64 or s.dim() != d.dim() or (
            s.shape[dim] != 1):
        return False
    i = int(index)
    return 0 <= i < d.shape[dim] and all(
        a == b for k, (a, b) in enumerate(zip(d.shape, s.shape, strict=True)) if k != dim)


def fuse_index_writes(gm: GraphModule) -> int:
    """Replace the writes into placeholders (``copy_``, ``index_copy_`` with an int dim),
    results unused, each the last use of its placeholder and no two into one, by one
    :class:`StateWrites` call at the last of them. Returns how many writes were fused."""
    g = gm.graph
    order = {n: k for k, n in enumerate(g.nodes)}
    found: dict[Node, list[Node]] = {}
    for n in g.nodes:
        if not _writes(n) or n.users or not isinstance(n.args[0], Node):
            continue
        if n.args[0].op != "placeholder":
            continue
        if n.target is not aten.copy_.default and not (
                isinstance(n.args[1], int) and isinstance(n.args[2], Node)):
            continue
        found.setdefault(n.args[0], []).append(n)
    writes = [ws[0] for dst, ws in found.items() if len(ws) == 1 and all(
        order[u] <= order[ws[0]] for u in dst.users)]  # nothing reads it after the write
    if len(writes) < 2:
        return 0  # (in graph order: each destination was found at its one write)
    dims: list[int | None] = []
    args: list[Any] = []
    for n in writes:
        if n.target is aten.copy_.default:
            dims.append(None)
            args += [n.args[0], n.args[1]]
        else:
            dst, dim, index, src = n.args
            dims.append(dim)
            args += [index, dst, src]
    with g.inserting_after(writes[-1]):
        g.call_function(StateWrites(tuple(dims)), tuple(args))
    for n in writes:
        g.erase_node(n)
    gm.recompile()
    return len(writes)


def grant_in_place(gm: GraphModule, executor_of: Callable[[Node], Any]) -> int:
    """Let each region call's executor write into the inputs it asks to (``in_place_inputs``,
    a decode step's KV cache updated by its attention kernel) where the program would write
    that input itself right after: the input is a placeholder passed to the call once; every
    other user of it, before or after, is a write into it (``copy_``/``index_copy_``) that
    follows the call; and at least one of them writes a value the call returned (the cache
    write-back of the row the region computed). Returns how many inputs were granted.

    Why: the kernel then writes the new row into the cache itself instead of copying the
    whole cache into a new output every step (``backends/onnx/host/decode_attention.py``).
    A view or any read of the input anywhere, or no write-back, keeps it out. Run before
    ``fuse_index_writes``, which hides the writes in one call."""
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    granted = 0
    for n in gm.graph.nodes:
        ex = executor_of(n) if n.op in ("call_function", "call_module") else None
        wants = getattr(ex, "in_place_inputs", None)
        if wants is None:
            continue
        returned = {u for u in n.users if u.op == "call_function" and u.target is getitem}
        ok = set()
        for i in wants():
            a = n.args[i] if i < len(n.args) else None
            if not (isinstance(a, Node) and a.op == "placeholder") or (
                    sum(x is a for x in n.args) != 1 or n.kwargs):
                continue
            others = [u for u in a.users if u is not n]
            writes = [u for u in others if _writes(u) and u.args[0] is a and (
                a not in u.args[1:]) and order[u] > order[n]]
            if len(writes) == len(others) and any(w.args[-1] in returned for w in writes):
                ok.add(i)
        rows = getattr(ex, "in_place_rows", None)
        if rows is None:
            ex.grant(ok)
        else:
            ex.grant(ok, _written_rows(n, rows(), ok))
        granted += len(ok)
    return granted


def written_rows(gm: GraphModule) -> int:
    """How many write-backs of ``gm`` its region's kernel may do itself (``_written_rows``)."""
    return len(gm.graph.find_nodes(op="call_function", target=index_copy_unless_written))


def index_copy_unless_written(dst: torch.Tensor, dim: int, index: torch.Tensor,
                              src: torch.Tensor | None) -> None:
    """``dst.index_copy_(dim, index, src)``, or nothing when ``src`` is None: the region's
    kernel wrote that row into ``dst`` itself (``_written_rows``)."""
    if src is not None:
        dst.index_copy_(dim, index, src)


def _written_rows(call: Node, rows: dict[int, tuple[int, int]], granted: set[int]) -> set[int]:
    """The region outputs ``call``'s executor may return as None, its write-backs made
    ``index_copy_unless_written``: for a granted input whose one write after the call is
    ``index_copy_`` along the executor's axis of output ``j`` (``in_place_rows``: the row its
    kernel writes into that input, at the position the program writes it), read by nothing
    else. The kernel then wrote that row there already; on a call the region answers
    otherwise (its eager fallback), the output is a tensor and the write runs.

    Why: a decode step of a 4-layer model returned eight rows and wrote them back, eight
    outputs and a copy each, for values its kernel had just written."""
    written = set()
    for i in granted:
        if i not in rows:
            continue
        j, axis = rows[i]
        others = [u for u in call.args[i].users if u is not call]
        if len(others) != 1:
            continue
        (w,) = others
        src = w.args[-1] if w.target is aten.index_copy_.default else None
        val = call.args[i].meta.get("val")
        dim = w.args[1] % val.dim() if isinstance(val, torch.Tensor) and isinstance(
            w.args[1], int) else w.args[1]
        if (isinstance(src, Node) and src.op == "call_function" and src.target is getitem
                and src.args == (call, j) and len(src.users) == 1 and dim == axis
                and not w.users):
            w.target = index_copy_unless_written
            written.add(j)
    if written:
        call.graph.owning_module.recompile()
    return written


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
    return n.op == "call_function" and n.target in (
        aten.copy_.default, aten.index_copy_.default, index_copy_unless_written)
