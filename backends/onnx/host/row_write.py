"""Host fusion: a masked row overwrite ``Where(hit, row, t)`` -> ``ScatterElements``.

The ``kv_cache_update`` rule writes a decode step's key and value into the static cache as
``where(arange(S) == pos, new, cache)``, because ``where`` is on every device's operator list
and a scatter is not. On the host that ``Where`` broadcasts the one new row over the whole
cache element by element, twice per layer: on the Qwen3 4 x 512 int4 decode region the eight
of them were the most expensive operator, above the int4 matmuls (onnxruntime's profile).
A scatter copies the cache (a ``memcpy``) and writes the row where ``hit`` is true.

Matched, shapes read from the lowering's static value_info::

    Where(hit, row, t)   hit: bool [1, .., S, .., 1] (S > 1 on one axis d only)
                         row: t's shape with 1 on axis d;  t: [.., S, ..], output t's shape

Rewritten, exact for any ``hit`` (no true element, one, or several)::

    idx = Expand(Reshape(NonZero(Reshape(hit, [S])), [1, .., -1, .., 1]), shape(t) with 1 at d)
    ScatterElements(t, idx, Expand(row, Shape(idx)), axis=d)

The indices are made once per distinct ``hit`` and shape (shared by every layer's key and
value); each ``Where`` becomes an ``Expand`` of its row and the scatter. ``NonZero`` lists
every true slot once, so each is written with ``row``, as ``Where`` does; the other slots are
``t``'s, bit for bit (NaN and inf included). The board path never calls this: it is part of
:func:`fxpass.backends.onnx.host.prepare.fuse_for_ort`.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fxpass.backends.onnx.host.onnx_match import add_initializer, static_shape


def fuse_row_writes(model: ir.Model) -> int:
    """Replace each matched masked row overwrite in ``model`` by one ``ScatterElements``."""
    graph = model.graph
    made: dict[tuple[int, tuple[int, ...]], ir.Value] = {}  # (id(hit), shape) -> indices
    count = 0
    for where in [n for n in graph if n.op_type == "Where" and n.domain == ""]:
        axis = _match(where)
        if axis is None:
            continue
        hit, row, t = where.inputs
        shape = static_shape(t)
        key = (id(hit), shape)
        if key not in made:
            made[key] = _indices(graph, where, hit, shape, axis, len(made))
        idx = made[key]
        name = where.outputs[0].name
        expand = ir.Node("", "Shape", [idx])
        spread = ir.Node("", "Expand", [row, expand.outputs[0]])
        scatter = ir.Node("", "ScatterElements", [t, idx, spread.outputs[0]],
                          [ir.AttrInt64("axis", axis)])
        for k, n in enumerate((expand, spread)):
            n.outputs[0].name = f"{name}/row_write{k}"
        graph.insert_before(where, [expand, spread, scatter])
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
             axis: int, k: int) -> ir.Value:
    """The slots where ``hit`` is true as ScatterElements indices: ``[.., K, ..]`` with K on
    ``axis`` and ``shape``'s other sizes (inserted before ``before``)."""
    stem = f"row_write/idx{k}"
    flat_shape = add_initializer(graph, f"{stem}/flat", np.array([shape[axis]], np.int64))
    col = [1] * len(shape)
    col[axis] = -1
    col_shape = add_initializer(graph, f"{stem}/col", np.array(col, np.int64))
    full = list(shape)
    full[axis] = 1
    full_shape = add_initializer(graph, f"{stem}/full", np.array(full, np.int64))
    flat = ir.Node("", "Reshape", [hit, flat_shape])
    nonzero = ir.Node("", "NonZero", [flat.outputs[0]])
    column = ir.Node("", "Reshape", [nonzero.outputs[0], col_shape])
    spread = ir.Node("", "Expand", [column.outputs[0], full_shape])
    nodes = [flat, nonzero, column, spread]
    for j, n in enumerate(nodes):
        n.outputs[0].name = f"{stem}/{j}"
    graph.insert_before(before, nodes)
    return spread.outputs[0]
