"""Host fusion: layout ops that move no data become one ``Reshape`` or nothing.

The lowering spells every aten view and permute as its own ONNX node, which is what a
compiler wants. On the host each node is a kernel call (about a microsecond of dispatch
each, and a ``Transpose`` also copies its tensor). A decode step is full of them: with one
token, ``transpose(1, 2)`` of a ``[1, 1, H, D]`` query moves only the unit axis, and the
views around every matmul reshape it back and forth.

Rewritten, each exact bit for bit (row-major memory is unchanged in every case)::

    Transpose(x, perm)  whose non-unit axes keep their order -> Reshape(x, out_shape)
    MatMul(Reshape(x, [P, K]), W)  x: [*lead, K], P = prod(lead), W a 2-D weight
                                                             -> MatMul(x, W): [*lead, N]
    Reshape(Reshape(x, a), b)                                -> Reshape(x, b)
    Reshape(x, s) with s == shape(x)                         -> x

A ``MatMul`` by a 2-D weight (and the int4/int8 kernel it becomes) takes any leading dims,
so the lowering's 2-D views around each weight-only matmul (``[1, 1, K] -> [1, K]`` in,
``[1, N] -> [1, 1, N]`` out) go, when everything reading the product is a ``Reshape`` to an
explicit shape or a ``Split`` on its last axis read only by such reshapes.

Shapes come from the lowering's static value_info; a value without one is left alone. A
graph output keeps its name (and its producer).
The board path never calls this: it is part of
:func:`fxpass.backends.onnx.host.prepare.fuse_for_ort`.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fxpass.backends.onnx.host.onnx_match import add_initializer, static_shape


def fuse_unit_axes(model: ir.Model) -> int:
    """Rewrite ``model``'s data-free layout ops as above; returns how many nodes went."""
    graph = model.graph
    outputs = {id(v) for v in graph.outputs}
    shapes: dict[tuple[int, ...], ir.Value] = {}

    def shape_const(shape: tuple[int, ...]) -> ir.Value:
        if shape not in shapes:
            shapes[shape] = add_initializer(graph, f"unit_axes/shape{len(shapes)}",
                                            np.asarray(shape, np.int64))
        return shapes[shape]

    count = _rank_free_matmuls(graph)
    for node in [n for n in graph if n.op_type == "Transpose" and n.domain == ""]:
        out = node.outputs[0]
        src, dst = static_shape(node.inputs[0]), static_shape(out)
        perm = node.attributes.get("perm")
        if src is None or dst is None or perm is None:
            continue
        moved = [a for a in perm.value if src[a] != 1]
        if moved != sorted(moved):
            continue
        reshape = ir.Node("", "Reshape", [node.inputs[0], shape_const(dst)])
        graph.insert_before(node, [reshape])
        new = reshape.outputs[0]
        new.shape, new.type = out.shape, out.type
        name = out.name
        out.replace_all_uses_with(new, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        new.name = name
        count += 1
    outputs = {id(v) for v in graph.outputs}
    for node in [n for n in graph if n.op_type == "Reshape" and n.domain == ""]:
        out = node.outputs[0]
        src, dst = static_shape(node.inputs[0]), static_shape(out)
        if dst is None:
            continue
        if src == dst and id(out) not in outputs:
            out.replace_all_uses_with(node.inputs[0])
            graph.remove(node, safe=True)
            count += 1
            continue
        inner = node.inputs[0].producer()
        if inner is None or inner.op_type != "Reshape" or inner.domain != "" or (
                inner.graph is not graph):
            continue
        node.replace_input_with(0, inner.inputs[0])
        node.replace_input_with(1, shape_const(dst))  # explicit: no 0 or -1 left to resolve
        if not inner.outputs[0].uses() and id(inner.outputs[0]) not in outputs:
            graph.remove(inner, safe=True)
            count += 1
        if static_shape(node.inputs[0]) == dst and id(out) not in outputs:  # back where it was
            out.replace_all_uses_with(node.inputs[0])
            graph.remove(node, safe=True)
            count += 1
    return count


def _rank_free_matmuls(graph: ir.Graph) -> int:
    """Feed each ``MatMulNBits`` its input before the 2-D view (above); how many views went."""
    count = 0
    for mm in [n for n in graph if _rank_free(n)]:
        view = mm.inputs[0].producer() if mm.inputs[0] is not None else None
        if view is None or view.op_type != "Reshape" or view.domain != "" or (
                view.graph is not graph):
            continue
        x, y = view.inputs[0], mm.outputs[0]
        sx, sa, sy = static_shape(x), static_shape(mm.inputs[0]), static_shape(y)
        if sx is None or sa is None or sy is None or len(sa) != 2 or len(sx) < 2 or (
                sx[-1] != sa[-1] or int(np.prod(sx[:-1])) != sa[0] or y.is_graph_output()):
            continue
        splits = [u for u in y.consumers() if u.op_type == "Split"]
        readers = [u for u in y.consumers() if u.op_type != "Split"]
        for sp in splits:
            axis = sp.attributes.get("axis")
            if axis is None or axis.value not in (1, -1) or any(
                    o.is_graph_output() or static_shape(o) is None for o in sp.outputs):
                readers = None
                break
            readers += [u for o in sp.outputs for u in o.consumers()]
        if readers is None or not all(_explicit_reshape(u) for u in readers):
            continue
        lead = list(sx[:-1])
        mm.replace_input_with(0, x)
        y.shape = ir.Shape([*lead, sy[-1]])
        for sp in splits:
            sp.attributes["axis"] = ir.AttrInt64("axis", -1)
            for o in sp.outputs:
                o.shape = ir.Shape([*lead, static_shape(o)[-1]])
        if not view.outputs[0].consumers() and not view.outputs[0].is_graph_output():
            graph.remove(view, safe=True)
            count += 1
    return count


def _rank_free(node: ir.Node) -> bool:
    """A product that takes any leading dims: the weight-only kernel, or a ``MatMul`` by a
    2-D weight (what the weight-only quantizer turns into that kernel)."""
    if node.op_type == "MatMulNBits":
        return node.domain == "com.microsoft"
    return node.op_type == "MatMul" and node.domain == "" and len(
        static_shape(node.inputs[1]) or ()) == 2 and node.inputs[1].is_initializer()


def _explicit_reshape(node: ir.Node) -> bool:
    """A ``Reshape`` to a constant shape with no 0 (which would copy an input dim)."""
    if node.op_type != "Reshape" or node.domain != "" or len(node.inputs) < 2:
        return False
    target = node.inputs[1].const_value if node.inputs[1] is not None else None
    return target is not None and 0 not in target.numpy().tolist()
