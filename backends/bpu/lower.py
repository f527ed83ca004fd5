"""Lower a BPU *region* (a small aten FX GraphModule) to a validated ONNX model.

The BPU toolchain consumes ONNX, so every region the partitioner hands over must become an
``onnx.ModelProto`` that (a) passes the full ONNX checker, (b) has a static shape and dtype on
every value, and (c) computes what eager PyTorch computes. ONNX has no implicit type promotion,
so each emitter casts its operands to the dtype PyTorch would compute in; the node's
``meta["val"].dtype`` is the ground truth for the result. Shape-inference conflicts between
ONNX and ``meta["val"]`` are treated as lowering bugs and raised, never papered over.

``LOWERINGS`` is the single table of emitters; the capability table asks ``target in LOWERINGS``
and :func:`can_lower` for a cheap, human-readable veto before a node enters a region.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import fx

from fxpass.graph import bind_args

aten = torch.ops.aten

__all__ = ["LOWERINGS", "LoweringError", "can_lower", "lower"]


class LoweringError(ValueError):
    """A region cannot be turned into ONNX; the message names the node and what to do."""


_ONNX_DTYPE = {
    torch.float32: TensorProto.FLOAT,
    torch.float16: TensorProto.FLOAT16,
    torch.int32: TensorProto.INT32,
    torch.int16: TensorProto.INT16,
    torch.int8: TensorProto.INT8,
    torch.uint8: TensorProto.UINT8,
    torch.bool: TensorProto.BOOL,
    torch.int64: TensorProto.INT64,  # only for shape/axes initializers we create ourselves
}
_NP_DTYPE = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
    torch.int64: np.int64,
}
_DATA_DTYPES = frozenset(_ONNX_DTYPE) - {torch.int64}
# onnxruntime's CPU kernels for Where/Min/Max/MatMul/Pow/Relu/ReduceMax skip some narrow
# integer and bool types; those ops compute in int32 and cast back (same wrap-around result).
_NARROW = frozenset({torch.int8, torch.uint8, torch.int16, torch.bool})


def _target_name(target: object) -> str:
    if isinstance(target, torch._ops.OperatorBase):
        return str(target)
    return getattr(target, "__name__", repr(target))


def _val(x: fx.Node) -> Any:
    """``meta["val"]``; a get_attr without it falls back to the real constant it names."""
    val = x.meta.get("val")
    if val is None and x.op == "get_attr":
        val = _fetch_attr(x)
    return val


def _fetch_attr(x: fx.Node) -> Any:
    return functools.reduce(getattr, str(x.target).split("."), x.graph.owning_module)


def _dtype(x: fx.Node) -> torch.dtype:
    return _val(x).dtype


def _shape(x: fx.Node) -> list[int]:
    return [int(d) for d in _val(x).shape]


def _widen(dt: torch.dtype) -> torch.dtype:
    return torch.int32 if dt in _NARROW else dt


def _result_type(a: Any, b: Any) -> torch.dtype:
    """PyTorch's promotion of two operands; only dtype and 0-dim-ness matter, so use stand-ins."""

    def stand_in(x: Any) -> Any:
        if isinstance(x, fx.Node):
            return torch.empty((0,) if _val(x).dim() else (), dtype=_dtype(x))
        return x

    return torch.result_type(stand_in(a), stand_in(b))


class _Builder:
    """Accumulates ONNX nodes/initializers for one region; names derive from FX node names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, TensorProto] = {}
        self.names: dict[fx.Node, str] = {}  # FX value -> ONNX value name
        self.tuples: dict[fx.Node, list[str]] = {}  # tuple-producing node -> element names
        self.declared: dict[str, Any] = {}  # ONNX value name -> meta["val"] for value_info
        self.cur = ""
        self._temps = 0
        self._op_counts: dict[str, int] = {}

    # -- primitives used by emitters ---------------------------------------------------------
    def op(self, op_type: str, *inputs: str, n_out: int = 1, **attrs: Any) -> Any:
        """Append one ONNX node; returns its temp output name (a list when ``n_out > 1``)."""
        ins = list(inputs)
        while ins and not ins[-1]:
            ins.pop()  # trailing optional inputs are simply omitted
        self._temps += n_out
        outs = [f"{self.cur}/t{self._temps - n_out + i}" for i in range(n_out)]
        k = self._op_counts.get(op_type, 0)
        self._op_counts[op_type] = k + 1
        node_name = f"{self.cur}/{op_type}" + (f"_{k}" if k else "")
        self.nodes.append(helper.make_node(op_type, ins, outs, name=node_name, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value: Any, dtype: torch.dtype) -> str:
        """A small initializer holding a Python scalar/list in ``dtype`` (never a Constant node)."""
        self._temps += 1
        name = f"{self.cur}/c{self._temps}"
        arr = np.asarray(value).astype(_NP_DTYPE[dtype])
        self.inits[name] = numpy_helper.from_array(arr, name)
        return name

    def ints(self, values: list[int]) -> str:
        return self.const(np.asarray(values, dtype=np.int64), torch.int64)

    def cast(self, name: str, src: torch.dtype, dst: torch.dtype) -> str:
        return name if src == dst else self.op("Cast", name, to=_ONNX_DTYPE[dst])

    def t(self, x: Any, dtype: torch.dtype | None = None) -> str:
        """ONNX name for an FX operand, cast to ``dtype``; Python scalars become initializers."""
        if x is None:
            return ""
        if isinstance(x, fx.Node):
            return self.cast(self.names[x], _dtype(x), dtype or _dtype(x))
        if dtype is None:
            raise TypeError(f"scalar operand {x!r} needs an explicit dtype")
        return self.const(x, dtype)

    # -- driver --------------------------------------------------------------------------------
    def emit(self, n: fx.Node) -> None:
        self.cur, self._temps, self._op_counts = n.name, 0, {}
        start, inits_before = len(self.nodes), set(self.inits)
        out = LOWERINGS[n.target](self, n, bind_args(n))
        val = _val(n)
        if isinstance(out, str):
            self.names[n] = self._settle(out, n.name, val, start, inits_before)
            return
        wanted = _element_names(n, len(out))
        self.tuples[n] = [
            self._settle(o, wanted[i], val[i], start, inits_before) if o else ""
            for i, o in enumerate(out)
        ]

    def _settle(self, r: str, want: str, val: Any, start: int, inits_before: set[str]) -> str:
        """Give the emitter's result value its FX-derived name (or alias an existing value)."""
        new = self.nodes[start:]
        if any(r in nd.output for nd in new):
            for nd in new:
                for field in (nd.input, nd.output):
                    renamed = [want if v == r else v for v in field]
                    del field[:]
                    field.extend(renamed)
            self.declared[want] = val
            return want
        if r in self.inits and r not in inits_before:
            tensor = self.inits.pop(r)
            tensor.name = want
            self.inits[want] = tensor
            return want
        return r


