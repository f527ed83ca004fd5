"""Memoized position subgraphs: CPU ops that depend on one small integer input only run once
per distinct value of it.

Why: a decode step's CPU ops are mostly a function of ``cache_position`` alone: the rotary
cos/sin, the causal mask, the cache write index. Run after the device region has streamed the
weights through the caches, each of those small ops costs several microseconds cold, about
half of the step's time outside the region. Their values depend on the position only, so
``memoize`` moves that subgraph into one callable that computes it the first time it sees a
position and returns the stored tensors from then on: a dictionary lookup per step.

What may be memoized: pure aten ops (no mutable schema, no random op) whose only non-constant
input is the key (weights and lifted constants are constants; state is not). Outputs returned
to the caller or written in place are left out, and stored tensors are private copies, so no
caller can change what a later call gets. Memory is bounded (``budget`` bytes per memoized
subgraph); past it, values are computed and not stored.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

#: a subgraph of fewer ops is not worth a lookup
MIN_OPS = 3
#: stored bytes per memoized subgraph
BUDGET = 32 << 20


def _mutates(n: Node) -> bool:
    t = n.target
    return n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and (
        t._schema.is_mutable)


def _pure(n: Node) -> bool:
    t = n.target
    if n.op != "call_function":
        return False
    if t is operator.getitem:
        return True
    return isinstance(t, torch._ops.OpOverload) and not t._schema.is_mutable and (
        torch.Tag.nondeterministic_seeded not in t.tags)


class Memo:
    """``fn(key, *constants)`` stored per value of ``key`` (its shape, dtype and bytes)."""

    def __init__(self, fn: Callable[..., Any], budget: int = BUDGET):
        self.fn, self.budget = fn, budget
        self.__name__ = self.__qualname__ = "memo"  # fx names the call after it
        self.table: dict[Any, tuple[Any, ...]] = {}
        self.stored = 0

    def __call__(self, key: torch.Tensor, *constants: Any) -> tuple[Any, ...]:
        k = (key.shape, key.dtype, key.numpy().tobytes())
        hit = self.table.get(k)
        if hit is not None:
            return hit
        outs = tuple(o.clone() if isinstance(o, torch.Tensor) else o
                     for o in self.fn(key, *constants))
        size = sum(o.nbytes for o in outs if isinstance(o, torch.Tensor))
        if self.stored + size <= self.budget:
            self.table[k] = outs
            self.stored += size
        return outs


def memoize(gm: GraphModule, keys: Sequence[str], constants: Collection[str],
            budget: int = BUDGET) -> list[Memo]:
    """Memoize, in ``gm`` (in place), the subgraph that depends on each placeholder named in
    ``keys`` and on ``constants`` (placeholder names) and attributes only. Returns the memos.
    A key the graph writes (a counter bumped in place) is taken only when every other read of
    it comes before its first write: the memo reads the value the graph starts with."""
    g = gm.graph
    phs = {n.name: n for n in g.find_nodes(op="placeholder")}
    memos = []
    for name in keys:  # each memo adds nodes: what depends on what is read afresh
        if not read_before_written(phs[name]):
            continue
        written = {n.args[0] for n in g.nodes if _mutates(n) and isinstance(n.args[0], Node)}
        memo = _memoize_one(gm, phs[name], _dependencies(g, constants, written), written,
                            budget)
        if memo is not None:
            memos.append(memo)
    if memos:
        gm.recompile()
    return memos


def read_before_written(p: Node) -> bool:
    """Whether every use of ``p`` that is not a write into it precedes the first write."""
    order = {n: i for i, n in enumerate(p.graph.nodes)}
    writes = [order[u] for u in p.users if _mutates(u) and u.args and u.args[0] is p]
    if not writes:
        return True
    return all(order[u] < min(writes) for u in p.users if order[u] not in writes)


def _dependencies(g: Graph, constants: Collection[str],
                  written: set[Node]) -> dict[Node, frozenset[Node]]:
    """Per node, the non-constant nodes its value depends on (a written node, an impure one
    and a non-constant placeholder depend on themselves)."""
    dyn: dict[Node, frozenset[Node]] = {}
    for n in g.nodes:
        if n in written:
            dyn[n] = frozenset([n])
        elif n.op == "placeholder":
            dyn[n] = frozenset() if n.name in constants else frozenset([n])
        elif n.op == "get_attr":
            dyn[n] = frozenset()
        elif _pure(n):
            dyn[n] = frozenset().union(*(dyn[a] for a in n.all_input_nodes))
        else:
            dyn[n] = frozenset([n])
    return dyn


def _memoize_one(gm: GraphModule, key: Node, dyn: dict[Node, frozenset[Node]],
                 written: set[Node], budget: int) -> Memo | None:
    g = gm.graph
    sub: set[Node] = set()
    for n in reversed(g.nodes):
        if n.op != "call_function" or not _pure(n) or n in written:
            continue
        if dyn[n] == {key} or (not dyn[n] and n.users and all(u in sub for u in n.users)):
            sub.add(n)
    # what leaves the subgraph must not be returned to the caller: it would be shared
    for n in list(g.nodes):
        if n in sub and any(u.op == "output" for u in n.users):
            sub.discard(n)
    ordered = [n for n in g.nodes if n in sub]
    if sum(1 for n in ordered if n.target is not operator.getitem and dyn[n]) < MIN_OPS:
        return None
    outs = [n for n in ordered if dyn[n] and any(u not in sub for u in n.users)]
    if not outs:
        return None
    # the memo's graph: the key, then the constant placeholders / attributes it reads
    sg = Graph()
    env: dict[Node, Node] = {key: sg.placeholder("key")}
    externals = [key]
    def take(n: Node) -> None:
        for a in n.all_input_nodes:
            if a in env:
                continue
            if a in sub or (_pure(a) and a not in written and dyn[a] <= {key}):
                take(a)  # computed outside as well (a constant, a returned value): again inside
            else:
                env[a] = sg.placeholder(f"c{len(externals)}")
                externals.append(a)
        env[n] = sg.node_copy(n, env.__getitem__)

    for n in ordered:
        if n not in env:
            take(n)
    sg.output(tuple(env[o] for o in outs))
    fn = GraphModule(torch.nn.Module(), sg)
    memo = Memo(fn, budget)
    first = next(n for n in g.nodes if n.op not in ("placeholder", "get_attr"))
    with g.inserting_before(first):
        call = g.call_function(memo, tuple(externals))
        gets = [g.call_function(operator.getitem, (call, i)) for i in range(len(outs))]
    for o, get in zip(outs, gets, strict=True):
        o.replace_all_uses_with(get)
    for n in reversed(ordered):
        if not n.users:
            g.erase_node(n)
    return memo


def memoize_inputs(gm: GraphModule, n_weights: int, n_state: int,
                   inputs: Sequence[int]) -> list[Memo]:
    """``memoize`` for a program's runtime graph, whose placeholders are its weights, its
    state, then its user inputs: the weights are the constants, ``inputs`` index the keys."""
    if not inputs:
        return []
    phs = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    users = phs[n_weights + n_state:]
    return memoize(gm, [users[i] for i in inputs], set(phs[:n_weights]))
