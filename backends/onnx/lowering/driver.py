"""The lowering driver: a region GraphModule -> a checked ONNX model that matches eager.

Walks the live nodes in order, asks the one reason function (:class:`.table.Reasons`) about
each, runs the node's emitter from ``OPS``, writes weights as initializers, and then lets ONNX
strict shape inference and the full checker confirm every value has a static shape and a
dtype that agrees with ``meta["val"]``. A disagreement is a lowering bug and is raised, never
papered over.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper
from torch import fx

from fxpass.backends.onnx.lowering.builder import (
    _ONNX_DTYPE,
    LoweringError,
    _Builder,
    _fetch_attr,
    _target_name,
    _val,
)
from fxpass.backends.onnx.lowering.table import OPS, Reasons
from fxpass.graph import bind_args
from fxpass.rules._util import cast_to

aten = torch.ops.aten


def _fail(node: fx.Node, reason: str) -> LoweringError:
    return LoweringError(
        f"cannot lower node '{node.name}' ({_target_name(node.target)}): {reason}. Keep it out of "
        "the BPU region (can_lower() reports this) or add an entry to OPS in "
        "backends/onnx/lowering/table.py."
    )


def _tensor_info(name: str, v: torch.Tensor) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, _ONNX_DTYPE[v.dtype], [int(d) for d in v.shape])


def _live_nodes(results: list[Any]) -> set[fx.Node]:
    live: set[fx.Node] = set()
    stack = [r for r in results if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack.extend(n.all_input_nodes)
    return live


#: a weight to write: (ONNX dtype, shape, a function returning its contiguous array)
Weight = tuple[int, list[int], Callable[[], np.ndarray]]


def _add_weight(weights: dict[str, Weight], n: fx.Node) -> str:
    """A get_attr constant, written as the initializer named after its attribute."""
    name = str(n.target)
    if name not in weights:
        value = _fetch_attr(n)
        if not isinstance(value, torch.Tensor):
            raise _fail(n, f"attribute is a {type(value).__name__}, not a tensor")
        weights[name] = (_ONNX_DTYPE[value.dtype], list(value.shape), lambda: _array(value))
    return name


def _add_view(weights: dict[str, Weight], n: fx.Node) -> str:
    """A weight view (a transpose and/or cast of one weight, see ``WEIGHT_VIEWS``), written as
    one initializer named after the node: computed from the real weight only while it is
    written, so it is the one copy of that weight the lowering makes (folding it in the graph
    first would keep one more for the lifetime of the graph)."""
    v = _val(n)
    weights[n.name] = (_ONNX_DTYPE[v.dtype], [int(d) for d in v.shape], lambda: _array(n))
    src = n.args[0] if n.args else None
    if isinstance(weights, Weights) and isinstance(src, fx.Node) and src.op == "get_attr" \
            and _is_cast(n):
        weights.casts[n.name] = (str(src.target), v.dtype)
    return n.name


def _array(x: fx.Node | torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        t = x if isinstance(x, torch.Tensor) else _view_value(x)
        return t.detach().cpu().contiguous().numpy()


def _view_value(n: fx.Node) -> torch.Tensor:
    if n.op != "call_function":
        value = _fetch_attr(n)
        if not isinstance(value, torch.Tensor):
            raise _fail(n, f"attribute is a {type(value).__name__}, not a tensor")
        return value
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), _view_value)
    return n.target(*args, **kwargs)


class Weights(dict[str, Weight]):
    """The weights of a model lowered with :func:`lower_weightless`: name -> (ONNX dtype,
    shape, array). :func:`write_weights` puts them in; until then the model's initializers of
    those names hold dtype and shape only.

    ``casts`` names the weights that are a plain dtype cast of one attribute of the region
    (a BF16 weight read as float32): name -> (attribute, dtype). A host executor can make
    those from the weight itself instead of reading them back from a file."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: dict[str, tuple[str, torch.dtype]] = {}


