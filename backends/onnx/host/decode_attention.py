"""Host fusion: a decode step's attention over a static cache -> ``GroupQueryAttention``.

With one new token, the attention fusion (``host/attention.py``) leaves per layer: the row
write into a copy of each cache (``Where(hit, row, cache)``, then ``ScatterND``), a finiteness
guard over the query and the whole cache, an ``If`` and the ``Attention`` kernel over every
slot of the cache, read through ``Transpose``/``Reshape`` nodes. onnxruntime's contrib
``GroupQueryAttention`` (what ONNX Runtime GenAI's decoders run) takes the cache as it is
plus the new row, and reads only the slots up to the current position
(``python -m benchmarks.weight_only`` measures the decode step against GenAI's).

Matched (shapes static, from the lowering's value_info)::

    If(guard, Attention(q, k, v, mask?), decomposed)   q: [B, H, 1, D], scale attribute only
    k = Where(hit, k_row, k_cache)   v = Where(hit, v_row, v_cache)   (the same ``hit``)
    hit: bool [1, 1, S, 1];  rows: [B, Hk, 1, D];  caches: [B, Hk, S, D];  H % Hk == 0
    mask: additive float, or bool (``Not(cond)`` of a masked_fill), broadcast to [B, H, 1, S]

Rewritten::

    pos = argmax(hit)                                 (once per ``hit``)
    bias = additive mask, sliced to the slots 0..pos  (once per mask)
    out = GroupQueryAttention(q, k_row, v_row, k_cache, v_cache, seqlens=pos, total=pos + 1,
                              attention_bias=bias)    (reshaped: for L == 1 no data moves)

Exactness. The kernel writes the row at ``pos`` and reads slots ``0..pos`` only; eager reads
every slot and weights the masked ones by zero. The two agree when (checked on every call,
in the graph, into one extra output ``fxpass_ok``): ``hit`` has exactly one slot; every slot
past it is masked (False, -inf, or below -1e30 as HF's ``finfo.min`` padding: a weight of
exactly 0 in both); the slot itself is attended with a moderate value (|v| < 1e30), so no
row is fully masked; and every other value is masked or moderate (no NaN, no +inf).
Where ``hit`` has no slot (a position past the cache) or several, the kernel is given the
cache's length as the position, which it refuses before writing any row: the call raises
before anything changed. A call that fails the check is *declined*: the executor raises,
and the region answers it as it answers any executor failure (eagerly through
``torch.compile``; a package, which has no eager copy, raises with the reason). NaN and
inf in the query or in the slots it reads give NaN or inf where eager's do (checked in the
tests); a NaN or inf *stored in a slot past the position* (never written by generation:
caches start zeroed, and a prefill's padding rows come from real tokens) makes eager's
output NaN and not this one's. And with keys so large that a score overflows float32
(|q| * |k| near 3e38), which scores overflow depends on the order of the sums, so NaN can
land on other outputs than eager's. Those are the two differences, and why this fusion
needs no finiteness guard over the cache and no ``If``.

The board path never calls this: it is part of
:func:`fxpass.backends.onnx.host.prepare.fuse_for_ort`.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from fxpass.backends.onnx.host.onnx_match import add_initializer, producer_of, static_shape
from fxpass.backends.onnx.host.ort import IN_PLACE, OK_OUTPUT, ROWS_KEY

DOMAIN = "com.microsoft"
_MODERATE = 1e30
#: why a call was declined (``host.ort.RegionDeclined``)
DECLINED = (
    "the fused attention over the cache (host fusion decode_attention or chunk_attention) "
    "cannot answer this call exactly: a write position is outside the cache (no slot "
    "written), or the positions of a chunk are not consecutive, or the attention mask attends "
    "a cache slot past a written position, masks a written position itself, or holds NaN or "
    "a value above 1e30; compile (or export) with options host_fusions=False to run without it")


def fuse_decode_attention(model: ir.Model) -> int:
    """Replace each matched single-token attention in ``model`` (above); returns how many."""
    return fuse_guarded(model, _match, _Builder) if kernel_available() else 0


def add_ok(graph: ir.Graph, flags: list[ir.Value]) -> None:
    """All ``flags`` (bool scalars) as the graph output ``fxpass_ok``, and-ed with the one a
    fusion before added (``host.ort.OK_OUTPUT``: the executor declines a call it says False)."""
    ok = flags[0]
    for flag in flags[1:]:
        ok = _and(graph, ok, flag)
    for i, out in enumerate(graph.outputs):
        if out.name == OK_OUTPUT:
            out.name = f"{OK_OUTPUT}/before"
            ok = _and(graph, out, ok)
            del graph.outputs[i]
            break
    ok.name = OK_OUTPUT
    graph.outputs.append(ok)


def _and(graph: ir.Graph, a: ir.Value, b: ir.Value) -> ir.Value:
    n = ir.Node("", "And", [a, b])
    graph.append(n)
    return n.outputs[0]


def detach_branch(graph: ir.Graph, branch: ir.Node, result: ir.Value) -> None:
    """``result`` in place of ``branch``'s output (its shape, type and name), and ``branch``
    removed with its subgraphs' reads of the outer graph."""
    old = branch.outputs[0]
    result.shape, result.type = old.shape, old.type
    name = old.name
    old.replace_all_uses_with(result, replace_graph_outputs=True)
    for attr in ("then_branch", "else_branch"):  # detach the branches' outer reads
        sub = branch.attributes[attr].value
        sub.outputs.clear()
        for n in reversed(list(sub)):
            sub.remove(n, safe=True)
    graph.remove(branch, safe=True)
    result.name = name  # a region output keeps its name


