"""Partition an aten graph into maximal *convex* regions of supported nodes, in near-linear time.

Every region must be contractible to one call, all at once, without a cycle: no path may leave
a region and come back, directly or through other regions (two regions feeding each other are
each convex, yet contract to a cycle). One pass in topological order, with Python-int bitsets
over region ids and union-find for merged regions:

- ``dep`` of a value: the regions it depends on, where depending on any member of a region
  means depending on the whole region (it runs as one call);
- ``taint(n)``: regions ``n`` depends on through something outside them; ``n`` may not join
  those;
- a region that something outside already consumed is *sealed*: it may not gain new
  dependencies, so no earlier ``dep`` can go stale.

A supported node joins (and may merge) the regions of its inputs when that keeps all of the
above; otherwise it starts a region. Stale bits can only make a test stricter, never unsound.
Filters then drop regions with no compute or fewer than ``min_compute_macs``.

Before that pass, CPU nodes are moved down to just before their first user
(:func:`sink_cpu_nodes`): a CPU consumer placed early seals a region that later nodes would
have joined (the BF16 cast of a new KV row for the cache write-back, emitted mid-layer, split a
2-layer BF16 decode step into 3 regions).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from fxpass.partition.cost import macs


@dataclass
class Region:
    id: int
    nodes: list[Node] = field(default_factory=list)
    macs: int = 0
    compute_nodes: int = 0


@dataclass
class Partition:
    regions: list[Region]
    rejected: dict[Node, str]  # node -> why it stays on the CPU
    dropped: list[tuple[Region, str]]  # regions filtered out, with the reason


def partition(
    gm: GraphModule,
    reject_reason: Callable[[Node], str | None],
    min_compute_macs: int = 0,
) -> Partition:
    reasons = {
        n: reject_reason(n) if n.op == "call_function" else "not an op" for n in gm.graph.nodes
    }
    reasons.update(aliased_output_views(gm))
    reasons.update(strided_reads(gm))
    for n in gm.graph.nodes:  # a piece of a tuple made on the CPU is taken there too (a
        # region input is a tensor; found in review: a split on the CPU whose piece joined)
        if (n.op == "call_function" and n.target is operator.getitem
                and isinstance(n.args[0], Node) and reasons.get(n.args[0]) is not None
                and reasons.get(n) is None):
            reasons[n] = "a piece of a tuple made on the CPU"
    sink_cpu_nodes(gm, reasons)
    nodes = list(gm.graph.nodes)
    rejected: dict[Node, str] = {}
    parent: list[int] = []  # union-find over original region ids
    mask: list[int] = []  # root -> bitset of original ids in the class
    ctaint: list[int] = []  # root -> union of taint over members
    cdep: list[int] = []  # root -> regions the class depends on (never its own bits)
    sealed: list[bool] = []  # root -> consumed by a node outside it
    region_of: dict[Node, int] = {}
    dep: dict[Node, int] = {}  # non-region node -> regions it depends on

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for n in nodes:
        ins = n.all_input_nodes
        dep_n = taint = 0
        in_classes: list[int] = []
        for i in ins:
            rid = region_of.get(i)
            if rid is None:
                d = dep.get(i, 0)
                dep_n |= d
                taint |= d
            else:
                root = find(rid)
                dep_n |= cdep[root] | mask[root]
                taint |= cdep[root]
                if root not in in_classes:
                    in_classes.append(root)
        why = reasons[n]
        chosen: list[int] = []
        if why is None:
            m_acc, t_acc, d_acc = 0, taint, dep_n
            for c in in_classes:
                m2, t2, d2 = m_acc | mask[c], t_acc | ctaint[c], d_acc | cdep[c]
                if t2 & m2:
                    continue  # a path leaves c (or a chosen class) and comes back
                grown = d2 & ~m2
                if any(sealed[k] and grown & ~cdep[k] for k in (*chosen, c)):
                    continue  # a consumer of a sealed class would miss the new dependency
                if any(sealed[k] for k in chosen) and c not in chosen and chosen:
                    continue  # merging into a sealed class adds c's nodes to its call
                if sealed[c] and chosen:
                    continue
                chosen.append(c)
                m_acc, t_acc, d_acc = m2, t2, d2
        elif n.op == "call_function":
            rejected[n] = why
        for c in in_classes:
            if c not in chosen:
                sealed[c] = True
        if why is not None:
            dep[n] = dep_n
            continue
        if chosen:
            root = chosen[0]
            for c in chosen[1:]:
                parent[c] = root
                mask[root] |= mask[c]
                ctaint[root] |= ctaint[c]
                cdep[root] |= cdep[c]
            ctaint[root] |= taint
            cdep[root] = (cdep[root] | dep_n) & ~mask[root]
        else:
            root = len(parent)
            parent.append(root)
            mask.append(1 << root)
            ctaint.append(taint)
            cdep.append(dep_n)
            sealed.append(False)
        region_of[n] = root

    by_root: dict[int, Region] = {}
    for n in nodes:
        rid = region_of.get(n)
        if rid is None:
            continue
        root = find(rid)
        reg = by_root.setdefault(root, Region(id=root))
        reg.nodes.append(n)
        k = macs(n)
        reg.macs += k
        reg.compute_nodes += k > 0
    regions, dropped = [], []
    for reg in by_root.values():
        if reg.compute_nodes == 0:
            dropped.append((reg, "no compute (no matmul/convolution)"))
        elif reg.macs < min_compute_macs:
            dropped.append((reg, f"{reg.macs} MACs < min_compute_macs={min_compute_macs}"))
        else:
            regions.append(reg)
    for i, reg in enumerate(regions):
        reg.id = i
    return Partition(regions, rejected, dropped)


_ALIASING = (torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default)


def _is_view(n: Node) -> bool:
    t = n.target
    return n.op == "call_function" and (getattr(t, "is_view", False) or t in _ALIASING)


def aliased_output_views(gm: GraphModule) -> dict[Node, str]:
    """The view nodes that make graph outputs share memory with other outputs, each with the
    reason it stays on the CPU.

    Eager returns ``y, y.view(2, 16), y[0]`` (or the pieces of ``y.chunk(2)``) as tensors
    over one storage: a write to one shows in the others. A region returns every output as
    its own buffer, so these views are made on the CPU from the region's output of their base
    (zero-copy; found by a probe, where the outputs came back as independent copies). A view
    the graph also uses inside is copied for the output first, so the region keeps its own
    (pinning it to the CPU split the region at it). One view of an internal tensor aliases
    nothing the caller sees and stays in the region."""
    out = next(iter(gm.graph.find_nodes(op="output")), None)
    if out is None:
        return {}
    groups: dict[Node, list[list[Node]]] = {}  # base -> the view chain of each output of it
    for o in _flat(out.args):
        base, chain = _view_chain(o)
        groups.setdefault(base, []).append(chain)
    shared = [(base, chain) for base, chains in groups.items() if len(chains) > 1
              for chain in chains if chain]
    allowed = {n for _, chain in shared for n in chain} | {out}
    why = ("returned beside another output over the same memory: made on the CPU from the "
           "region's output, so the outputs alias as in eager")
    marked: dict[Node, str] = {}
    for base, chain in shared:
        if all(set(n.users) <= allowed for n in chain):
            marked.update(dict.fromkeys(chain, why))
            continue
        # used inside too: the output gets its own
        new = _copy_chain(gm, base, chain, out, why, marked)
        out.replace_input_with(chain[0], new)
    return marked


def _view_chain(o: object) -> tuple[object, list[Node]]:
    """(base, chain): the views that make ``o`` from a tensor that is no view, ``o`` first:
    views, and pieces of a view op's tuple (split, chunk, unbind)."""
    chain = []
    while isinstance(o, Node) and o.op == "call_function" and o.args and isinstance(
            o.args[0], Node) and (_is_view(o) or (
            o.target is operator.getitem and _is_view(o.args[0]))):
        chain.append(o)
        o = o.args[0]
    return o, chain


