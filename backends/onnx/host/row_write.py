"""Host fusion: a masked row overwrite ``Where(hit, row, t)`` -> ``ScatterND``.

The ``kv_cache_update`` rule writes a decode step's key and value into the static cache as
``where(arange(S) == pos, new, cache)``, because ``where`` is on every device's operator list
and a scatter is not. On the host that ``Where`` broadcasts the one new row over the whole
cache element by element, twice per layer: on the Qwen3 4 x 512 int4 decode region the eight
of them were the most expensive operator, above the int4 matmuls (onnxruntime's profile).
A scatter copies the cache and writes the row where ``hit`` is true.

Matched, shapes read from the lowering's static value_info::

    Where(hit, row, t)   hit: bool [1, .., S, .., 1] (S > 1 on one axis d only)
                         row: t's shape with 1 on axis d;  t: [.., S, ..], output t's shape

Rewritten, exact for any ``hit`` (no true element, one, or several)::

    slots = NonZero(Reshape(hit, [S]))                     # the K true slots
    idx = every (i_0, .., i_{d-1}, slot) in row-major order  # [P * K, d + 1], P = prod(t[:d])
    ScatterND(t, idx, Reshape(Expand(Reshape(row, [P, 1, *tail]), [P, K, *tail]), [-1, *tail]))

The indices are made once per distinct ``hit`` and shape (shared by every layer's key and
value); each ``Where`` becomes the row's reshapes and the scatter. ``NonZero`` lists every true
slot once, so each is written with ``row``, as ``Where`` does; the other slots are ``t``'s, bit
for bit (NaN and inf included). ``ScatterND`` rather than ``ScatterElements``: onnxruntime copies
the tensor at memcpy speed in the first and element by element in the second (one row into a
[1, 4, 256, 64] cache: 21 against 27 us, ``Where`` 57 us; ``python -m
benchmarks.probes.row_write``). The board path never calls this: it is part of
:func:`fxpass.backends.onnx.host.prepare.fuse_for_ort`.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fxpass.backends.onnx.host.onnx_match import add_initializer, static_shape


def fuse_row_writes(model: ir.Model) -> int:
    """Replace each matched masked row overwrite in ``model`` by one ``ScatterND``."""
    graph = model.graph
    made: dict[tuple[int, tuple[int, ...]], tuple[ir.Value, ...]] = {}
    count = 0
    for where in [n for n in graph if n.op_type == "Where" and n.domain == ""]:
        axis = _match(where)
        if axis is None:
            continue
        hit, row, t = where.inputs
        key = (id(hit), static_shape(t))
        if key not in made:
            made[key] = _indices(graph, where, hit, key[1], axis, len(made))
        idx, column, spread, flat = made[key]
        name = where.outputs[0].name
        nodes = [ir.Node("", "Reshape", [row, column])]
        nodes.append(ir.Node("", "Expand", [nodes[-1].outputs[0], spread]))
        nodes.append(ir.Node("", "Reshape", [nodes[-1].outputs[0], flat]))
        for k, n in enumerate(nodes):
            n.outputs[0].name = f"{name}/row_write{k}"
        scatter = ir.Node("", "ScatterND", [t, idx, nodes[-1].outputs[0]])
        graph.insert_before(where, [*nodes, scatter])
        out = where.outputs[0]
        out.replace_all_uses_with(scatter.outputs[0], replace_graph_outputs=True)
        graph.remove(where, safe=True)
        scatter.outputs[0].name = name  # a region output keeps its name
        scatter.outputs[0].shape, scatter.outputs[0].type = out.shape, out.type
        count += 1
    return count


def _match(where: ir.Node) -> int | None:
    """The written axis ``d`` if ``where`` is a masked row overwrite, else None."""
    if len(where.inputs) != 3 or any(v is None for v in where.inputs):
        return None
    hit, row, t = where.inputs
    h, r, s, o = (static_shape(v) for v in (hit, row, t, where.outputs[0]))
    if h is None or r is None or s is None or o != s or not (len(h) == len(r) == len(s)):
        return None
    if hit.dtype != ir.DataType.BOOL or row.dtype != t.dtype:
        return None
    axes = [d for d, n in enumerate(h) if n != 1]
    if len(axes) != 1 or h[axes[0]] != s[axes[0]] or s[axes[0]] < 2:
        return None
    d = axes[0]
    if r[d] != 1 or any(r[k] != s[k] for k in range(len(s)) if k != d):
        return None
    return d


def _indices(graph: ir.Graph, before: ir.Node, hit: ir.Value, shape: tuple[int, ...],
             axis: int, k: int) -> tuple[ir.Value, ...]:
    """What every row written under ``hit`` into a tensor of ``shape`` shares (inserted before
    ``before``): the ``ScatterND`` indices, ``[P * K, axis + 1]`` (every index of the P leading
    positions, row-major, times each of the K true slots), and the shapes a row goes through:
    ``[P, 1, *tail]``, expanded to ``[P, K, *tail]``, flattened to ``[-1, *tail]``."""
    stem = f"row_write/idx{k}"
    lead, tail = shape[:axis], list(shape[axis + 1:])
    prefix = int(np.prod(lead, dtype=np.int64))
    grid = np.stack(np.meshgrid(*[np.arange(n) for n in lead], indexing="ij"), -1).reshape(
        prefix, 1, axis) if axis else np.zeros((1, 1, 0), np.int64)

    def const(tag: str, array: np.ndarray | list[int]) -> ir.Value:
        return add_initializer(graph, f"{stem}/{tag}", np.asarray(array, np.int64))

    nodes: list[ir.Node] = []

    def node(op: str, *inputs: ir.Value, **attrs: int) -> ir.Value:
        n = ir.Node("", op, inputs, [ir.AttrInt64(a, v) for a, v in attrs.items()])
        n.outputs[0].name = f"{stem}/{len(nodes)}"
        nodes.append(n)
        return n.outputs[0]

    slots = node("Reshape", node("NonZero", node("Reshape", hit, const("flat", [shape[axis]]))),
                 const("slots", [1, -1, 1]))                                   # [1, K, 1]
    count = node("Shape", slots, start=1, end=2)                               # [K]
    pk = node("Concat", const("p", [prefix]), count, axis=0)                   # [P, K]
    lead_idx = node("Expand", const("grid", grid), node("Concat", pk, const("a", [axis]), axis=0))
    slot_idx = node("Expand", slots, node("Concat", pk, const("one", [1]), axis=0))
    idx = node("Reshape", node("Concat", lead_idx, slot_idx, axis=-1),
               const("rows", [-1, axis + 1]))                                  # [P * K, d + 1]
    spread = node("Concat", pk, const("tail", tail), axis=0)                   # [P, K, *tail]
    graph.insert_before(before, nodes)
    return idx, const("column", [prefix, 1, *tail]), spread, const("rowflat", [-1, *tail])