def _getitems(n: fx.Node) -> dict[int, fx.Node]:
    items: dict[int, fx.Node] = {}
    for u in n.users:
        if u.target is operator.getitem:
            items.setdefault(u.args[1], u)
    return items


def _element_names(n: fx.Node, count: int) -> list[str]:
    items = _getitems(n)
    return [items[i].name if i in items else f"{n.name}/{i}" for i in range(count)]


def _first(a: dict[str, Any], k: int) -> list[Any]:
    return list(a.values())[:k]


def _axes(dims: Any, rank: int) -> list[int]:
    """Normalise an aten ``dim`` argument (int, list, None or [] meaning all) to sorted axes."""
    if dims is None or (isinstance(dims, list | tuple) and not dims):
        return list(range(rank))
    dims = [dims] if isinstance(dims, int) else dims
    return sorted(d % rank if rank else 0 for d in dims)


def _pair(v: Any, k: int) -> list[int]:
    v = [v] if isinstance(v, int) else list(v)
    return v * k if len(v) == 1 else v


Emitter = Callable[[_Builder, fx.Node, dict[str, Any]], "str | list[str]"]


# ---- non-finite values ---------------------------------------------------------------------
# Some onnxruntime CPU kernels treat NaN, +-inf or huge values unlike aten. The emitters below
# fix exactly those ops and leave the others alone (tests/backends/test_lower_nonfinite.py
# pins every audited op against eager, at every ORT optimization level):
# * amax/amin (ReduceMax/ReduceMin) and max_pool2d (MaxPool) skip NaN, and float32 MaxPool
#   can return -FLT_MAX for an all -inf window: _reduce, _max_pool. A dilated float32
#   max_pool2d stays on the host (_check_pool): its check would need opset-19 AveragePool;
# * a Clip with an omitted bound clamps +-inf to the largest finite value: _clip;
# * pow(x, +-0.5), gelu (erf form) and hardswish overflow or produce NaN at +-inf in different
#   places: _pow_scalar, _gelu, _hardswish.
# Accepted differences, not worth an extra pass on hot paths:
# * the sign of zero out of Where's first branch (onnxruntime returns +0 for a -0) and of a
#   ReduceSum of mixed zeros; it matters only if the zero is divided by later;
# * overflow that depends on accumulation order (huge values in sums, means, matmul, conv,
#   average pools, layer-norm variance with |x| > ~1e19): eager's own kernels differ there;
# * add/sub with alpha != 1 and a tensor operand: eager fuses x + alpha * y (FMA), ONNX rounds
#   alpha * y first, so inf/NaN can differ only when |alpha * y| overflows and the sum does not;
# * addmm with alpha=0: eager's float32 BLAS path never reads the product (drops its NaN),
#   its float16 and small-baddbmm paths do; the lowering always propagates.
def _nan_flags(b: _Builder, x: str, dt: torch.dtype) -> str:
    """1 where ``x`` is NaN, else 0, in the float dtype ``dt`` (reducible and poolable)."""
    return b.op("Cast", b.op("IsNaN", x), to=_ONNX_DTYPE[dt])


def _nan_where(b: _Builder, hits: str, out: str, dt: torch.dtype) -> str:
    """``out`` with NaN wherever the reduced/pooled NaN flags ``hits`` are positive."""
    # ``out`` is Where's second branch: onnxruntime keeps the sign of a -0 there
    return b.op("Where", b.op("Greater", hits, b.const(0.0, dt)), b.const(math.nan, dt), out)


# ---- emitters ------------------------------------------------------------------------------
def _widened(b: _Builder, n: fx.Node, op_type: str, *xs: Any, **attrs: Any) -> str:
    """``op_type`` on operands promoted to the result dtype, via int32 for narrow ints/bool."""
    dt = _dtype(n)
    ct = _widen(dt)
    return b.cast(b.op(op_type, *(b.t(x, ct) for x in xs), **attrs), ct, dt)


