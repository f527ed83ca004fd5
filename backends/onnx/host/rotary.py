"""Host fusion: the lowering's rotary embedding -> ONNX's standard ``RotaryEmbedding`` (opset 23).

HF's rotary models (Llama, Qwen, Mistral, Phi-3, Gemma, ...) apply the rotation as
``x * cos + cat(-x2, x1) * sin``: two Slices, a Neg, a Concat, two Muls and an Add for each of
q and k in every layer, 7 ONNX nodes where onnxruntime has one kernel. Measured on the Qwen3
4 x 512 decode region: see ``docs/generation.md``. onnxscript's rotary fusion looks for the
position-indexed cache form (``position_ids`` and a ``[max_pos, D/2]`` table), which our
regions do not have: the rule ``pointwise_before_repeat_cat`` leaves each step's cos and sin
as ``Concat(c, c)`` of their half ``c``, which is the table ``RotaryEmbedding`` reads when it is
given no position ids (``[B, L, D/2]``).

Matched, each shape read from the lowering's static value_info, float32 only::

    Add(Mul(x, C), Mul(Concat(Neg(Slice(x, D/2:)), Slice(x, :D/2), axis=-1), S))

with ``x`` ``[B, H, L, D]`` (q or k, or the rotated part of a partial rotary), either operand
order of the Muls and the Add, and ``C``, ``S`` ``[B, 1, L, D]`` each a ``Concat(c, c)`` on its
last axis behind Muls by a one-element constant and Reshapes that keep the last axis (the
unsqueeze of HF's ``cos.unsqueeze(1)``, ``* attention_scaling``). ``RotaryEmbedding`` is fed
``c`` through the same Muls, reshaped to ``[B, L, D/2]``: the same table values eager uses.
Without a KV cache the tables fold to constants: a folded table whose two halves are equal
bit for bit (read from the weights, ``_Halves``) is fed its first half the same way.

Exactness: the kernel computes ``x1 * c - x2 * s`` and ``x2 * c + x1 * s`` from the same
values eager multiplies and adds; it may fuse a multiply-add (1 ulp, checked against eager in
``tests/backends/test_rotary_fusion.py``). Not fused: a Slice, Neg or Concat used outside the
match (its value would be lost), a table whose halves are not one value (or, folded, differ
in a bit), shapes not static.

The board path never calls this: it is part of
:func:`fxpass.backends.onnx.host.prepare.fuse_for_ort`.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir

from fxpass.backends.onnx.host.attention import probe
from fxpass.backends.onnx.host.onnx_match import (
    add_initializer,
    const_array,
    producer_of,
    static_shape,
)
from fxpass.backends.onnx.lowering.driver import Weights

OPSET = 23  # the first opset with RotaryEmbedding


def fuse_rotary(model: ir.Model, weights: Weights | None = None) -> int:
    """Replace each matched rotary embedding in ``model`` by one ``RotaryEmbedding`` node.
    ``weights``: the data of the weightless model's initializers (a folded table's values)."""
    if not kernel_available():
        return 0
    graph = model.graph
    tables: dict[int, ir.Value] = {}  # one half table per distinct cos/sin value
    folded = _Halves(graph, weights or {})
    count = 0
    for add in [n for n in graph if n.op_type == "Add" and n.domain == ""]:
        m = _match(add, folded)
        if m is None:
            continue
        x, (cos, cos_chain), (sin, sin_chain), nodes = m
        b, _, length, d = static_shape(x)
        half = [_table(graph, add, v, chain, (b, length, d // 2), tables)
                for v, chain in ((cos, cos_chain), (sin, sin_chain))]
        rot = ir.Node("", "RotaryEmbedding", [x, *half])
        out = rot.outputs[0]
        out.shape, out.type = add.outputs[0].shape, add.outputs[0].type
        graph.insert_before(add, rot)
        name = add.outputs[0].name
        add.outputs[0].replace_all_uses_with(out, replace_graph_outputs=True)
        add.outputs[0].name, out.name = f"{name}/decomposed", name  # outputs keep their name
        graph.remove(nodes, safe=True)  # used only inside the match (checked): all dead
        count += 1
    if count:
        model.opset_imports[""] = max(model.opset_imports.get("", OPSET), OPSET)
    return count


@functools.cache
def kernel_available() -> bool:
    """Whether this onnxruntime runs opset 23's ``RotaryEmbedding`` on the CPU and rotates as
    HF's ``rotate_half`` does: probed once per process with a one-node model."""
    x = np.array([[[[1.0, 2.0, 3.0, 4.0]]]], np.float32)
    c = np.array([[[0.5, -1.0]]], np.float32)
    s = np.array([[[2.0, 0.25]]], np.float32)
    cc, ss = np.concatenate([c, c], -1), np.concatenate([s, s], -1)
    want = x * cc + np.concatenate([-x[..., 2:], x[..., :2]], -1) * ss
    y = probe("RotaryEmbedding", {"x": x, "c": c, "s": s})
    return y is not None and bool(np.array_equal(y, want))