def declare_rows(model: ir.Model) -> int:
    """Name, in the model's metadata (``host.ort.ROWS_KEY``), the graph output that holds the
    row each in-place kernel writes into its cache: ``{IN_PLACE + cache: [output, axis]}``.
    Run last (after the cleanups and ``output_views``, which move outputs and names).

    Why: the program writes that row into the cache itself after the call (its own
    ``index_copy_`` at the step's position; ``aot.writes.grant_in_place``). Where the kernel
    already wrote it, the executor may leave that output out and the program skip the write:
    eight small outputs and eight copies per decode step of a 4-layer model. The row is found
    from the kernel's key (value) input through ``Reshape`` / ``Identity`` nodes (a reshape
    keeps the elements' order, and ``RegionCall`` views an output back by reshape) and the
    row write's ``Where(one slot, row, the cache's own row)``, whose ``row`` is what the kernel
    writes whenever the call is not declined. A row that is no graph output is not named."""
    rows: dict[str, list] = {}
    for node in model.graph:
        if node.domain != DOMAIN or node.op_type != "GroupQueryAttention":
            continue
        for k in (1, 2):  # (key, present key), (value, present value)
            present = node.outputs[k]
            if present is None or not present.name.startswith(IN_PLACE):
                continue
            out = _graph_output_of(node.inputs[k])
            if out is not None:
                rows[present.name] = [out.name, 2]
    if rows:
        model.metadata_props[ROWS_KEY] = json.dumps(rows, sort_keys=True)
    return len(rows)


def _graph_output_of(v: ir.Value | None) -> ir.Value | None:
    """A graph output holding ``v``'s elements in order: ``v`` or a value one ``Reshape`` /
    ``Identity`` away from it, up or down, repeatedly."""
    seen, todo = set(), [v]
    while todo:
        v = todo.pop()
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if v.is_graph_output():
            return v
        p = v.producer()
        if p is not None and p.domain == "" and p.op_type in ("Reshape", "Identity"):
            todo.append(p.inputs[0])
        for u in v.consumers():
            if u.domain == "" and u.op_type in ("Reshape", "Identity") and u.inputs[0] is v:
                todo.append(u.outputs[0])
    return None


@functools.cache
def kernel_available() -> bool:
    """Whether this onnxruntime runs ``GroupQueryAttention`` with an ``attention_bias`` on the
    CPU, probed once with a one-node model against its known answer."""
    d = 8  # the kernel takes head sizes in multiples of 8
    z = np.zeros((1, 1, 2, d), np.float32)
    v = np.full((1, 1, d), 3.0, np.float32)
    out = probe_kernel({"q": v * 0, "k": v * 0, "v": v, "pk": z, "pv": z + 1,
                        "seq": np.array([1], np.int32), "tot": np.array(2, np.int32),
                        "bias": np.zeros((1, 1, 1, 2), np.float32)})
    # equal weights over slot 0 (1s) and the row (3s)
    return out is not None and bool(np.allclose(out, 2.0))


