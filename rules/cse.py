"""cse: common subexpression elimination of pure aten nodes.

Before -> after: two nodes with the same target, arguments and keyword arguments -> the first
one, used by both.

Why: rules expand ops independently (the KV-cache rule builds one position mask per cache
write, SDPA decomposes per layer), so identical index arithmetic and masks repeat. Each copy
left on the CPU costs a dispatch per call, and each one that feeds a region is one more
region input; on a decode step those add up to a large share of fxpass's own time.

Does not fire when: the node is impure (random, in-place, ``copy_``); a node reads a value
that something in the graph writes to, or a view of such a value (two reads on either side of
a write differ even with equal arguments); an argument is unhashable.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from fxpass import graph_rule
from fxpass.graph import is_view, writes


def _key(x: Any) -> Any:
    """A hashable stand-in for an argument: lists become tuples (aten's ``int[]``)."""
    if isinstance(x, (list, tuple)):
        return tuple(_key(i) for i in x)
    return x


#: aten ops FX itself treats as side-effectful (asserts, profiler marks): never merged
_SIDE_EFFECTS = frozenset(torch.fx.node._side_effectful_functions)


@functools.cache
def _pure_target(target: Any) -> bool:
    """Whether calls of ``target`` may merge: no writes, not random (per target, cached:
    ``Node.is_impure`` per node was most of this rule's cost)."""
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or writes(target):
        return False  # python callables (setitem, ...) and higher-order ops: never merged
    if target._schema.is_mutable or target in _SIDE_EFFECTS:
        return False
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded not in tags and not getattr(
        target, "_nondeterministic_seeded", False
    )


def _written(gm: GraphModule) -> set[Node]:
    """Values written by some op, with everything aliasing them (bases and views)."""
    out: set[Node] = set()
    stack = [
        a
        for n in gm.graph.nodes
        if n.op == "call_function" and writes(n.target)
        for a in _written_args(n)
    ]
    while stack:
        v = stack.pop()
        if v in out:
            continue
        out.add(v)
        if v.op == "call_function" and is_view(v.target):
            stack.extend(v.all_input_nodes)  # the base this view aliases
        stack.extend(u for u in v.users if u.op == "call_function" and is_view(u.target))
    return out


def _written_args(n: Node) -> list[Node]:
    """The arguments ``n``'s schema marks as written (``self`` of ``index_copy_``, ``out=``)."""
    schema = n.target._schema
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        v = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
        out.extend(x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, Node))
    return out


@graph_rule(name="cse")
def cse(gm: GraphModule, rw) -> bool:
    """Identical pure nodes (same target and arguments) -> one node."""
    written = _written(gm)
    seen: dict[Any, Node] = {}
    changed = False
    for n in gm.graph.nodes:
        if n.op != "call_function" or n in written or not _pure_target(n.target):
            continue
        if written and any(i in written for i in n.all_input_nodes):
            continue
        key = (n.target, _key(n.args), tuple((k, _key(v)) for k, v in n.kwargs.items()))
        try:
            first = seen.setdefault(key, n)
        except TypeError:  # an unhashable argument
            continue
        if first is not n:
            rw.replace(n, first)
            changed = True
    return changed
