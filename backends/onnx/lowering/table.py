"""The one table of what a region can hold, and the one function that says why a node cannot.

``OPS`` maps each aten overload to an :class:`Op`: its ONNX emitter, the BPU operator family it
belongs to (from ``docs/bpu-facts.md``; a march enables families), its argument check, which
tuple elements ONNX computes, and whether the BPU's reduce-axis limit applies. Adding an op is
one entry here. The partitioner (through a device's capability, e.g. the BPU's)
and the lowering (through :func:`can_lower`) both ask :class:`Reasons`, so a node the
capability accepts is a node the lowering can emit, by construction.

Family ``"unlisted"``: ops we can lower exactly, but which are not on the BPU's published
operator list. No march enables it, so they stay on the CPU in a compiled model; the lowering
still emits them (tests, and a future march that lists them, use that).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from fxpass.backends.onnx.lowering import checks as ck
from fxpass.backends.onnx.lowering import emitters as e
from fxpass.backends.onnx.lowering import nn
from fxpass.backends.onnx.lowering.builder import Emitter, _target_name, _val
from fxpass.graph import FROZEN, bind_args
from fxpass.rules.constant_folding import WEIGHT_VIEWS as FOLDING_VIEWS

if TYPE_CHECKING:
    from fxpass.backends.onnx.lowering.builder import Limits as March

aten, prims = torch.ops.aten, torch.ops.prims


@dataclass(frozen=True)
class Op:
    emit: Emitter
    family: str
    check: Any = None  # (node) -> reason | None: arguments without an exact ONNX form
    outputs: frozenset[int] | None = None  # tuple ops: the elements ONNX computes (None: all)
    reduces: bool = False  # the BPU's reduce-axis size limit applies to the last input dim


def _fam(family: str, ops: dict[Any, Emitter | tuple], **common: Any) -> dict[Any, Op]:
    """Entries of one family; a value is an emitter, or ``(emitter, {field: value})``."""
    out = {}
    for t, v in ops.items():
        emit, extra = v if isinstance(v, tuple) else (v, {})
        out[t] = Op(emit, family, **(common | extra))
    return out


_FIRST = frozenset({0})
_REDUCE = {"reduces": True}
_POOL = {"check": ck.check_pool, "outputs": _FIRST}
_BOOL_ARITH = {"check": ck.check_bool_arith}
_FLOAT_POW = {"check": ck.check_float_pow}

OPS: dict[Any, Op] = {
    **_fam(
        "tensor_engine",
        {
            aten.convolution.default: (nn._conv, {"check": ck.check_conv}),
            aten.linear.default: e._linear,
            aten.addmm.default: e._addmm,
            aten.mm.default: e._binary("MatMul"),
            aten.bmm.default: e._binary("MatMul"),
            aten.baddbmm.default: e._addmm,
            aten.matmul.default: e._binary("MatMul"),
        },
    ),
    **_fam(
        "norm",
        {
            aten.native_layer_norm.default: (nn._layer_norm, _REDUCE),
            aten._native_batch_norm_legit_no_training.default: (
                nn._batch_norm,
                {"check": ck.check_batch_norm, "outputs": _FIRST},
            ),
        },
    ),
    **_fam(
        "activation",
        {
            aten.relu.default: e._unary("Relu"),
            aten.hardtanh.default: e._clip,
            aten.hardswish.default: e._hardswish,
            aten.sigmoid.default: e._unary("Sigmoid"),
            aten.tanh.default: e._unary("Tanh"),
            aten.silu.default: e._silu,
            aten.gelu.default: e._gelu,
        },
    ),
    **_fam(
        "pool",
        {
            aten.max_pool2d_with_indices.default: (nn._max_pool, _POOL),
            aten.avg_pool2d.default: (nn._avg_pool, {"check": ck.check_pool}),
            aten._adaptive_avg_pool2d.default: (nn._adaptive_avg_pool, {"check": ck.check_pool}),
            aten.mean.dim: (e._reduce("ReduceMean"), _REDUCE),
        },
    ),
    **_fam(
        "arith",
        {
            aten.add.Tensor: (e._arith("Add"), _BOOL_ARITH),
            aten.sub.Tensor: (e._arith("Sub"), _BOOL_ARITH),
            aten.mul.Tensor: (e._arith("Mul"), _BOOL_ARITH),
            aten.div.Tensor: e._arith("Div"),
        },
    ),
    **_fam(
        "rmsnorm",
        {
            aten.pow.Tensor_Scalar: (e._pow_scalar, _FLOAT_POW),
            aten.rsqrt.default: e._rsqrt,
            aten.sqrt.default: e._unary("Sqrt"),
            aten.neg.default: e._unary("Neg"),
        },
    ),
    **_fam(
        "data_movement",
        {
            aten.view.default: e._reshape,
            aten.reshape.default: e._reshape,
            aten._unsafe_view.default: e._reshape,
            aten.permute.default: e._transpose,
            aten.transpose.int: e._transpose,
            aten.t.default: e._transpose,
            aten.cat.default: e._cat,
            aten.clone.default: e._alias,
            aten.squeeze.dim: e._reshape,
            aten.squeeze.dims: e._reshape,
            aten.unsqueeze.default: e._reshape,
            aten.slice.Tensor: e._slice,
            aten.expand.default: e._expand,
            aten.select.int: e._select,
            aten.split.Tensor: e._split,
            aten.split_with_sizes.default: e._split,
        },
    ),
    **_fam(
        "masking",
        {
            aten._softmax.default: (e._softmax("Softmax"), _REDUCE),
            aten.eq.Scalar: e._compare("Equal"),
            aten.all.dim: (e._reduce_bool("ReduceMin"), _REDUCE),
            aten.any.dim: (e._reduce_bool("ReduceMax"), _REDUCE),
            aten.zeros_like.default: nn._full_like,
            aten.where.self: e._where,
            prims.convert_element_type.default: e._alias,
            aten._to_copy.default: (e._alias, {"check": ck.check_to_copy}),
            aten.masked_fill.Scalar: e._masked_fill,
        },
    ),
    **_fam(
        "unlisted",
        {
            # arithmetic
            aten.add.Scalar: (e._arith("Add"), _BOOL_ARITH),
            aten.sub.Scalar: (e._arith("Sub"), _BOOL_ARITH),
            aten.mul.Scalar: (e._arith("Mul"), _BOOL_ARITH),
            aten.div.Scalar: e._arith("Div"),
            aten.div.Tensor_mode: (e._arith("Div"), {"check": ck.check_rounding}),
            aten.div.Scalar_mode: (e._arith("Div"), {"check": ck.check_rounding}),
            aten.pow.Tensor_Tensor: (e._binary("Pow"), _FLOAT_POW),
            aten.pow.Scalar: (e._binary("Pow"), _FLOAT_POW),
            aten.minimum.default: e._binary("Min"),
            aten.maximum.default: e._binary("Max"),
            # elementwise
            aten.abs.default: e._unary("Abs"),
            aten.exp.default: e._unary("Exp"),
            aten.log.default: e._unary("Log"),
            aten.reciprocal.default: e._unary("Reciprocal"),
            aten.erf.default: e._unary("Erf"),
            aten.cos.default: e._unary("Cos"),
            aten.sin.default: e._unary("Sin"),
            aten.hardsigmoid.default: e._unary("HardSigmoid", alpha=1 / 6, beta=0.5),
            aten.clamp.default: e._clip,
            aten.clamp_min.default: e._clip,
            aten.clamp_max.default: e._clip,
            # layout
            aten.squeeze.default: e._reshape,
            aten.contiguous.default: e._alias,
            aten.alias.default: e._alias,
            # reductions
            aten.mean.default: (e._reduce("ReduceMean"), _REDUCE),
            aten.sum.dim_IntList: (e._reduce("ReduceSum"), _REDUCE),
            aten.sum.default: (e._reduce("ReduceSum"), _REDUCE),
            aten.amax.default: (e._reduce("ReduceMax"), _REDUCE),
            aten.amin.default: (e._reduce("ReduceMin"), _REDUCE),
            aten.all.dims: (e._reduce_bool("ReduceMin"), _REDUCE),
            aten.all.default: (e._reduce_bool("ReduceMin"), _REDUCE),
            aten.any.dims: (e._reduce_bool("ReduceMax"), _REDUCE),
            aten.any.default: (e._reduce_bool("ReduceMax"), _REDUCE),
            aten._log_softmax.default: (e._softmax("LogSoftmax"), _REDUCE),
            # selection, comparison, logic
            aten.where.ScalarSelf: e._where,
            aten.where.ScalarOther: e._where,
            aten.where.Scalar: e._where,
            aten.masked_fill.Tensor: e._masked_fill,
            aten.eq.Tensor: e._compare("Equal"),
            aten.ne.Tensor: e._compare("Equal", negate=True),
            aten.ne.Scalar: e._compare("Equal", negate=True),
            aten.lt.Tensor: e._compare("Less"),
            aten.lt.Scalar: e._compare("Less"),
            aten.le.Tensor: e._compare("LessOrEqual"),
            aten.le.Scalar: e._compare("LessOrEqual"),
            aten.gt.Tensor: e._compare("Greater"),
            aten.gt.Scalar: e._compare("Greater"),
            aten.ge.Tensor: e._compare("GreaterOrEqual"),
            aten.ge.Scalar: e._compare("GreaterOrEqual"),
            aten.logical_not.default: e._logical("Not"),
            aten.logical_and.default: e._logical("And"),
            aten.logical_or.default: e._logical("Or"),
            aten.logical_xor.default: e._logical("Xor"),
            aten.bitwise_not.default: (e._logical("Not"), {"check": ck.check_bitwise}),
            aten.bitwise_and.Tensor: (e._logical("And"), {"check": ck.check_bitwise}),
            aten.bitwise_or.Tensor: (e._logical("Or"), {"check": ck.check_bitwise}),
            aten.bitwise_xor.Tensor: (e._logical("Xor"), {"check": ck.check_bitwise}),
            # normalization (the training-capable overload; check_batch_norm admits eval only)
            aten.native_batch_norm.default: (
                nn._batch_norm,
                {"check": ck.check_batch_norm, "outputs": _FIRST},
            ),
            # factories
            aten.ones_like.default: nn._full_like,
            aten.full_like.default: nn._full_like,
            aten.scalar_tensor.default: nn._scalar_tensor,
            # table lookup: int64 ids are admitted as its indices on the host (Reasons.value)
            aten.embedding.default: e._embedding,
        },
    ),
}

#: Pure layout/dtype ops. A chain of them over one constant (a frozen weight, a get_attr) is a
#: *weight view*: the lowering computes it once from the real weight and writes the result as
#: one initializer (a transposed and/or float32 copy of a bf16 weight), so no rule has to
#: materialize it in the graph first, and no emitter runs for it. Its family does not matter:
#: nothing of it runs on the device. A superset, by construction, of what ``constant_folding``
#: leaves unfolded (its ``WEIGHT_VIEWS``).
WEIGHT_VIEWS = FOLDING_VIEWS | {
    aten.squeeze.default,
    aten.contiguous.default,
    aten.alias.default,
}

#: aten overload -> emitter (a view of ``OPS`` for callers that only need the emitter)
LOWERINGS: dict[Any, Emitter] = {t: op.emit for t, op in OPS.items()}
FAMILIES: dict[str, tuple[Any, ...]] = {}
for _t, _op in OPS.items():
    FAMILIES.setdefault(_op.family, ())
    FAMILIES[_op.family] += (_t,)


class Reasons:
    """Why a node cannot run in a region of ``march`` (None if it can); ``march=None`` asks
    only whether the lowering can emit it. The one reason function of the backend.

    Verdicts are cached per node and per value: a value feeds several nodes, and checking its
    dtype, rank and static shape once per value is what keeps partitioning linear on
    100k-node graphs. Build a new instance after editing the graph.
    """

    def __init__(self, march: March | None = None) -> None:
        self.march = march
        self._value: dict[fx.Node, str | None] = {}
        self._node: dict[fx.Node, str | None] = {}
        self._views: dict[fx.Node, bool] = {}

    def weight_view(self, n: fx.Node) -> bool:
        """Whether ``n`` is a chain of ``WEIGHT_VIEWS`` ops over one constant (see there)."""
        if n.target not in WEIGHT_VIEWS or n.op != "call_function":
            return False  # the common case, decided without building input lists
        if n in self._views:
            return self._views[n]
        ins = n.all_input_nodes
        ok = len(ins) == 1 and (is_constant(ins[0]) or self.weight_view(ins[0]))
        self._views[n] = ok
        return ok

    def _view_reason(self, node: fx.Node) -> str | None:
        """A weight view (or a constant only weight views read) may hold any dtype torch can
        compute in: it is written as an initializer in its *consumers'* dtype, which their own
        input checks judge. Only a static shape within the rank limit is needed, and a value
        that leaves the chain must be one the region can hold."""
        v = _val(node)
        if not isinstance(v, torch.Tensor) or not all(isinstance(d, int) for d in v.shape):
            return ck.tensor_reason(v)
        if node.users and not all(self.weight_view(u) for u in node.users):
            why = self.value(node)  # leaves the chain: consumers (or the region) read it
            if why:
                return why
        if self.march is not None and v.dim() > self.march.max_rank:
            return f"rank {v.dim()} > {self.march.max_rank}"
        op = OPS.get(node.target)
        return op.check(node) if op is not None and op.check is not None else None

    def __call__(self, node: fx.Node) -> str | None:
        if node in self._node:
            return self._node[node]
        why = self._node[node] = self._reason(node)
        return why

    def value(self, n: fx.Node) -> str | None:
        """Why the value ``n`` produces cannot live in a region (tuples: the elements ONNX
        computes for this op; the others must be unused, which ``_reason`` checks)."""
        if n in self._value:
            return self._value[n]
        v, why = _val(n), None
        if v is None:
            why = "no meta['val']; run FakeTensorProp on the graph first"
        elif isinstance(v, tuple | list):
            op = OPS.get(n.target) if n.op == "call_function" else None
            produced = op.outputs if op is not None else None
            for i, x in enumerate(v):
                if produced is None or i in produced:
                    r = ck.tensor_reason(x, self.march)
                    if r:
                        why = f"output {i}: {r}"
                        break
        else:
            why = ck.tensor_reason(v, self.march)
            if why and self.march is None and v.dtype == torch.int64 and _lookup_ids(n):
                why = None
        self._value[n] = why
        return why

    def _reason(self, node: fx.Node) -> str | None:
        if node.op == "output":
            return None
        if node.op in ("placeholder", "get_attr"):
            if is_constant(node) and node.users and all(self.weight_view(u) for u in node.users):
                return self._view_reason(node)
            return self.value(node)
        if node.op != "call_function":
            return f"{node.op} nodes are not lowered; only aten call_function nodes are"
        if node.target is operator.getitem:
            return self._element(node)
        if self.weight_view(node):
            return self._view_reason(node)
        if isinstance(_val(node), torch.SymInt | torch.SymBool | torch.SymFloat):
            return "symbolic scalar arithmetic (host-side integer index arithmetic)"
        t, m = node.target, self.march
        op = OPS.get(t)
        if m is not None and (op is None or op.family not in m.families):
            return f"{t} is not in the {m.name} operator table"
        if op is None:
            return f"no ONNX lowering for {_target_name(t)}"
        for i in node.all_input_nodes:
            why = self.value(i)
            if why:
                return why
        why = self.value(node)
        if why:
            return why
        if isinstance(_val(node), tuple | list):
            why = _unproduced_use(node, op)
            if why:
                return why
        if op.reduces and node.all_input_nodes and _val(node.all_input_nodes[0]).dim() == 0:
            # aten reduces a 0-dim tensor over dim 0/-1; ONNX Reduce*/Softmax axes need rank>=1
            return "reduction over a 0-dim tensor (ONNX reduce axes need rank >= 1)"
        if op.reduces and m is not None and node.all_input_nodes:
            x = _val(node.all_input_nodes[0])
            if any(s > m.max_reduce for s in x.shape[-1:]):
                return f"reduce axis size {x.shape[-1]} > {m.max_reduce}"
        return op.check(node) if op.check is not None else None

    def _element(self, node: fx.Node) -> str | None:
        src, idx = node.args
        if not isinstance(src, fx.Node) or src.op != "call_function" or src.target not in OPS:
            if self.march is not None and isinstance(src, fx.Node):
                why = self(src)
                return f"element of a rejected tuple ({why})" if why else None
            return "getitem of a value that has no ONNX lowering"
        why = self(src)
        if why:
            return f"element of a rejected tuple ({why})"
        produced = OPS[src.target].outputs
        if produced is not None and idx not in produced:
            return None  # dead (``_unproduced_use`` rejects the tuple op otherwise): never emitted
        return self.value(node)


def _lookup_ids(n: fx.Node) -> bool:
    """Whether int64 ``n`` is only ever read as the ids of table lookups (``aten.embedding``).

    Why: the host device takes a model's embedding into its region (one onnxruntime call per
    step instead of a torch lookup in front of it), and token ids are int64. Other int64
    values (positions, index arithmetic) stay outside: ONNX's integer kernels differ from
    aten's (overflow, division), and the board has no int64 at all (a march never admits
    this: ``march=None`` is the host lowering)."""
    return bool(n.users) and all(
        u.target is aten.embedding.default and bind_args(u)["indices"] is n
        and bind_args(u)["weight"] is not n for u in n.users)


def _unproduced_use(node: fx.Node, op: Op) -> str | None:
    """A tuple op whose result is used whole, or whose unproduced elements are used, cannot be
    a region member: the region would have to return something ONNX does not compute."""
    name = _target_name(node.target)
    for u in node.users:
        if u.target is not operator.getitem:
            return f"the whole tuple result of {name} is used (only its elements can be)"
        if op.outputs is not None and u.args[1] not in op.outputs and u.users:
            return (
                f"output {u.args[1]} of {name} is used; ONNX computes only output(s) "
                f"{sorted(op.outputs)} of it (no pooling indices or batch statistics)"
            )
    return None


def is_constant(n: fx.Node) -> bool:
    """A get_attr, or a placeholder the backend froze (``meta[FROZEN]`` holds the weight)."""
    return n.op == "get_attr" or (n.op == "placeholder" and FROZEN in n.meta)


def can_lower(node: fx.Node) -> str | None:
    """Why the lowering cannot emit ``node`` (None if it can); no march limits. One-off use;
    for many nodes of one graph keep a :class:`Reasons` instance (it caches)."""
    return Reasons()(node)
