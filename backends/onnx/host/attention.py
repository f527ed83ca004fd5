"""Host fusion: the lowering's decomposed attention -> ONNX's standard ``Attention`` (opset 23).

The ``sdpa_decomposition`` rule turns attention into standard ops because hbdk4 wants them:
matmul, scale, mask, the safe softmax (0 on fully masked rows), matmul, and for grouped-query
attention an expand that repeats every KV head. On the host that is about 26 ONNX nodes per
layer, and the expand copies the whole KV cache once per query head group every step.
onnxruntime has a CPU kernel for opset 23's ``Attention``, which does grouped-query attention
natively, applies a boolean or additive mask, and gives 0 on fully masked rows. One node per
layer plus its guard: on the Qwen3 4 x 512 decode region, 305 -> 253 ONNX nodes (see
``docs/generation.md`` for the time). onnxscript's own attention fusions look for a
different form (the rotary embedding and the KV-cache concat inside the pattern), so this one
is ours.

The match is structural and checked, never assumed: it starts at each ``Softmax`` and accepts
only the form the rule emits, with every shape read from the lowering's static value_info.

- ``Softmax(axis=-1)`` over scores ``[B, H, L, S]``, followed by the safe-softmax tail
  ``Where(all(scores == -inf, -1), 0, p)``; without the tail there is no fusion, because plain
  softmax gives NaN on a fully masked row and ``Attention`` gives 0;
- scores = ``Mul(MatMul(q, Transpose(k, [0, 1, 3, 2])), scale)`` plus at most one mask step,
  ``Add(., mask)`` or ``Where(cond, -inf, .)`` (a boolean ``masked_fill``, turned into
  ``Not(cond)``); the batched matmuls may be wrapped in the reshapes that flatten ``B * H``;
- k and v are the 4-D ``[B, Hk, S, D]`` values or their GQA repeat (unsqueeze, expand to
  ``H // Hk`` copies, reshape), float32 throughout;
- every intermediate is used only inside the match (else its value would be lost).

Exactness: onnxruntime's kernel adds every mask (so a NaN score at a masked position spreads
where eager's ``masked_fill`` drops it) and gives 0 on a row whose keys are all masked even when
a score there is NaN or inf (eager: NaN). With finite scores the two agree. So the rewrite is
``If(sum|q| * sum|k| * max(1, |scale|) < 1e37, Attention, the decomposed nodes unchanged)``:
the bound proves every score and partial sum finite; NaN, inf or huge inputs take the original
nodes and get eager's answer. The guard reads q and the cache once (two ``ReduceL1``). An
additive mask must also hold only -inf or moderate values (sum of the finite |values| < 1e30):
the kernel zeroes a row masked with HF's ``finfo.min`` where eager averages v. The mask is
expanded to ``[., ., L, S]`` (the kernel does not broadcast those two), and a scale <= 0 or
k and v repeated differently are not fused (the kernel refuses them).

The board path never calls this: it is part of
:func:`fxpass.backends.onnx.host.prepare.fuse_for_ort`.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import onnx_ir as ir

from fxpass.backends.onnx.host.onnx_match import (
    add_initializer,
    const_array,
    producer_of,
    static_shape,
)

OPSET = 23  # the first opset with Attention
# |every score| <= sum|q| * sum|k| * max(1, |scale|) < _LIMIT: no score, partial sum or scaled
# operand can overflow, whichever order a kernel multiplies and scales in
_LIMIT = 1e37


def fuse_attention(model: ir.Model) -> int:
    """Replace each matched decomposed attention in ``model`` by one ``Attention`` node."""
    graph = model.graph
    count = 0
    if not kernel_available():
        return 0
    for softmax in [n for n in graph if n.op_type == "Softmax" and n.domain == ""]:
        m = _Match.at(softmax)
        if m is None:
            continue
        m.rewrite(graph)
        count += 1
    if count:
        model.opset_imports[""] = max(model.opset_imports.get("", OPSET), OPSET)
    return count


@functools.cache
def kernel_available() -> bool:
    """Whether this onnxruntime runs opset 23's ``Attention`` on the CPU (the project allows
    onnxruntime releases from before it): probed once per process with a one-node model."""
    ones = np.ones((1, 1, 1, 2), np.float32)
    y = probe("Attention", {"q": ones, "k": ones, "v": ones})
    return y is not None and bool(np.allclose(y, ones))


def probe(op: str, feeds: dict[str, np.ndarray]) -> np.ndarray | None:
    """Run one default-domain ``op`` node of opset :data:`OPSET` on ``feeds`` (its inputs, in
    order) with onnxruntime's CPU provider: its output, or None if it does not run here."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in [*feeds, "y"]]
    graph = helper.make_graph([helper.make_node(op, list(feeds), ["y"])], "probe", vi[:-1],
                              vi[-1:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 10
    try:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, feeds)[0]
    except Exception:  # noqa: BLE001 - any failure means: the kernel is not available
        return None








def _int_attr(node: ir.Node, name: str, default: int) -> int:
    a = node.attributes.get(name)
    return default if a is None else int(a.value)


class _Match:
    def __init__(self) -> None:
        self.nodes: list[ir.Node] = []

    def take(self, node: ir.Node | None) -> ir.Node | None:
        if node is not None:
            self.nodes.append(node)
        return node

    @classmethod
    def at(cls, softmax: ir.Node) -> _Match | None:
        m = cls()
        return m if m._match(softmax) and m._self_contained() else None

    def _match(self, softmax: ir.Node) -> bool:
        scores = softmax.inputs[0]
        shape = static_shape(scores)
        if shape is None or len(shape) != 4 or scores.dtype != ir.DataType.FLOAT:
            return False
        if 0 in shape:  # empty attention: nothing to gain, and no kernel contract to rely on
            return False
        if _int_attr(softmax, "axis", -1) not in (-1, 3):
            return False
        self.take(softmax)
        b, h, q_len, s_len = shape
        p = self._safe_tail(softmax.outputs[0], scores)
        if p is None:
            return False
        pv = self._bmm_from(p, (b, h, q_len, s_len))
        if pv is None:
            return False
        self.out, v_rep = pv
        self.v = self._kv(v_rep, b, h, s_len)
        if self.v is None:
            return False
        if not self._scores(scores, b, h, q_len, s_len):
            return False
        if not (math.isfinite(self.scale) and self.scale > 0):
            return False  # the kernel refuses scale <= 0 and reads NaN as "not set"
        k, v = static_shape(self.k), static_shape(self.v)
        # k and v repeated alike (hand-written attention may repeat only one of them)
        return k[:3] == v[:3] and static_shape(self.q)[-1] == k[-1] and h % k[1] == 0

    def _safe_tail(self, p: ir.Value, scores: ir.Value) -> ir.Value | None:
        """``Where(all(scores == -inf, -1, keepdim), 0, p)``: the rows with no key left."""
        users = p.consumers()
        if len(users) != 1 or users[0].op_type != "Where" or users[0].inputs[2] is not p:
            return None
        where = users[0]
        cond, zeros = where.inputs[0], where.inputs[1]
        cast = producer_of(cond, "Cast")
        red = producer_of(cast.inputs[0], "ReduceMin") if cast else None
        cast0 = producer_of(red.inputs[0], "Cast") if red else None
        eq = producer_of(cast0.inputs[0], "Equal") if cast0 else None
        if eq is None or _int_attr(cast, "to", 0) != ir.DataType.BOOL.value:
            return None
        if eq.inputs[0] is not scores or not _is(const_array(eq.inputs[1]), -math.inf):
            return None
        axes = const_array(red.inputs[1]) if len(red.inputs) > 1 else None
        if axes is None or axes.size != 1 or int(axes.reshape(-1)[0]) not in (-1, 3):
            return None
        if _int_attr(red, "keepdims", 1) != 1:
            return None
        expand = producer_of(zeros, "Expand")
        if not _is(const_array(expand.inputs[0] if expand else zeros), 0.0):
            return None
        if static_shape(where.outputs[0]) != static_shape(scores):
            return None
        for n in (eq, cast0, red, cast, expand, where):
            self.take(n)
        return where.outputs[0]

    def _bmm_from(self, a: ir.Value, shape: tuple[int, ...]) -> tuple[ir.Value, ir.Value] | None:
        """``a @ other`` through optional ``[B*H, ...]`` reshapes: (the 4-D result, other)."""
        b, h = shape[0], shape[1]
        users = a.consumers()
        if len(users) != 1:
            return None
        node = users[0]
        flat = None
        if node.op_type == "Reshape":
            if static_shape(node.outputs[0]) != (b * h, *shape[2:]):
                return None
            flat = self.take(node)
            users = node.outputs[0].consumers()
            if len(users) != 1:
                return None
            node = users[0]
        if node.op_type != "MatMul" or node.inputs[0] is not (flat.outputs[0] if flat else a):
            return None
        self.take(node)
        other, out = node.inputs[1], node.outputs[0]
        if flat is not None:
            unflat = producer_of(other, "Reshape")
            if unflat is None or len(static_shape(unflat.inputs[0]) or ()) != 4:
                return None
            self.take(unflat)
            other = unflat.inputs[0]
            users = out.consumers()
            if len(users) != 1 or users[0].op_type != "Reshape":
                return None
            out = self.take(users[0]).outputs[0]
            if static_shape(out) != (b, h, shape[2], (static_shape(other) or (0,))[-1]):
                return None
        return out, other

    def _kv(self, rep: ir.Value, b: int, h: int, s_len: int) -> ir.Value | None:
        """The ``[B, Hk, S, D]`` tensor behind ``rep``: itself, or what its GQA repeat repeats."""
        shape = static_shape(rep)
        if shape is None or shape[:3] != (b, h, s_len) or rep.dtype != ir.DataType.FLOAT:
            return None
        merge = producer_of(rep, "Reshape")
        expand = producer_of(merge.inputs[0], "Expand") if merge else None
        unsq = producer_of(expand.inputs[0], "Reshape", "Unsqueeze") if expand else None
        if unsq is None:
            return rep
        src = unsq.inputs[0]
        hk = (static_shape(src) or (0, 0))[1]
        d = shape[3]
        if static_shape(src) != (b, hk, s_len, d) or hk == 0 or h % hk:
            return rep
        if static_shape(unsq.outputs[0]) != (b, hk, 1, s_len, d):
            return rep
        if static_shape(expand.outputs[0]) != (b, hk, h // hk, s_len, d):
            return rep
        for n in (unsq, expand, merge):
            self.take(n)
        return src

    def _scores(self, scores: ir.Value, b: int, h: int, q_len: int, s_len: int) -> bool:
        """scores = q @ k^T * scale, then at most one mask step."""
        self.mask, self.negate = None, False
        x = scores
        add = producer_of(x, "Add")
        fill = producer_of(x, "Where")
        if add is not None:
            scaled, mask = add.inputs
            if producer_of(mask, "Mul") and not producer_of(scaled, "Mul"):
                scaled, mask = mask, scaled
            if static_shape(mask) is None or len(mask.shape) > 4 or mask.dtype != ir.DataType.FLOAT:
                return False
            self.mask, x = mask, scaled
            self.take(add)
        elif fill is not None:
            cond, minus_inf, x = fill.inputs
            if (not _is(const_array(minus_inf), -math.inf)
                    or len(static_shape(cond) or (0,) * 5) > 4):
                return False
            self.mask, self.negate = cond, True
            self.take(fill)
        mul = producer_of(x, "Mul")
        if mul is None:
            return False
        qk, scale = mul.inputs
        s = const_array(scale)
        if s is None:
            qk, scale = scale, qk
            s = const_array(scale)
        if s is None or s.size != 1:
            return False
        self.scale = float(s.reshape(-1)[0])
        self.take(mul)
        # qk: [B, H, L, S] = q @ k^T, maybe through [B*H, ...] reshapes
        node = producer_of(qk, "Reshape")
        if node is not None and static_shape(node.inputs[0]) == (b * h, q_len, s_len):
            self.take(node)
            mm = producer_of(node.inputs[0], "MatMul")
            q_flat = producer_of(mm.inputs[0], "Reshape") if mm else None
            kt_flat = producer_of(mm.inputs[1], "Reshape") if mm else None
            if q_flat is None or kt_flat is None:
                return False
            q, kt = q_flat.inputs[0], kt_flat.inputs[0]
            for n in (mm, q_flat, kt_flat):
                self.take(n)
        else:
            mm = producer_of(qk, "MatMul")
            if mm is None:
                return False
            q, kt = mm.inputs
            self.take(mm)
        tr = producer_of(kt, "Transpose")
        if tr is None or list(tr.attributes["perm"].value) != [0, 1, 3, 2]:
            return False
        self.take(tr)
        qs = static_shape(q)
        if qs is None or qs[:3] != (b, h, q_len) or q.dtype != ir.DataType.FLOAT:
            return False
        self.q = q
        self.k = self._kv(tr.inputs[0], b, h, s_len)
        return self.k is not None

    def _self_contained(self) -> bool:
        """Every matched value other than the output is used only inside the match."""
        inside = set(map(id, self.nodes))
        for n in self.nodes:
            for v in n.outputs:
                if v is self.out:
                    continue
                if v.is_graph_output() or any(id(u) not in inside for u in v.consumers()):
                    return False
        return True

    def rewrite(self, graph: ir.Graph) -> None:
        """``If(scores provably finite, Attention, the decomposed nodes as they were)``."""
        order = {id(n): i for i, n in enumerate(graph)}
        self.nodes.sort(key=lambda n: order[id(n)])
        anchor = self.out.producer()
        name = self.out.name
        fused = self._fused(graph)
        def const(tag: str, value: float) -> ir.Value:
            return add_initializer(graph, f"{name}/{tag}", np.array(value, np.float32))

        def node(op: str, *inputs: ir.Value, **attrs: int) -> ir.Value:
            n = ir.Node("", op, inputs, [ir.AttrInt64(k, v) for k, v in attrs.items()])
            n.outputs[0].name = f"{name}/guard{len(guard)}"  # unnamed: "val_N" per scope
            guard.append(n)
            return n.outputs[0]

        guard: list[ir.Node] = []
        l1 = node("Mul", node("ReduceL1", self.q, keepdims=0), node("ReduceL1", self.k, keepdims=0))
        ok = node("Less", l1, const("finite_limit", _LIMIT / max(1.0, abs(self.scale))))
        if self.mask is not None and not self.negate:
            # onnxruntime's kernel zeroes a row whose additive mask is all very negative finite
            # (HF's finfo.min padding), where eager averages v: only 0 or -inf, or moderate
            # values, take the fused branch (a sum, so NaN and inf fail the test too)
            big = node("Where", node("Equal", self.mask, const("minus_inf", -math.inf)),
                       const("zero", 0.0), node("Abs", self.mask))
            mask_ok = node("Less", node("ReduceSum", big, keepdims=0), const("mask_limit", 1e30))
            ok = node("And", ok, mask_ok)
        result = ir.Value(name=f"{name}/if", shape=self.out.shape, type=self.out.type)
        graph.insert_before(anchor, guard)
        self.out.replace_all_uses_with(result, replace_graph_outputs=True)
        graph.remove(self.nodes)  # not safe=True: that would detach their inputs
        decomposed = ir.Graph((), [self.out], nodes=self.nodes, name=f"{name}/decomposed")
        branch = ir.Node(
            "", "If", [ok],
            [ir.AttrGraph("then_branch", fused), ir.AttrGraph("else_branch", decomposed)],
            outputs=[result],
        )
        graph.insert_after(guard[-1], branch)
        self.out.name, result.name = f"{name}/decomposed", name  # a region output keeps its name

    def _fused(self, graph: ir.Graph) -> ir.Graph:
        new: list[ir.Node] = []
        mask = self.mask
        if mask is not None:  # the kernel wants a 4-D mask ending in [L, S] exactly
            dims = [1] * (4 - len(mask.shape)) + list(mask.shape)  # a causal [L, S], say
            full = [*dims[:2], self.q.shape[2], self.k.shape[2]]
            if list(mask.shape) != full:  # Expand broadcasts the rank too
                shape = add_initializer(
                    graph, f"{self.out.name}/mask_shape", np.array(full, np.int64)
                )
                new.append(ir.Node("", "Expand", [mask, shape]))
                mask = new[-1].outputs[0]
                mask.name = f"{self.out.name}/mask_expanded"
        if mask is not None and self.negate:  # with finite scores, masked_fill == + -inf
            new.append(ir.Node("", "Not", [mask]))
            mask = new[-1].outputs[0]
            mask.name = f"{self.out.name}/keep"
        inputs = [self.q, self.k, self.v] + ([mask] if mask is not None else [])
        attn = ir.Node("", "Attention", inputs, [ir.AttrFloat32("scale", self.scale)])
        new.append(attn)
        out = attn.outputs[0]
        out.shape, out.type = self.out.shape, self.out.type
        out.name = f"{self.out.name}/attention"
        return ir.Graph((), [out], nodes=new, name=f"{self.out.name}/fused")




def _is(a: np.ndarray | None, value: float) -> bool:
    return a is not None and a.size >= 1 and bool(np.all(a == value))