def write_weights(model: onnx.ModelProto, weights: Weights) -> onnx.ModelProto:
    """Fill in the data of ``weights``, each straight into the model's own initializer (a
    TensorProto built elsewhere would be copied once more on the way in), one at a time, so
    at most one weight's transient (a transpose or cast) exists beside the model."""
    for t, array in _slots(model, weights):
        t.data_location = onnx.TensorProto.DEFAULT  # in case it was written outside before
        del t.external_data[:]
        t.raw_data = array().tobytes()
    return model


def _slots(model: onnx.ModelProto, weights: Weights) -> Iterator[tuple[onnx.TensorProto, Any]]:
    """(the model's initializer of each weight, made if missing; the weight's array function)."""
    slots = {t.name: t for t in model.graph.initializer if t.name in weights}
    for name, (dtype, shape, array) in weights.items():
        t = slots.get(name)
        if t is None:
            t = model.graph.initializer.add()
            t.name, t.data_type = name, dtype
            t.dims.extend(shape)
        yield t, array


#: Offsets of externally written weights of this size or more are multiples of it: onnxruntime
#: maps a weight straight from the file (at any offset on Linux; 64 KiB is the allocation
#: granularity a mapping needs on Windows). These files are the artifact cache's, where a few
#: percent of padding costs nothing; a package pads to a page only (``aot.package.PAGE``).
EXTERNAL_ALIGN = 64 * 1024


def write_weights_file(
    weights: Weights, path: str, update: Callable[[Any], None] | None = None
) -> dict[str, tuple[int, int]]:
    """Write each weight's bytes to ``path``, in the order of ``weights``; return name ->
    (offset, length). A weight of :data:`EXTERNAL_ALIGN` bytes or more starts at a multiple
    of it (onnxruntime maps it); smaller ones are packed (64 KiB of zeros per norm weight
    would be most of a decode region's file). ``update`` sees every byte written, in order
    (a checksum of the file made while writing it, not by reading it back).

    Why a file, not :func:`write_weights`: raw data inside the protobuf is a copy of every
    weight in the message and another in its serialized bytes; here each weight goes from its
    array to the file once, through the page cache, and onnxruntime maps it back. The file
    depends on ``weights`` alone, not on the model: it can be written while something else
    rewrites the (weightless) model, and :func:`point_external` then points that model's
    initializers at it."""
    layout, offset = {}, 0
    with open(path, "wb") as f:
        for name, (_, _, array) in weights.items():
            a = np.ascontiguousarray(array())
            if a.nbytes:
                pad = bytes(-offset % EXTERNAL_ALIGN if a.nbytes >= EXTERNAL_ALIGN else 0)
                data = memoryview(a.reshape(-1).view(np.uint8))
                for chunk in (pad, data):
                    f.write(chunk)
                    if update is not None:
                        update(chunk)
                offset += len(pad)
            layout[name] = (offset, a.nbytes)
            offset += a.nbytes
            del a
    return layout


def point_external(
    model: onnx.ModelProto, weights: Weights, layout: dict[str, tuple[int, int]], location: str
) -> onnx.ModelProto:
    """Point the initializers of ``weights`` at the file :func:`write_weights_file` wrote."""
    for t, _ in _slots(model, weights):
        offset, length = layout[t.name]
        del t.external_data[:]
        if not length:
            t.data_location = onnx.TensorProto.DEFAULT
            t.raw_data = b""
            continue
        t.ClearField("raw_data")
        t.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
            entry = t.external_data.add()
            entry.key, entry.value = k, v
    return model


def _is_static(vi: onnx.ValueInfoProto | None) -> bool:
    tensor_type = vi.type.tensor_type if vi is not None else None
    return bool(
        tensor_type
        and tensor_type.HasField("shape")
        and all(d.HasField("dim_value") for d in tensor_type.shape.dim)
    )


def _check_static(model: onnx.ModelProto) -> None:
    g = model.graph
    known = {vi.name: vi for vi in [*g.value_info, *g.output]}
    for nd in g.node:
        for out in filter(None, nd.output):
            if not _is_static(known.get(out)):
                raise LoweringError(
                    f"ONNX node '{nd.name}' ({nd.op_type}) output '{out}' has no static shape "
                    "after shape inference; fix its emitter in backends/onnx/lowering/"
                )