def probe_kernel(feeds: dict[str, np.ndarray]) -> np.ndarray | None:
    """The output of a one-head ``GroupQueryAttention`` (scale 1) over ``feeds`` (``q``,
    ``k``, ``v``, ``pk``, ``pv``, ``seq``, ``tot``, and ``bias`` if given) on this
    onnxruntime's CPU, or None where it fails."""
    import onnxruntime as ort
    from onnx import helper

    names = ["q", "k", "v", "pk", "pv", "seq", "tot", *(["", "", "", "bias"] if "bias" in feeds
                                                        else [])]
    node = helper.make_node("GroupQueryAttention", names, ["o", "pk2", "pv2"], domain=DOMAIN,
                            num_heads=1, kv_num_heads=1, scale=1.0)
    spec = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for k, a in feeds.items()]
    f = helper.np_dtype_to_tensor_dtype(np.dtype(np.float32))
    graph = helper.make_graph([node], "probe", spec, [
        helper.make_tensor_value_info(o, f, None) for o in node.output])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(DOMAIN, 1)])
    proto.ir_version = 10
    try:
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(["o"], feeds)[0]
    except Exception:  # noqa: BLE001 - any failure means: the kernel is not available here
        return None


def fuse_guarded(model: ir.Model, match: Callable[[ir.Node], Any], builder: type) -> int:
    """Rewrite every ``If`` that ``match`` takes with ``builder(graph).rewrite``, their flags
    into ``fxpass_ok``; returns how many. Shared by the decode and chunk fusions."""
    graph = model.graph
    matches = [m for m in map(match, [n for n in graph if n.op_type == "If"]) if m]
    if not matches:
        return 0
    b = builder(graph)
    for m in matches:
        b.rewrite(m)
    add_ok(graph, b.flags)
    model.opset_imports.setdefault(DOMAIN, 1)
    # the old guards and row writes, now unread: gone before the row-write fusion sees them
    RemoveUnusedNodesPass()(model)
    return len(matches)


class _Match:
    def __init__(self, branch: ir.Node, attn: ir.Node, wk: ir.Node, wv: ir.Node,
                 mask: ir.Value | None, keep: bool | None):
        self.branch, self.attn, self.wk, self.wv = branch, attn, wk, wv
        self.mask, self.keep = mask, keep  # keep: bool mask True = attend; None: additive


def guarded_attention(branch: ir.Node) -> tuple[ir.Node, ir.Graph] | None:
    """The ``Attention`` node (scale its only attribute) that is the whole answer of the
    then-branch of ``branch``, the attention fusion's ``If``, and that branch's graph; None
    for any other node."""
    then = branch.attributes.get("then_branch")
    if then is None or branch.domain != "" or len(branch.outputs) != 1:
        return None
    nodes = list(then.value)
    attn = nodes[-1] if nodes else None
    if attn is None or attn.op_type != "Attention" or set(attn.attributes) - {"scale"}:
        return None
    if len(then.value.outputs) != 1 or then.value.outputs[0] is not attn.outputs[0]:
        return None
    return attn, then.value


def _match(branch: ir.Node) -> _Match | None:
    found = guarded_attention(branch)
    if found is None:
        return None
    attn, then = found
    q, k, v, *rest = attn.inputs
    if any(r is not None for r in rest[1:]):  # the attention's own past key/value: not ours
        return None
    qs = static_shape(q)
    if qs is None or len(qs) != 4 or qs[2] != 1 or q.dtype != ir.DataType.FLOAT:
        return None
    wk, wv = producer_of(k, "Where"), producer_of(v, "Where")
    if wk is None or wv is None or wk.inputs[0] is not wv.inputs[0]:
        return None
    b, h, _, d = qs
    hit = static_shape(wk.inputs[0])
    caches = [static_shape(w.inputs[2]) for w in (wk, wv)]
    rows = [static_shape(w.inputs[1]) for w in (wk, wv)]
    if caches[0] is None or caches[0] != caches[1] or rows[0] != rows[1] or hit is None:
        return None
    _, hk, s, dk = caches[0]
    if caches[0][0] != b or dk != d or hk == 0 or h % hk or rows[0] != (b, hk, 1, d) or (
            d % 8):  # the kernel's head sizes
        return None
    if hit != (1, 1, s, 1) or wk.inputs[0].dtype != ir.DataType.BOOL:
        return None
    if any(x.dtype != ir.DataType.FLOAT for w in (wk, wv) for x in w.inputs[1:]):
        return None
    mask, keep = None, None
    if rest and rest[0] is not None:
        mask, keep = _outer_mask(rest[0], then)
        if mask is None:
            return None
        ms = static_shape(mask)
        if ms is None or len(ms) > 4 or ms[-1] != s or any(
                n not in (1, full) for n, full in zip(ms[::-1], (s, 1, h, b), strict=False)):
            return None
    if mask is None:
        return None  # no mask: eager attends every slot (the zeros past the position too)
    return _Match(branch, attn, wk, wv, mask, keep)