def _match(add: ir.Node, folded: _Halves) -> tuple | None:
    """(x, (cos, chain), (sin, chain), the matched nodes) or None."""
    for mul_x, mul_r in (add.inputs, add.inputs[::-1]):
        mx, mr = producer_of(mul_x, "Mul"), producer_of(mul_r, "Mul")
        if mx is None or mr is None:
            continue
        for rotated, sin in (mr.inputs, mr.inputs[::-1]):
            cat = producer_of(rotated, "Concat")
            halves = _rotate_half(cat) if cat is not None else None
            if halves is None:
                continue
            x, slices, neg = halves
            cos = mx.inputs[1] if mx.inputs[0] is x else mx.inputs[0] if mx.inputs[1] is x else None
            shape = static_shape(x)
            if cos is None or shape is None or len(shape) != 4 or x.dtype != ir.DataType.FLOAT:
                continue
            b, _, length, d = shape
            tables = [_half_table(t, (b, 1, length, d), folded) for t in (cos, sin)]
            if None in tables or static_shape(add.outputs[0]) != shape:
                continue
            nodes = [add, mx, mr, cat, neg, *slices]
            inside = {id(n) for n in nodes}
            for n in nodes[1:]:  # every intermediate used only inside the match
                v = n.outputs[0]
                if v.is_graph_output() or any(id(u) not in inside for u in v.consumers()):
                    break
            else:
                return x, tables[0], tables[1], nodes
    return None