def lower(gm: fx.GraphModule, name: str = "region", opset: int = 18) -> onnx.ModelProto:
    """Lower a region GraphModule to a checked ONNX model that matches eager PyTorch.

    Graph inputs are the placeholders (same names and order), outputs are ``out0..outN-1``,
    get_attr constants become initializers named after their attribute (a weight view, named
    after its last node), and every intermediate carries its static dtype/shape. Nodes not
    needed by the outputs are ignored.
    """
    model, weights = lower_weightless(gm, name, opset)
    return write_weights(model, weights)


_TRANSPOSES = (aten.t.default, aten.transpose.int, aten.permute.default)


def _is_cast(n: fx.Node) -> bool:
    """``n`` is a plain dtype cast (the canonical ``_to_copy(x, dtype=d)``, or
    ``convert_element_type`` in a graph the rules did not canonicalize)."""
    if n.target is torch.ops.prims.convert_element_type.default:
        return len(n.args) == 2
    return cast_to(n) is not None


def _transposed_weight(v: Any) -> fx.Node | None:
    """``W`` when ``v`` is a 2-D transpose (``t``, ``transpose``, ``permute``) of a float32
    get_attr ``W`` or of a float32 cast of one (a BF16 weight: the cast is what is written, or
    made in memory by the host executor, untransposed), else None."""
    if not isinstance(v, fx.Node) or v.op != "call_function" or v.target not in _TRANSPOSES:
        return None
    w = v.args[0]
    if not isinstance(w, fx.Node):
        return None
    if w.op == "call_function" and _is_cast(w) and isinstance(w.args[0], fx.Node) \
            and w.args[0].op == "get_attr":
        value = _val(w)
    elif w.op == "get_attr":
        value = _fetch_attr(w)
    else:
        return None
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.dtype != torch.float32:
        return None
    if v.target is aten.permute.default and [d % 2 for d in v.args[1]] != [1, 0]:
        return None
    return w


def _gemm_operand(n: fx.Node) -> fx.Node | None:
    """The transpose view ``mm``/``addmm`` (alpha = beta = 1, float32) reads as its second
    matrix, when it can run as ``Gemm(x, W, transB=1)`` over ``W`` itself."""
    if n.op != "call_function" or n.target not in (aten.mm.default, aten.addmm.default):
        return None
    a = bind_args(n)
    mat2 = a["mat2"]
    if n.target is aten.addmm.default and (a["beta"] != 1 or a["alpha"] != 1):
        return None
    x = a["self"] if n.target is aten.mm.default else a["mat1"]
    if not (isinstance(x, fx.Node) and _val(x).dtype == torch.float32):
        return None
    return mat2 if _transposed_weight(mat2) is not None else None