def _copy_chain(gm: GraphModule, base: Node, chain: list[Node], before: Node, why: str,
                marked: dict[Node, str]) -> Node:
    """A copy of the view ``chain`` (``_view_chain``'s order) over ``base``, inserted before
    ``before``, its nodes marked for the CPU; returns its last view."""
    new = base
    with gm.graph.inserting_before(before):
        for n in reversed(chain):
            new = gm.graph.call_function(n.target, (new, *n.args[1:]), dict(n.kwargs))
            new.meta = dict(n.meta)
            marked[new] = why
    return new


#: ops that address their input's *storage* (sizes, strides and an offset into it), not its
#: elements: what they read depends on the input's memory layout, not only on its values
_ADDRESSING = (torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_copy.default,
               torch.ops.aten.as_strided_scatter.default)


def restrided(x: torch.Tensor, stride: list[int], offset: int) -> torch.Tensor:
    """``x`` with its values laid out in memory as eager lays them out (``stride`` and
    ``offset`` into a storage of its own); ``x`` itself when it already is."""
    if list(x.stride()) == list(stride) and x.storage_offset() == offset:
        return x
    span = 1 + sum((d - 1) * st for d, st in zip(x.shape, stride, strict=True)) if x.numel() else 0
    out = x.new_empty(offset + span).as_strided(x.shape, stride, offset)
    return out.copy_(x)