def _rotate_half(cat: ir.Node) -> tuple | None:
    """``Concat(Neg(x[..., D/2:]), x[..., :D/2], axis=-1)``: (x, the two Slices, the Neg)."""
    if len(cat.inputs) != 2 or cat.attributes.get("axis") is None:
        return None
    neg = producer_of(cat.inputs[0], "Neg")
    second = producer_of(neg.inputs[0], "Slice") if neg else None
    first = producer_of(cat.inputs[1], "Slice")
    if second is None or first is None or second.inputs[0] is not first.inputs[0]:
        return None
    x = first.inputs[0]
    shape = static_shape(x)
    if shape is None or len(shape) != 4 or shape[-1] % 2:
        return None
    if cat.attributes["axis"].value not in (-1, 3):
        return None
    d = shape[-1]
    if _slice(first, d) != (0, d // 2) or _slice(second, d) != (d // 2, d):
        return None
    return x, (first, second), neg


def _slice(node: ir.Node, d: int) -> tuple[int, int] | None:
    """(start, end) of a step-1 Slice of the last axis of length ``d``, clamped; else None."""
    args = [const_array(v) if v is not None else None for v in node.inputs[1:]]
    if len(args) < 3 or any(a is None or a.size != 1 for a in args[:3]):
        return None
    if len(args) > 3 and (args[3] is None or int(args[3].reshape(-1)[0]) != 1):
        return None
    start, end, axis = (int(a.reshape(-1)[0]) for a in args[:3])
    if axis not in (-1, 3):
        return None
    start, end = (min(max(v + d if v < 0 else v, 0), d) for v in (start, end))
    return start, end


def _half_table(
    t: ir.Value, want: tuple[int, ...], folded: _Halves
) -> tuple[ir.Value, list] | None:
    """``t`` ([B, 1, L, D]) as (c, the one-element Muls between) when ``t`` is ``Concat(c, c)``
    on its last axis, or a folded constant whose two halves are equal (``_Halves``), seen
    through those Muls and Reshapes keeping the last axis."""
    if static_shape(t) != want:
        return None
    d, chain = want[-1], []
    while True:
        node = t.producer()
        if node is None and static_shape(t) is not None and static_shape(t)[-1] == d:
            c = folded(t)
            if c is None or 2 * int(np.prod(static_shape(c))) != int(np.prod(want)):
                return None
            return c, chain[::-1]
        if node is None or node.domain != "" or static_shape(t) is None or static_shape(t)[-1] != d:
            return None
        if node.op_type == "Reshape" and (static_shape(node.inputs[0]) or (0,))[-1] == d:
            t = node.inputs[0]
        elif node.op_type == "Mul":
            a, k = node.inputs
            if const_array(k) is None:
                a, k = k, a
            kv = const_array(k)
            if kv is None or kv.size != 1 or static_shape(a) != static_shape(t) \
                    or k.dtype != ir.DataType.FLOAT:
                return None
            chain.append(k)
            t = a
        elif node.op_type == "Concat":
            c = node.inputs[0]
            if len(node.inputs) != 2 or node.inputs[1] is not c or c.dtype != ir.DataType.FLOAT:
                return None
            if node.attributes["axis"].value not in (-1, len(static_shape(t)) - 1):
                return None
            if static_shape(c) is None or 2 * int(np.prod(static_shape(c))) != int(np.prod(want)):
                return None
            return c, chain[::-1]
        else:
            return None


class _Halves:
    """The first half (last axis) of a folded table initializer whose two halves are equal,
    as a new initializer, made once per table; None for anything else.

    Without a KV cache (a plain forward) the positions are constants, so cos and sin fold
    to constant tables and no ``Concat`` is left to see. The model the fusions rewrite holds
    no weight data, so the values come from ``weights`` (``lower_weightless``) and are
    compared bit for bit; a table not there, not float32, or with halves that differ in any
    bit is not fused."""

    def __init__(self, graph: ir.Graph, weights: dict) -> None:
        self.graph, self.weights = graph, weights
        self.made: dict[int, ir.Value | None] = {}

    def __call__(self, t: ir.Value) -> ir.Value | None:
        if id(t) not in self.made:
            self.made[id(t)] = self._half(t)
        return self.made[id(t)]

    def _half(self, t: ir.Value) -> ir.Value | None:
        w = self.weights.get(t.name) if t.is_initializer() else None
        if w is None or t.dtype != ir.DataType.FLOAT:
            return None
        a = np.asarray(w[2]())
        d = a.shape[-1] if a.ndim else 0
        if a.dtype != np.float32 or tuple(a.shape) != static_shape(t) or d % 2 or d == 0:
            return None
        bits = a.view(np.uint32)
        if not np.array_equal(bits[..., : d // 2], bits[..., d // 2:]):
            return None
        half = np.ascontiguousarray(a[..., : d // 2])
        v = add_initializer(self.graph, f"{t.name}/rotary_half", half)
        v.shape, v.type = ir.Shape(v.const_value.shape), ir.TensorType(ir.DataType.FLOAT)
        return v


def _table(graph: ir.Graph, before: ir.Node, c: ir.Value, chain: list[ir.Value],
           shape: tuple[int, int, int], tables: dict[int, ir.Value]) -> ir.Value:
    """``c`` through ``chain``'s Muls, reshaped to ``shape``: made once per distinct table."""
    key = (id(c), tuple(map(id, chain)), shape)
    if key in tables:
        return tables[key]
    new, v = [], c
    for k in chain:
        new.append(ir.Node("", "Mul", [v, k]))
        v = new[-1].outputs[0]
    dims = add_initializer(graph, f"{c.name}/rotary_table_shape{len(tables)}",
                        np.array(shape, np.int64))
    new.append(ir.Node("", "Reshape", [v, dims]))
    for i, n in enumerate(new):
        n.outputs[0].name = f"{c.name}/rotary_table{len(tables)}_{i}"
    graph.insert_before(before, new)
    tables[key] = new[-1].outputs[0]
    return tables[key]