def _arith(op_type: str) -> Emitter:
    def emit(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
        x, y = _first(a, 2)
        dt, alpha = _dtype(n), a.get("alpha", 1)
        if alpha != 1 and not isinstance(y, fx.Node):
            y, alpha = y * alpha, 1
        yv = b.t(y, dt)
        if alpha != 1:
            yv = b.op("Mul", yv, b.const(alpha, dt))
        return b.op(op_type, b.t(x, dt), yv)

    return emit


def _unary(op_type: str, **attrs: Any) -> Emitter:
    def emit(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
        return _widened(b, n, op_type, _first(a, 1)[0], **attrs)

    return emit


def _binary(op_type: str) -> Emitter:
    def emit(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
        return _widened(b, n, op_type, *_first(a, 2))

    return emit


def _compare(op_type: str, negate: bool = False) -> Emitter:
    def emit(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
        x, y = _first(a, 2)
        ct = _result_type(x, y)
        if ct == torch.bool and op_type != "Equal":
            ct = torch.int32  # ONNX orders numbers only
        out = b.op(op_type, b.t(x, ct), b.t(y, ct))
        return b.op("Not", out) if negate else out

    return emit


def _logical(op_type: str) -> Emitter:
    arity = 1 if op_type == "Not" else 2

    def emit(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
        return b.op(op_type, *(b.t(x, torch.bool) for x in _first(a, arity)))

    return emit


def _axpby(b: _Builder, dt: torch.dtype, x: Any, beta: Any, y: str, alpha: Any) -> str:
    """beta * x + alpha * y with PyTorch's rule that beta == 0 ignores x (even NaN)."""
    if alpha != 1:
        y = b.op("Mul", y, b.const(alpha, dt))
    if beta == 0:
        return y
    xv = b.t(x, dt)
    if beta != 1:
        xv = b.op("Mul", xv, b.const(beta, dt))
    return b.op("Add", xv, y)


def _addmm(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    bias, m1, m2 = _first(a, 3)
    prod = _widened(b, n, "MatMul", m1, m2)
    return _axpby(b, _dtype(n), bias, a["beta"], prod, a["alpha"])


def _linear(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    dt = _dtype(n)
    out = b.op("MatMul", b.t(a["input"], dt), b.op("Transpose", b.t(a["weight"], dt)))
    return out if a["bias"] is None else b.op("Add", out, b.t(a["bias"], dt))


def _transpose(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    x = a["self"]
    rank = len(_shape(x))
    perm = list(range(rank))
    if n.target == aten.permute.default:
        perm = [d % rank for d in a["dims"]]
    elif n.target == aten.transpose.int:
        d0, d1 = a["dim0"] % rank, a["dim1"] % rank
        perm[d0], perm[d1] = d1, d0
    else:  # aten.t
        perm.reverse()
    return b.t(x) if perm == list(range(rank)) else b.op("Transpose", b.t(x), perm=perm)


def _reshape(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    """All view-like reshapes (view/reshape/squeeze/unsqueeze) go to the static meta shape."""
    x, shape = a["self"], _shape(n)
    if shape == _shape(x):
        return b.t(x)
    return b.op("Reshape", b.t(x), b.ints(shape), **({"allowzero": 1} if 0 in shape else {}))


def _expand(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    x = a["self"]
    return b.t(x) if _shape(n) == _shape(x) else b.op("Expand", b.t(x), b.ints(_shape(n)))


def _alias(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    """Copies, dtype conversions and aliases: a Cast when the dtype changes, else nothing."""
    return b.t(_first(a, 1)[0], _dtype(n))


def _slice(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    x = a["self"]
    shape = _shape(x)
    dim = a["dim"] % len(shape)
    size = shape[dim]

    def clamp(i: int | None, default: int) -> int:
        i = default if i is None else i
        return min(max(i + size if i < 0 else i, 0), size)

    start, end, step = clamp(a["start"], 0), clamp(a["end"], size), a["step"]
    if (start, end, step) == (0, size, 1):
        return b.t(x)
    return b.op("Slice", b.t(x), b.ints([start]), b.ints([end]), b.ints([dim]), b.ints([step]))


def _select(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    x = a["self"]
    shape = _shape(x)
    dim = a["dim"] % len(shape)
    index = b.const(a["index"] % shape[dim], torch.int64)
    return b.op("Gather", b.t(x), index, axis=dim)


def _cat(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    dt = _dtype(n)
    axis = a["dim"] % len(_shape(n))
    return b.op("Concat", *(b.t(x, dt) for x in a["tensors"]), axis=axis)


def _split(b: _Builder, n: fx.Node, a: dict[str, Any]) -> list[str]:
    x = a["self"]
    dim = a["dim"] % len(_shape(x))
    sizes = [int(v.shape[dim]) for v in _val(n)]
    outs = b.op("Split", b.t(x), b.ints(sizes), n_out=len(sizes), axis=dim)
    return [outs] if isinstance(outs, str) else outs


def _reduce(op_type: str) -> Emitter:
    def emit(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
        x = a["self"]
        dt = _dtype(n)
        ct = _widen(dt)  # also honours mean/sum's dtype= by reducing in the result dtype
        rank = len(_shape(x))
        axes = _axes(a.get("dim"), rank)
        if axes == [rank - 1]:  # the spelling onnxscript's norm fusions match
            axes = [-1]
        keep = int(bool(a.get("keepdim")))
        xv, axes_v = b.t(x, ct), b.ints(axes)
        red = b.op(op_type, xv, axes_v, keepdims=keep, noop_with_empty_axes=0)
        if op_type in ("ReduceMax", "ReduceMin") and ct.is_floating_point:
            # onnxruntime's ReduceMax/ReduceMin skip NaN (an all-NaN group gives -inf/+inf);
            # aten's amax/amin return NaN for any group holding one. Reduce a NaN mask alongside.
            flags = _nan_flags(b, xv, ct)
            hits = b.op("ReduceMax", flags, axes_v, keepdims=keep, noop_with_empty_axes=0)
            red = _nan_where(b, hits, red, ct)
        return b.cast(red, ct, dt)

    return emit


def _reduce_bool(op_type: str) -> Emitter:
    """all/any: ONNX has no boolean reductions before opset 20, so min/max over int32 0/1."""

    def emit(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
        x = a["self"]
        axes = _axes(a.get("dim"), len(_shape(x)))
        as_int = b.op("Cast", b.t(x, torch.bool), to=TensorProto.INT32)
        red = b.op(op_type, as_int, b.ints(axes), keepdims=int(bool(a.get("keepdim"))))
        return b.op("Cast", red, to=_ONNX_DTYPE[_dtype(n)])  # bool, or uint8 for uint8 input

    return emit


def _softmax(op_type: str) -> Emitter:
    def emit(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
        return b.op(op_type, b.t(a["self"], _dtype(n)), axis=a["dim"])

    return emit


def _rsqrt(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    return b.op("Reciprocal", b.op("Sqrt", b.t(a["self"], _dtype(n))))


def _silu(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    x = b.t(a["self"], _dtype(n))
    return b.op("Mul", x, b.op("Sigmoid", x))


def _gelu(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    """Gelu is opset 20; spell out PyTorch's erf and tanh forms with opset-18 primitives.

    The tanh form, 0.5 * x * (1 + tanh(...)), already matches aten at +-inf and huge x. For
    the erf form, aten's default kernels (oneDNN for float32, float math for float16) return
    NaN for gelu(+inf) as well as gelu(-inf), and float32 computes x * (1 + erf) *before*
    halving, so it overflows to inf for x > FLT_MAX / 2. Match both: multiply in that order for
    float32, and subtract (x - x), which is NaN exactly at +-inf/NaN and +0 elsewhere
    (subtracting +0 keeps a -0 result). Costs two elementwise ops. (Eager itself is not
    consistent: a one-element or strided tensor takes a scalar path with gelu(+inf) = inf;
    the contiguous default is what a compiled model is compared against.)
    """
    dt = _dtype(n)
    x = b.t(a["self"], dt)
    if a["approximate"] == "tanh":
        cube = b.op("Mul", b.op("Mul", x, x), x)
        inner = b.op("Add", x, b.op("Mul", cube, b.const(0.044715, dt)))
        core = b.op("Tanh", b.op("Mul", inner, b.const(math.sqrt(2 / math.pi), dt)))
        half_x = b.op("Mul", x, b.const(0.5, dt))
        return b.op("Mul", half_x, b.op("Add", core, b.const(1.0, dt)))
    erf = b.op("Erf", b.op("Mul", x, b.const(1 / math.sqrt(2), dt)))
    erf_1 = b.op("Add", erf, b.const(1.0, dt))
    nan_at_inf = b.op("Sub", x, x)
    if dt == torch.float32:
        scaled = b.op("Sub", b.op("Mul", x, erf_1), nan_at_inf)
        return b.op("Mul", scaled, b.const(0.5, dt))
    # float16: aten computes in float32, so halve first to keep x * 2 from overflowing
    return b.op("Sub", b.op("Mul", b.op("Mul", x, b.const(0.5, dt)), erf_1), nan_at_inf)


def _hardswish(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    """aten's float32 kernel is x * clamp(x + 3, 0, 6) / 6, which overflows to inf for
    x > FLT_MAX / 6; ONNX HardSwish (x * clamp(x / 6 + 0.5, 0, 1)) returns x there. Spell out
    aten's formula for float32 (four elementwise ops instead of one). aten computes float16
    in float32, where it cannot overflow, so float16 keeps the fused HardSwish (which matches).
    """
    dt = _dtype(n)
    if dt != torch.float32:
        return _widened(b, n, "HardSwish", a["self"])
    x = b.t(a["self"], dt)
    gate = b.op("Clip", b.op("Add", x, b.const(3.0, dt)), b.const(0.0, dt), b.const(6.0, dt))
    return b.op("Div", b.op("Mul", x, gate), b.const(6.0, dt))


def _pow_scalar(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    """aten's float32 kernel computes x ** 0.5 as sqrt(x) and x ** -0.5 as rsqrt(x): NaN at
    -inf and -0 / -inf at -0, where ONNX Pow (C pow) gives inf and +0 / +inf. Emit the same
    (cheaper) ops; every other exponent already matches Pow. float16 pow is not special-cased
    by aten, so it stays Pow.
    """
    e = a["exponent"]
    if _dtype(n) == torch.float32 and isinstance(e, float) and e in (0.5, -0.5):
        root = b.op("Sqrt", b.t(a["self"], torch.float32))
        return root if e == 0.5 else b.op("Reciprocal", root)
    return _widened(b, n, "Pow", a["self"], e)


def _clip(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    dt = _dtype(n)
    lo = a.get("min", a.get("min_val"))
    hi = a.get("max", a.get("max_val"))
    x = b.t(a["self"], dt)
    if dt.is_floating_point:
        if any(isinstance(v, float) and math.isnan(v) for v in (lo, hi)):
            return b.op("Add", x, b.const(math.nan, dt))  # aten: a NaN bound gives all NaN
        # onnxruntime fills an omitted bound with the dtype's *finite* extreme, which clamps
        # +-inf to +-FLT_MAX; aten leaves infinities alone, so pass the open bound as +-inf
        lo = -math.inf if lo is None else lo
        hi = math.inf if hi is None else hi
    return b.op("Clip", x, b.t(lo, dt), b.t(hi, dt))


def _where(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    cond, x, y = _first(a, 3)
    dt = _dtype(n)
    ct = _widen(dt)
    return b.cast(b.op("Where", b.t(cond, torch.bool), b.t(x, ct), b.t(y, ct)), ct, dt)


def _masked_fill(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    dt = _dtype(n)
    ct = _widen(dt)
    fill, keep = b.t(a["value"], ct), b.t(a["self"], ct)
    return b.cast(b.op("Where", b.t(a["mask"], torch.bool), fill, keep), ct, dt)


def _layer_norm(b: _Builder, n: fx.Node, a: dict[str, Any]) -> list[str]:
    x, ns = a["input"], list(a["normalized_shape"])
    dt = _dtype(x)
    scale = b.t(a["weight"], dt) if a["weight"] is not None else b.const(np.ones(ns), dt)
    used = {i for i, u in _getitems(n).items() if u.users}
    n_out = 3 if 2 in used else 2 if 1 in used else 1
    outs = b.op(
        "LayerNormalization",
        b.t(x),
        scale,
        b.t(a["bias"], dt),
        n_out=n_out,
        axis=len(_shape(x)) - len(ns),
        epsilon=float(a["eps"]),
    )
    outs = [outs] if isinstance(outs, str) else outs
    stats = [b.cast(o, torch.float32, v.dtype) for o, v in zip(outs[1:], _val(n)[1:], strict=False)]
    return ([outs[0], *stats] + ["", ""])[:3]


def _batch_norm(b: _Builder, n: fx.Node, a: dict[str, Any]) -> list[str]:
    x = a["input"]
    dt, channels = _dtype(x), _shape(x)[1]
    w = b.t(a["weight"], dt) if a["weight"] is not None else b.const(np.ones(channels), dt)
    bias = b.t(a["bias"], dt) if a["bias"] is not None else b.const(np.zeros(channels), dt)
    mean, var = b.t(a["running_mean"], dt), b.t(a["running_var"], dt)
    return [b.op("BatchNormalization", b.t(x), w, bias, mean, var, epsilon=float(a["eps"])), "", ""]


def _conv(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    dt, k = _dtype(n), len(_shape(a["input"])) - 2
    pads = _pair(a["padding"], k)
    return b.op(
        "Conv",
        b.t(a["input"], dt),
        b.t(a["weight"], dt),
        b.t(a["bias"], dt),
        strides=_pair(a["stride"], k),
        pads=pads + pads,
        dilations=_pair(a["dilation"], k),
        group=int(a["groups"]),
    )


def _pool_attrs(n: fx.Node, a: dict[str, Any]) -> dict[str, Any]:
    kernel = _pair(a["kernel_size"], 2)
    strides = _pair(a["stride"], 2) if a["stride"] else kernel
    pads = _pair(a["padding"], 2)
    attrs = {"kernel_shape": kernel, "strides": strides, "pads": pads + pads}
    if "dilation" in a:
        attrs["dilations"] = _pair(a["dilation"], 2)
    if a["ceil_mode"]:
        out = _val(n)[0] if isinstance(_val(n), tuple | list) else _val(n)
        sizes = zip(
            _shape(a["self"])[2:],
            out.shape[2:],
            kernel,
            strides,
            pads,
            attrs.get("dilations", [1, 1]),
            strict=True,
        )
        attrs["ceil_mode"] = _onnx_ceil_mode(sizes)
    return attrs


def _onnx_ceil_mode(sizes: Any) -> int | None:
    """ONNX ceil_mode giving PyTorch's output size, or None if no single mode does.

    PyTorch drops a last ceil-mode window that would start inside the right padding; ONNX
    does not. Where PyTorch dropped it, its size equals the floor-mode size, so ceil_mode=0.
    """
    modes = {0, 1}
    for size, out, k, s, p, d in sizes:
        span = size + 2 * p - (k - 1) * d - 1
        modes &= {m for m, o in ((0, span // s + 1), (1, -(-span // s) + 1)) if o == out}
    return max(modes) if modes else None


def _max_pool(b: _Builder, n: fx.Node, a: dict[str, Any]) -> list[str]:
    """MaxPool, plus a cheap second pool over the same windows that finds NaN (and -inf).

    onnxruntime's MaxPool skips NaN where aten returns NaN for every window holding one, and
    some of its float32 paths start from -FLT_MAX, so a window of only -inf gives -FLT_MAX.

    float32: pool ``code = clip(x * 2**-64, -2**66, 2**64)`` with AveragePool. The code keeps
    NaN, maps every finite value and +inf into [-2**64, 2**64] (no overflow in the sum, and no
    subnormals unless |x| < 2**-62) and only -inf to -2**66, so a window's average is NaN
    exactly when it holds a NaN, and -2**66 exactly when it is all -inf; anything else lies at
    least 3 * 2**64 / area above that, far beyond float32 rounding for any real kernel size.
    float16 (whose MaxPool gets -inf right, and whose Clip kernel is slow): max-pool an
    IsNaN mask. Either way ~three extra passes over the input; finite inputs are unchanged.
    """
    attrs = _pool_attrs(n, a)
    x, dt = b.t(a["self"]), _dtype(a["self"])
    out = b.op("MaxPool", x, **attrs)
    if not dt.is_floating_point:
        return [out, ""]
    if dt != torch.float32:
        return [_nan_where(b, b.op("MaxPool", _nan_flags(b, x, dt), **attrs), out, dt), ""]
    scaled = b.op("Mul", x, b.const(2.0**-64, dt))
    code = b.op("Clip", scaled, b.const(-(2.0**66), dt), b.const(2.0**64, dt))
    windows = {k: v for k, v in attrs.items() if k != "dilations"}  # _check_pool: dilation 1
    avg = b.op("AveragePool", code, count_include_pad=0, **windows)
    area = math.prod(attrs["kernel_shape"])
    all_neg_inf = b.op("Less", avg, b.const(-(2.0**64) * (4 - 1.5 / area), dt))
    out = b.op("Where", all_neg_inf, b.const(-math.inf, dt), out)
    # ``out`` as Where's second branch: onnxruntime keeps the sign of a -0 there
    return [b.op("Where", b.op("IsNaN", avg), avg, out), ""]


def _avg_pool(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    attrs = _pool_attrs(n, a) | {"count_include_pad": int(bool(a["count_include_pad"]))}
    return b.op("AveragePool", b.t(a["self"]), **attrs)


def _adaptive_avg_pool(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    x = a["self"]
    (h, w), (oh, ow) = _shape(x)[-2:], _shape(n)[-2:]
    if (oh, ow) == (1, 1):
        return b.op("GlobalAveragePool", b.t(x))
    kernel = [h // oh, w // ow]
    return b.op("AveragePool", b.t(x), kernel_shape=kernel, strides=kernel)


def _full_like(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    fill = {aten.zeros_like.default: 0, aten.ones_like.default: 1}.get(n.target)
    value = b.const(a["fill_value"] if fill is None else fill, _dtype(n))
    return b.op("Expand", value, b.ints(_shape(n)))


def _scalar_tensor(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    return b.const(a["s"], _dtype(n))


# ---- the table -----------------------------------------------------------------------------
# aten overload -> emitter(builder, node, bound_args) returning the ONNX name of the result (a
# list of names, "" for unproduced elements, for tuple-returning ops). The capability table
# treats membership here as "this op can run on the BPU", refined by can_lower().
LOWERINGS: dict[object, Emitter] = {
    # matrix products
    aten.mm.default: _binary("MatMul"),
    aten.bmm.default: _binary("MatMul"),
    aten.matmul.default: _binary("MatMul"),
    aten.addmm.default: _addmm,
    aten.baddbmm.default: _addmm,
    aten.linear.default: _linear,
    # layout and views
    aten.t.default: _transpose,
    aten.transpose.int: _transpose,
    aten.permute.default: _transpose,
    aten.view.default: _reshape,
    aten._unsafe_view.default: _reshape,
    aten.reshape.default: _reshape,
    aten.unsqueeze.default: _reshape,
    aten.squeeze.dim: _reshape,
    aten.squeeze.dims: _reshape,
    aten.squeeze.default: _reshape,
    aten.expand.default: _expand,
    aten.clone.default: _alias,
    aten.contiguous.default: _alias,
    aten.alias.default: _alias,
    aten._to_copy.default: _alias,
    torch.ops.prims.convert_element_type.default: _alias,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.cat.default: _cat,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    # arithmetic
    aten.add.Tensor: _arith("Add"),
    aten.add.Scalar: _arith("Add"),
    aten.sub.Tensor: _arith("Sub"),
    aten.sub.Scalar: _arith("Sub"),
    aten.mul.Tensor: _arith("Mul"),
    aten.mul.Scalar: _arith("Mul"),
    aten.div.Tensor: _arith("Div"),
    aten.div.Scalar: _arith("Div"),
    aten.div.Tensor_mode: _arith("Div"),  # can_lower admits rounding_mode=None only
    aten.div.Scalar_mode: _arith("Div"),
    aten.pow.Tensor_Scalar: _pow_scalar,
    aten.pow.Tensor_Tensor: _binary("Pow"),
    aten.pow.Scalar: _binary("Pow"),
    aten.minimum.default: _binary("Min"),
    aten.maximum.default: _binary("Max"),
    # elementwise
    aten.rsqrt.default: _rsqrt,
    aten.sqrt.default: _unary("Sqrt"),
    aten.neg.default: _unary("Neg"),
    aten.abs.default: _unary("Abs"),
    aten.exp.default: _unary("Exp"),
    aten.log.default: _unary("Log"),
    aten.reciprocal.default: _unary("Reciprocal"),
    aten.erf.default: _unary("Erf"),
    aten.cos.default: _unary("Cos"),
    aten.sin.default: _unary("Sin"),
    aten.sigmoid.default: _unary("Sigmoid"),
    aten.tanh.default: _unary("Tanh"),
    aten.relu.default: _unary("Relu"),
    aten.silu.default: _silu,
    aten.gelu.default: _gelu,
    aten.hardswish.default: _hardswish,
    aten.hardsigmoid.default: _unary("HardSigmoid", alpha=1 / 6, beta=0.5),
    aten.hardtanh.default: _clip,
    aten.clamp.default: _clip,
    aten.clamp_min.default: _clip,
    aten.clamp_max.default: _clip,
    # reductions
    aten.mean.dim: _reduce("ReduceMean"),
    aten.mean.default: _reduce("ReduceMean"),
    aten.sum.dim_IntList: _reduce("ReduceSum"),
    aten.sum.default: _reduce("ReduceSum"),
    aten.amax.default: _reduce("ReduceMax"),
    aten.amin.default: _reduce("ReduceMin"),
    aten.all.dim: _reduce_bool("ReduceMin"),
    aten.all.dims: _reduce_bool("ReduceMin"),
    aten.all.default: _reduce_bool("ReduceMin"),
    aten.any.dim: _reduce_bool("ReduceMax"),
    aten.any.dims: _reduce_bool("ReduceMax"),
    aten.any.default: _reduce_bool("ReduceMax"),
    aten._softmax.default: _softmax("Softmax"),
    aten._log_softmax.default: _softmax("LogSoftmax"),
    # selection, comparison, logic
    aten.where.self: _where,
    aten.where.ScalarSelf: _where,
    aten.where.ScalarOther: _where,
    aten.where.Scalar: _where,
    aten.masked_fill.Scalar: _masked_fill,
    aten.masked_fill.Tensor: _masked_fill,
    aten.eq.Tensor: _compare("Equal"),
    aten.eq.Scalar: _compare("Equal"),
    aten.ne.Tensor: _compare("Equal", negate=True),
    aten.ne.Scalar: _compare("Equal", negate=True),
    aten.lt.Tensor: _compare("Less"),
    aten.lt.Scalar: _compare("Less"),
    aten.le.Tensor: _compare("LessOrEqual"),
    aten.le.Scalar: _compare("LessOrEqual"),
    aten.gt.Tensor: _compare("Greater"),
    aten.gt.Scalar: _compare("Greater"),
    aten.ge.Tensor: _compare("GreaterOrEqual"),
    aten.ge.Scalar: _compare("GreaterOrEqual"),
    aten.logical_not.default: _logical("Not"),
    aten.bitwise_not.default: _logical("Not"),  # the bitwise_* ops: can_lower admits bool only
    aten.bitwise_and.Tensor: _logical("And"),
    aten.bitwise_or.Tensor: _logical("Or"),
    aten.bitwise_xor.Tensor: _logical("Xor"),
    aten.logical_and.default: _logical("And"),
    aten.logical_or.default: _logical("Or"),
    aten.logical_xor.default: _logical("Xor"),
    # normalisation, convolution, pooling
    aten.native_layer_norm.default: _layer_norm,
    aten._native_batch_norm_legit_no_training.default: _batch_norm,
    aten.native_batch_norm.default: _batch_norm,
    aten.convolution.default: _conv,
    aten.max_pool2d_with_indices.default: _max_pool,
    aten.avg_pool2d.default: _avg_pool,
    aten._adaptive_avg_pool2d.default: _adaptive_avg_pool,
    # factories
    aten.zeros_like.default: _full_like,
    aten.ones_like.default: _full_like,
    aten.full_like.default: _full_like,
    aten.scalar_tensor.default: _scalar_tensor,
}


# ---- capability checks ---------------------------------------------------------------------
# Tuple outputs that have an ONNX counterpart; the others (max-pool indices, batch-norm save
# stats) may exist in the graph but must be unused.
_TUPLE_OUTPUTS: dict[object, frozenset[int]] = {
    aten.max_pool2d_with_indices.default: frozenset({0}),
    aten._native_batch_norm_legit_no_training.default: frozenset({0}),
    aten.native_batch_norm.default: frozenset({0}),
}


def _tensor_reason(v: Any) -> str | None:
    if not isinstance(v, torch.Tensor):
        return f"value is a {type(v).__name__}, not a tensor"
    if v.dtype == torch.bfloat16:
        return "bfloat16 tensor: the BPU has no BF16; run the bf16_promotion rule first"
    if v.dtype == torch.int64:
        return "int64 tensor: the BPU has no int64 data path; cast to int32 outside the region"
    if v.dtype == torch.float64:
        return "float64 tensor: the BPU has no float64; cast to float32 outside the region"
    if v.dtype not in _DATA_DTYPES:
        return f"dtype {v.dtype} is not supported (float32/float16/int32/int16/int8/uint8/bool are)"
    if not all(isinstance(d, int) for d in v.shape):
        return f"dynamic shape {tuple(v.shape)}: regions need static shapes"
    return None


def _value_reason(node: fx.Node, allowed: frozenset[int] | None = None) -> str | None:
    val = _val(node)
    if val is None:
        return "no meta['val']; run FakeTensorProp on the graph first"
    if not isinstance(val, tuple | list):
        return _tensor_reason(val)
    for i, v in enumerate(val):
        reason = None if allowed is not None and i not in allowed else _tensor_reason(v)
        if reason:
            return f"output {i}: {reason}"
    return None


def _check_rounding(n: fx.Node) -> str | None:
    mode = bind_args(n)["rounding_mode"]
    return None if mode is None else f"rounding_mode={mode!r} has no lowering (true division only)"


def _check_bool_arith(n: fx.Node) -> str | None:
    return "arithmetic on bool tensors has no ONNX kernel" if _dtype(n) == torch.bool else None


def _check_conv(n: fx.Node) -> str | None:
    return "transposed convolution is not supported" if bind_args(n)["transposed"] else None


def _check_batch_norm(n: fx.Node) -> str | None:
    a = bind_args(n)
    if a.get("training"):
        return "batch norm in training mode; call model.eval() before compiling"
    if a["running_mean"] is None or a["running_var"] is None:
        return "batch norm without running statistics"
    return None


def _check_pool(n: fx.Node) -> str | None:
    a = bind_args(n)
    if len(_shape(a["self"])) != 4:
        return "unbatched (3-d) pooling input; only NCHW is lowered"
    if a.get("divisor_override") is not None:
        return "avg_pool2d divisor_override has no ONNX equivalent"
    if a.get("ceil_mode") and _pool_attrs(n, a)["ceil_mode"] is None:
        return "ceil_mode windows differ between PyTorch and ONNX per spatial dim"
    dilated = _pair(a.get("dilation", 1), 2) != [1, 1]
    f32 = _dtype(a["self"]) == torch.float32
    if n.target == aten.max_pool2d_with_indices.default and dilated and f32:
        # _max_pool's float32 NaN / -inf check pools with AveragePool, which has no dilations
        # before opset 19, and onnxruntime's MaxPool alone drops NaN: keep these on the host
        return (
            "dilated float32 max_pool2d: onnxruntime's MaxPool skips NaN and the NaN check "
            "needs AveragePool dilations (opset 19)"
        )
    if n.target == aten._adaptive_avg_pool2d.default:
        (h, w), (oh, ow) = _shape(a["self"])[-2:], _shape(n)[-2:]
        if h % oh or w % ow:
            return f"adaptive pool {h}x{w} -> {oh}x{ow} needs output sizes dividing the input"
    return None


def _check_to_copy(n: fx.Node) -> str | None:
    a = bind_args(n)
    if a["layout"] not in (None, torch.strided):
        return f"layout {a['layout']} is not supported"
    if a["device"] is not None and torch.device(a["device"]).type != "cpu":
        return f"device transfer to {a['device']} cannot be lowered"
    return None


def _check_bitwise(n: fx.Node) -> str | None:
    return None if _dtype(n) == torch.bool else "bitwise ops are lowered for bool tensors only"


_CHECKS: dict[object, Callable[[fx.Node], str | None]] = {
    aten.div.Tensor_mode: _check_rounding,
    aten.div.Scalar_mode: _check_rounding,
    **dict.fromkeys(
        [
            aten.add.Tensor,
            aten.add.Scalar,
            aten.sub.Tensor,
            aten.sub.Scalar,
            aten.mul.Tensor,
            aten.mul.Scalar,
        ],
        _check_bool_arith,
    ),
    aten.convolution.default: _check_conv,
    aten.native_batch_norm.default: _check_batch_norm,
    aten._native_batch_norm_legit_no_training.default: _check_batch_norm,
    aten.max_pool2d_with_indices.default: _check_pool,
    aten.avg_pool2d.default: _check_pool,
    aten._adaptive_avg_pool2d.default: _check_pool,
    aten._to_copy.default: _check_to_copy,
    **dict.fromkeys(
        [
            aten.bitwise_not.default,
            aten.bitwise_and.Tensor,
            aten.bitwise_or.Tensor,
            aten.bitwise_xor.Tensor,
        ],
        _check_bitwise,
    ),
}


def can_lower(node: fx.Node) -> str | None:
    """Why ``node`` cannot be lowered (None if it can). Cheap: inspects meta only.

    The partitioner calls this per node so that unsupported ops, dtypes the BPU lacks and
    argument combinations without an ONNX equivalent stay on the host instead of failing later.
    """
    if node.op == "output":
        return None
    if node.op in ("placeholder", "get_attr"):
        return _value_reason(node)
    if node.op != "call_function":
        return f"{node.op} nodes are not lowered; only aten call_function nodes are"
    if node.target is operator.getitem:
        src, idx = node.args
        if not isinstance(src, fx.Node) or src.target not in LOWERINGS:
            return "getitem of a value that has no ONNX lowering"
        allowed = _TUPLE_OUTPUTS.get(src.target)
        if allowed is not None and idx not in allowed:
            if not node.users:
                return None
            return f"output {idx} of {_target_name(src.target)} is used but has no ONNX lowering"
        return _value_reason(node)
    if node.target not in LOWERINGS:
        return f"no ONNX lowering for {_target_name(node.target)}"
    for inp in node.all_input_nodes:
        reason = _value_reason(inp)
        if reason:
            return f"input '{inp.name}': {reason}"
    reason = _value_reason(node, _TUPLE_OUTPUTS.get(node.target))
    check = _CHECKS.get(node.target)
    return reason or (check(node) if check else None)


# ---- driver --------------------------------------------------------------------------------
def _fail(node: fx.Node, reason: str) -> LoweringError:
    return LoweringError(
        f"cannot lower node '{node.name}' ({_target_name(node.target)}): {reason}. Keep it out of "
        "the BPU region (can_lower() reports this) or add an emitter to LOWERINGS in "
        "backends/bpu/lower.py."
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


def _add_weight(b: _Builder, n: fx.Node) -> str:
    name = str(n.target)
    if name not in b.inits:
        value = _fetch_attr(n)
        if not isinstance(value, torch.Tensor):
            raise _fail(n, f"attribute is a {type(value).__name__}, not a tensor")
        array = value.detach().cpu().contiguous().numpy()
        b.inits[name] = numpy_helper.from_array(array, name)
    return name


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
                    "after shape inference; fix its emitter in backends/bpu/lower.py"
                )


def lower(gm: fx.GraphModule, name: str = "region", opset: int = 18) -> onnx.ModelProto:
    """Lower a region GraphModule to a checked ONNX model that matches eager PyTorch.

    Graph inputs are the placeholders (same names and order), outputs are ``out0..outN-1``,
    get_attr constants become initializers named after their attribute, and every
    intermediate carries its static dtype/shape. Nodes not needed by the outputs are ignored.
    """
    if opset < 18:
        raise LoweringError(f"opset {opset} is too old: emitters use opset-18 forms; use >= 18")
    b = _Builder()
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    res = out_node.args[0]
    results = list(res) if isinstance(res, tuple | list) else [res]
    live = _live_nodes(results)
    inputs = []
    for n in gm.graph.nodes:
        if n.op != "placeholder" and (n not in live or n.op == "output"):
            continue
        reason = can_lower(n)
        if reason:
            raise _fail(n, reason)
        if n.op == "placeholder":
            inputs.append(_tensor_info(n.name, _val(n)))
            b.names[n] = n.name
        elif n.op == "get_attr":
            b.names[n] = _add_weight(b, n)
        elif n.target is operator.getitem:
            src, idx = n.args
            b.names[n] = b.tuples[src][idx]
            if not b.names[n]:
                raise _fail(n, f"element {idx} was not produced by the emitter of '{src.name}'")
        else:
            b.emit(n)

    outputs = []
    for k, r in enumerate(results):
        if not isinstance(r, fx.Node) or not isinstance(_val(r), torch.Tensor):
            raise LoweringError(f"region '{name}' output {k} is {r!r}, not a tensor node")
        b.nodes.append(helper.make_node("Identity", [b.names[r]], [f"out{k}"], name=f"out{k}"))
        outputs.append(_tensor_info(f"out{k}", _val(r)))

    graph = helper.make_graph(
        b.nodes,
        name,
        inputs,
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
            "emitter in backends/bpu/lower.py — the failing node name is the FX node name"
        ) from e
    return model
