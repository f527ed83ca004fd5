"""Extract a region into a standalone GraphModule, and splice regions back as single calls.

Extraction: region inputs become placeholders (named ``in_<node>``); constants and frozen
weights become ``get_attr`` buffers (ONNX initializers after lowering); values used outside
the region become outputs. Splicing contracts each region to one ``call_module`` and re-sorts
the graph topologically (stable: original order wherever possible), so a call is always placed
where all its inputs exist and before every consumer, even when a consumer sat between the
region's first and last node.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node

from fxpass.graph import FROZEN, constant_value
from fxpass.partition.partition import Region


@dataclass
class RegionGraph:
    gm: GraphModule  # standalone: placeholders = inputs, get_attr = constants, tuple output
    inputs: list[Node]  # nodes of the main graph feeding the placeholders, in order
    outputs: list[Node]  # members of the region used outside it, in order
    members: list[Node]  # the region's nodes in the main graph, in graph order
    #: get_attr buffer -> the main graph's frozen placeholder it holds (a model weight): the
    #: host can read those in place (``host.prepare.shared_weights``), also on a plan hit
    sources: dict[str, str] = field(default_factory=dict)


def _is_const(i: Node) -> bool:
    return i.op == "get_attr" or (i.op == "placeholder" and FROZEN in i.meta)


def extract(gm: GraphModule, region: Region) -> RegionGraph:
    members = set(region.nodes)
    ordered = [n for n in gm.graph.nodes if n in members]
    external: dict[Node, None] = {}
    for n in ordered:
        for i in n.all_input_nodes:
            if i not in members:
                external[i] = None
    g, root = Graph(), torch.nn.Module()
    env: dict[Node, Node] = {}
    inputs = [i for i in external if not _is_const(i)]
    for i in inputs:
        if not isinstance(i.meta.get("val"), torch.Tensor):
            raise ValueError(f"region input {i.name} is not a tensor ({type(i.meta.get('val'))})")
    for i in inputs:
        env[i] = g.placeholder(f"in_{i.name}")
        env[i].meta["val"] = i.meta["val"]
    sources: dict[str, str] = {}
    for k, i in enumerate(c for c in external if _is_const(c)):
        root.register_buffer(f"c{k}", constant_value(i).detach(), persistent=False)
        env[i] = g.get_attr(f"c{k}")
        env[i].meta["val"] = i.meta["val"]
        if i.op == "placeholder":
            sources[f"c{k}"] = i.name
    for n in ordered:
        env[n] = g.node_copy(n, lambda x: env[x])
    outputs = [n for n in ordered if any(u not in members for u in n.users)]
    g.output(tuple(env[o] for o in outputs))
    return RegionGraph(GraphModule(root, g), inputs, outputs, ordered, sources)


def splice(gm: GraphModule, regions: list[tuple[RegionGraph, torch.nn.Module]]) -> GraphModule:
    """A new GraphModule where each region is one ``call_module`` returning a tuple."""
    members: dict[Node, int] = {}
    for k, (rg, _) in enumerate(regions):
        for n in rg.members:
            members[n] = k
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    # units: ("n", node) or ("r", k); dependencies between units
    unit_of = {n: ("r", members[n]) if n in members else ("n", n) for n in nodes}
    deps: dict[tuple, set] = {}
    users: dict[tuple, set] = {}
    first: dict[tuple, int] = {}
    for n in nodes:
        u = unit_of[n]
        first[u] = min(first.get(u, pos[n]), pos[n])
        deps.setdefault(u, set())
        for i in n.all_input_nodes:
            d = unit_of[i]
            if d != u:
                deps[u].add(d)
                users.setdefault(d, set()).add(u)
    indeg = {u: len(d) for u, d in deps.items()}
    ready = [(first[u], k, u) for k, u in enumerate(deps) if indeg[u] == 0]
    heapq.heapify(ready)
    tie = len(deps)
    g = Graph()
    env: dict[Node, Node] = {}
    emitted = 0
    while ready:
        _, _, u = heapq.heappop(ready)
        emitted += 1
        if u[0] == "n":
            n = u[1]
            env[n] = g.node_copy(n, lambda x: env[x])
        else:
            rg, mod = regions[u[1]]
            name = f"device_region_{u[1]}"
            gm.add_module(name, mod)
            call = g.call_module(name, tuple(env[i] for i in rg.inputs))
            call.meta["val"] = tuple(o.meta["val"] for o in rg.outputs)
            for k, o in enumerate(rg.outputs):
                item = g.call_function(operator.getitem, (call, k))
                item.meta["val"] = o.meta["val"]
                env[o] = item
        for v in users.get(u, ()):
            indeg[v] -= 1
            if indeg[v] == 0:
                tie += 1
                heapq.heappush(ready, (first[v], tie, v))
    if emitted != len(deps):
        raise RuntimeError("regions do not contract to an acyclic graph (partitioner bug)")
    return GraphModule(gm, g)