def _outer_mask(m: ir.Value, then: ir.Graph) -> tuple[ir.Value | None, bool | None]:
    """The mask as the outer graph holds it (through the branch's ``Expand`` and ``Not``),
    and its kind: None for additive, True for a bool keep-mask, False for masked_fill's."""
    keep = True
    inner = m.producer()
    if inner is not None and inner.graph is then and inner.op_type == "Not":
        keep, m = False, inner.inputs[0]
        inner = m.producer()
    if inner is not None and inner.graph is then and inner.op_type == "Expand":
        m = inner.inputs[0]
        inner = m.producer()
    if inner is not None and inner.graph is then:
        return None, None
    if m.dtype == ir.DataType.FLOAT:
        return (m, None) if keep else (None, None)
    return (m, keep) if m.dtype == ir.DataType.BOOL else (None, None)


def _in_place_ok(cache: ir.Value, hit: ir.Value) -> bool:
    """Whether the kernel may write the new row into ``cache`` itself: a graph input read by
    nothing but the attention kernels and row writes at the same ``hit`` (``Where(hit, row,
    cache)``, which write that row too). The executor does so only where the graph around
    the region allows it (``host.ort.OrtExecutor.grant``)."""
    if not cache.is_graph_input() or cache.dtype != ir.DataType.FLOAT:
        return False
    for node in cache.consumers():
        if node.domain == DOMAIN and node.op_type == "GroupQueryAttention" and (
                list(node.inputs).index(cache) in (3, 4)):
            continue
        if node.op_type == "Where" and node.inputs[0] is hit and node.inputs[2] is cache and (
                node.inputs[1] is not cache):
            continue
        return False
    return True