def strided_reads(gm: GraphModule) -> dict[Node, str]:
    """Lay out in eager's memory layout every tensor whose layout decides what an op reads:
    returns the nodes added, each with the reason it runs on the CPU.

    ``as_strided(y, size, stride, offset)`` addresses ``y``'s storage. A region returns its
    outputs contiguous, and torch ops on the CPU lay out their results after their inputs, so
    ``y`` may hold eager's values in another layout; as_strided then reads other elements
    (found by a probe: Longformer's sliding-chunk attention as_strides a transposed
    projection, 1.4e-2 off with no warning). So the reader's view chain is rebuilt on the CPU
    over its base (the tensor that is no view), and the base is first copied into eager's
    strides and offset (:func:`restrided`, a no-op when it already has them). A graph input
    has the caller's own layout and needs neither."""
    marked: dict[Node, str] = {}
    laid_out: dict[Node, Node] = {}  # base -> its copy in eager's layout
    why = ("read by as_strided, which addresses memory: laid out on the CPU as eager lays "
           "it out")
    for a in list(gm.graph.nodes):
        if a.op != "call_function" or a.target not in _ADDRESSING or not isinstance(
                a.args[0], Node) or not a.users:
            continue
        base, chain = _view_chain(a.args[0])
        val = base.meta.get("val") if isinstance(base, Node) else None
        if isinstance(val, torch.Tensor) and not all(
                isinstance(v, int) for v in (*val.stride(), val.storage_offset())):
            continue  # symbolic strides: no region runs such a graph (static shapes only)
        if not isinstance(val, torch.Tensor) or base.op == "placeholder":
            if chain:  # views of an input: made on the CPU, over the input itself
                marked.update(dict.fromkeys(chain, why))
            continue
        laid = laid_out.get(base)
        if laid is None:  # one copy per base, before its first reader, for every reader
            with gm.graph.inserting_before(a):
                laid = laid_out[base] = gm.graph.call_function(
                    restrided, (base, list(val.stride()), val.storage_offset()))
            laid.meta = dict(base.meta)
            marked[laid] = why
        new = _copy_chain(gm, laid, chain, a, why, marked)
        a.replace_input_with(a.args[0], new)
        for n in chain:  # the originals, where nothing else reads them
            if not n.users:
                gm.graph.erase_node(n)
    return marked


def _flat(args: object) -> list[Node]:
    nodes: list[Node] = []
    torch.fx.node.map_arg(args, nodes.append)
    return nodes


_MUTABLE: dict[object, bool] = {}  # OpOverload -> whether its schema writes an argument


def _mutable(t: object) -> bool:
    m = _MUTABLE.get(t)
    if m is None:
        m = _MUTABLE[t] = isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable
    return m


def _movable(n: Node) -> bool:
    """A call that may run later than written: pure, deterministic, and used."""
    t = n.target
    if not n.users:
        return False
    if isinstance(t, torch._ops.OpOverload):
        return not _mutable(t) and torch.Tag.nondeterministic_seeded not in t.tags
    return t is operator.getitem


def sink_cpu_nodes(gm: GraphModule, reasons: dict[Node, str | None]) -> int:
    """Move each pure CPU call down to just before its first user; returns how many moved.

    One pass in graph order: a movable rejected node is held back and emitted right before
    the first node that reads it. Any other call is not moved, so an op with effects (a cache
    write, an assert, a random op) keeps its place among them, and every held node is
    emitted before the next in-place op: no node moves past a write (storage identity of
    fake values is not kept by rewrites, so aliasing is not guessed). The cache write-backs a
    decode step ends with are where the held casts of its new K/V rows were going anyway.
    Linear: each node is held and emitted once; no recursion (a long CPU chain is fine).
    """
    held: dict[Node, None] = {}  # insertion (graph) order
    order: list[Node] = []

    def emit(root: Node) -> None:
        stack = [(root, False)]
        while stack:
            n, ready = stack.pop()
            if ready:
                order.append(n)
                continue
            if n is not root:
                if n not in held:  # emitted meanwhile, through another reader
                    continue
                del held[n]
            stack.append((n, True))
            for i in reversed(n.all_input_nodes):  # the first input is emitted first
                if i in held:
                    stack.append((i, False))

    for n in gm.graph.nodes:
        if n.op == "call_function" and reasons.get(n) is not None and _movable(n):
            held[n] = None
            continue
        if held and n.op == "call_function" and _mutable(n.target):
            for h in list(held):
                if h in held:
                    del held[h]
                    emit(h)
        if held:
            emit(n)
        else:
            order.append(n)
    assert not held, "every held node has a user, emitted before it"
    moved = 0
    prev = None
    for n in order:
        if prev is not None and prev.next is not n:
            prev.append(n)
            moved += 1
        prev = n
    return moved


def is_convex(gm: GraphModule, members: set[Node]) -> bool:
    """Reference check (quadratic-free BFS): no path leaves ``members`` and re-enters them."""
    outside_from_region: set[Node] = set()
    for n in gm.graph.nodes:  # topological order
        if n in members:
            if any(i in outside_from_region for i in n.all_input_nodes):
                return False
        elif any(i in members or i in outside_from_region for i in n.all_input_nodes):
            outside_from_region.add(n)
    return True