def _gemm_nodes(live: set[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Matmul -> the transpose view it reads, for views whose every live reader is a Gemm-able
    matmul: lowered as ``Gemm(transB=1)`` over the weight, the view never materialized."""
    found = {n: v for n in live if (v := _gemm_operand(n)) is not None}
    ok = {v for v in set(found.values()) if all(found.get(u) is v for u in v.users if u in live)}
    return {n: v for n, v in found.items() if v in ok}


def _gemm_emitter(weights: dict[str, Weight]) -> Callable:
    def emit(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
        src = _transposed_weight(a["mat2"])
        w = (_add_weight if src.op == "get_attr" else _add_view)(weights, src)
        if n.target is aten.mm.default:
            return b.op("Gemm", b.t(a["self"], torch.float32), w, transB=1)
        prod = b.op("Gemm", b.t(a["mat1"], torch.float32), w, transB=1)
        return b.op("Add", b.t(a["self"], torch.float32), prod)  # as _addmm: bias + product

    return emit


def lower_weightless(
    gm: fx.GraphModule, name: str = "region", opset: int = 18, gemm: bool = False
) -> tuple[onnx.ModelProto, Weights]:
    """:func:`lower`, with the weights' data left out: their initializers carry dtype and
    shape only, and :func:`write_weights` fills them in later. A caller that rewrites the model
    first (host fusions) then handles kilobytes instead of every weight, twice.

    ``gemm=True`` (host regions) lowers ``mm(x, t(W))`` / ``addmm(b, x, t(W))`` over a float32
    weight as ``Gemm(x, W, transB=1)``: the initializer is ``W`` itself, so it can be the
    caller's own tensor (``host.prepare.shared_weights``) and no transposed copy is ever made. The
    board path keeps ``MatMul`` over the transposed initializer, the standard form hbdk4 and
    the quantizer expect."""
    if opset < 18:
        raise LoweringError(f"opset {opset} is too old: emitters use opset-18 forms; use >= 18")
    b, reasons = _Builder(), Reasons()
    weights = Weights()
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    res = out_node.args[0]
    results = list(res) if isinstance(res, tuple | list) else [res]
    live = _live_nodes(results)
    gemm_nodes = _gemm_nodes(live) if gemm else {}
    gemm_views = set(gemm_nodes.values())
    gemm_emit = _gemm_emitter(weights)
    inputs = []
    for n in gm.graph.nodes:
        if n.op != "placeholder" and (n not in live or n.op == "output"):
            continue
        reason = reasons(n)
        if reason:
            raise _fail(n, reason)
        if n.op == "placeholder":
            inputs.append(_tensor_info(n.name, _val(n)))
            b.names[n] = n.name
        elif n.op == "get_attr" or reasons.weight_view(n):
            if n in gemm_views:
                continue  # read by Gemm(transB=1) as the weight itself
            if n.users and all(reasons.weight_view(u) for u in n.users if u in live):
                continue  # inside a weight view: written once, at the chain's end
            add = _add_weight if n.op == "get_attr" else _add_view
            b.names[n] = add(weights, n)
        elif n.target is operator.getitem:
            src, idx = n.args
            b.names[n] = b.tuples[src][idx]
            if not b.names[n]:
                raise _fail(n, f"element {idx} was not produced by the emitter of '{src.name}'")
        elif n in gemm_nodes:
            b.emit(n, gemm_emit)
        else:
            b.emit(n, OPS[n.target].emit)

    outputs = []
    for k, r in enumerate(results):
        if not isinstance(r, fx.Node) or not isinstance(_val(r), torch.Tensor):
            raise LoweringError(f"region '{name}' output {k} is {r!r}, not a tensor node")
        b.nodes.append(helper.make_node("Identity", [b.names[r]], [f"out{k}"], name=f"out{k}"))
        outputs.append(_tensor_info(f"out{k}", _val(r)))

    # Weights enter as graph inputs for shape inference and the checker (which serialize the
    # whole model, several times): they need only dtype and shape. The data goes in last.
    weight_inputs = [helper.make_tensor_value_info(k, d, s) for k, (d, s, _) in weights.items()]
    graph = helper.make_graph(
        b.nodes,
        name,
        inputs + weight_inputs,
        outputs,
        initializer=list(b.inits.values()),
        value_info=[_tensor_info(k, v) for k, v in b.declared.items()],
    )
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(
        graph,
        opset_imports=opsets,
        producer_name="fxpass.bpu",
        ir_version=helper.find_min_ir_version_for(opsets),
    )
    try:
        # strict inference fills in helper values and rejects any disagreement with meta["val"]
        model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        _check_static(model)
        onnx.checker.check_model(model, full_check=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as e:
        raise LoweringError(
            f"region '{name}' lowered to an invalid ONNX model ({e}); this is a bug in an "
            "emitter in backends/onnx/lowering/ — the failing node name is the FX node name"
        ) from e
    del model.graph.input[len(inputs) :]
    for k, (dtype, shape, _) in weights.items():  # placeholders: dtype and shape, no data
        t = model.graph.initializer.add()
        t.name, t.data_type = k, dtype
        t.dims.extend(shape)
    return model, weights