class _Builder:
    prefix = "decode_attention"  # of the names it gives

    def __init__(self, graph: ir.Graph):
        self.graph = graph
        self.flags: list[ir.Value] = []
        self.consts: dict[str, ir.Value] = {}
        #: id(hit) -> (seqlens, total, pos)
        self.positions: dict[int, tuple[ir.Value, ir.Value, ir.Value]] = {}
        self.biases: dict[tuple[int, int], ir.Value] = {}
        self.count = 0

    def const(self, tag: str, array: np.ndarray) -> ir.Value:
        if tag not in self.consts:
            self.consts[tag] = add_initializer(self.graph, f"{self.prefix}/{tag}", array)
        return self.consts[tag]

    def node(self, op: str, inputs: list[ir.Value | None], before: ir.Node | None,
             domain: str = "", outputs: int = 1, **attrs: int | float | list[int]) -> ir.Value:
        made = [ir.AttrFloat32(k, v) if isinstance(v, float) else ir.AttrInt64s(k, v)
                if isinstance(v, list) else ir.AttrInt64(k, v) for k, v in attrs.items()]
        n = ir.Node(domain, op, inputs, made, num_outputs=outputs)
        for i, o in enumerate(n.outputs):
            o.name = f"{self.prefix}/{self.count}_{i}"
        self.count += 1
        if before is None:
            self.graph.append(n)
        else:
            self.graph.insert_before(before, [n])
        return n.outputs[0]

    def position(self, hit: ir.Value, batch: int, first: ir.Node) -> tuple[ir.Value, ...]:
        """(seqlens [B] int32, total scalar int32, pos scalar int64) from ``hit``, and the
        flag that it has exactly one slot. Where it has none or several, ``seqlens`` is the
        cache's length, which the kernel refuses before it writes anything (checked by
        ``test_a_position_outside_the_cache_writes_nothing_and_is_declined``): no row is
        written, and the executor declines the call."""
        if id(hit) not in self.positions:
            s = hit.shape[2]
            flat = self.node("Cast", [self.node("Reshape", [hit, self.const(f"s{s}", np.array(
                [s], np.int64))], first)], first, to=ir.DataType.INT32.value)
            one = self.node("Equal", [self.node("ReduceSum", [flat], first, keepdims=0),
                                      self.const("one32", np.array(1, np.int32))], first)
            self.flags.append(one)
            pos = self.node("ArgMax", [flat], first, keepdims=0)                    # int64
            pos32 = self.node("Where", [one, self.node("Cast", [pos], first, to=ir.DataType.INT32
                                                       .value), self.const(f"len{s}", np.array(
                                                           s, np.int32))], first)
            total = self.node("Add", [pos32, self.const("one32", np.array(1, np.int32))], first)
            seqlens = self.node("Expand", [self.node("Reshape", [pos32, self.const(
                "one", np.array([1], np.int64))], first), self.const(
                f"b{batch}", np.array([batch], np.int64))], first)
            self.positions[id(hit)] = (seqlens, total, pos)
        return self.positions[id(hit)]

    def bias(self, m: _Match, pos: ir.Value, total: ir.Value, first: ir.Node) -> ir.Value:
        """The additive mask over slots 0..pos, 4-D; its checks go into ``flags``."""
        key = (id(m.mask), id(pos))
        if key in self.biases:
            return self.biases[key]
        mask, s = m.mask, m.mask.shape[-1]
        if m.keep is not None:  # bool -> 0 where attended, -inf elsewhere
            zero, minf = self.const("zero", np.array(0, np.float32)), self.const(
                "minf", np.array(-np.inf, np.float32))
            mask = self.node("Where", [mask, zero, minf] if m.keep else [mask, minf, zero], first)
        dims = [1] * (4 - len(m.mask.shape)) + list(m.mask.shape)
        mask = self.node("Reshape", [mask, self.const(f"m{dims}", np.array(dims, np.int64))],
                         first)
        # the checks: every slot past pos at -inf, pos itself not, the rest moderate
        slots = self.const(f"slots{s}", np.arange(s, dtype=np.int64))
        past = self.node("Greater", [slots, pos], first)                       # [S]
        # masked: -inf or below -1e30 (HF's finfo.min): exp underflows to exactly 0 in both,
        # as long as the row attends one moderate slot (the written one, checked here)
        minf = self.node("Less", [mask, self.const("masked", np.array(-_MODERATE, np.float32))],
                         first)
        moderate = self.node("Less", [self.node("Abs", [mask], first), self.const(
            "moderate", np.array(_MODERATE, np.float32))], first)
        at = self.node("Equal", [slots, pos], first)
        # past: -inf; before: -inf or moderate; at pos: moderate (no Where over bools here)
        earlier = self.node("Or", [moderate, self.node("And", [self.node("Not", [at], first),
                                                                 minf], first)], first)
        good = self.node("Or", [self.node("And", [past, minf], first), self.node(
            "And", [self.node("Not", [past], first), earlier], first)], first)
        self.flags.append(self.node("Cast", [self.node("ReduceMin", [self.node(
            "Cast", [good], first, to=ir.DataType.INT32.value)], first, keepdims=0)], first,
            to=ir.DataType.BOOL.value))
        ends = self.node("Reshape", [self.node("Cast", [total], first,
                                               to=ir.DataType.INT64.value),
                                     self.const("one", np.array([1], np.int64))], first)
        sliced = self.node("Slice", [mask, self.const("zero64", np.array([0], np.int64)), ends,
                                     self.const("last", np.array([-1], np.int64))], first)
        self.biases[key] = sliced
        return sliced

    def rewrite(self, m: _Match) -> None:
        q = m.attn.inputs[0]
        b, h, _, d = q.shape
        hk = m.wk.inputs[2].shape[1]
        branch = m.branch
        seqlens, total, pos = self.position(m.wk.inputs[0], b, branch)
        bias = self.bias(m, pos, total, branch)

        def flat(x: ir.Value, heads: int) -> ir.Value:
            return typed(self.node("Reshape", [x, self.const(f"f{b}_{heads * d}", np.array(
                [b, 1, heads * d], np.int64))], branch), x, (b, 1, heads * d))

        def typed(v: ir.Value, like: ir.Value, shape: tuple[int, ...]) -> ir.Value:
            # a static shape lets unit_axes merge the reshapes around the kernel
            v.shape, v.type = ir.Shape(shape), like.type
            return v

        scale = m.attn.attributes.get("scale")
        scale = float(scale.value) if scale is not None else 1.0 / math.sqrt(d)
        caches = (m.wk.inputs[2], m.wv.inputs[2])
        in_place = [_in_place_ok(c, m.wk.inputs[0]) and not any(
            o.name == IN_PLACE + c.name for o in self.graph.outputs) for c in caches]
        rows = [w.inputs[1] for w in (m.wk, m.wv)]
        out = self.node("GroupQueryAttention", [
            flat(q, h), flat(rows[0], hk), flat(rows[1], hk), *caches, seqlens, total, None,
            None, None, bias], branch, domain=DOMAIN, outputs=3, num_heads=h, kv_num_heads=hk,
            scale=scale)
        typed(out, q, (b, 1, h * d))
        for cache, present, ok in zip(caches, out.producer().outputs[1:], in_place, strict=True):
            if ok:  # the kernel may write the row into the cache itself (``OrtExecutor.grant``)
                present.name = IN_PLACE + cache.name
                present.shape, present.type = cache.shape, cache.type
                self.graph.outputs.append(present)
        result = self.node("Reshape", [out, self.const(f"o{b}_{h}_{d}", np.array(
            [b, h, 1, d], np.int64))], branch)
        detach_branch(self.graph, branch, result)

