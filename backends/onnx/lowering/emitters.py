"""Emitters for elementwise, layout, reduction and selection ops: aten node -> ONNX nodes.

An emitter is ``(builder, node, bound_args) -> ONNX name`` (a list of names for tuple
results). Each one casts its operands to the dtype PyTorch computes in and reproduces aten's
behaviour on NaN, +-inf and huge values where an onnxruntime kernel differs (listed below).
Which op uses which emitter is decided in :mod:`.table`, the one table.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from onnx import TensorProto
from torch import fx

from fxpass.backends.onnx.lowering.builder import (
    _ONNX_DTYPE,
    Emitter,
    _axes,
    _Builder,
    _dtype,
    _first,
    _result_type,
    _shape,
    _val,
    _widen,
)

aten = torch.ops.aten


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
def _opmath(dt: torch.dtype, *operands: Any) -> torch.dtype:
    """The dtype to compute a ``mul``/``div`` in: ``dt``, or float32 where ``dt`` is
    float16/bfloat16 and a Python scalar operand does not fit it exactly.

    Why: aten's CPU mul and div of a reduced-precision tensor by a scalar compute in float32
    (the scalar as float32, its opmath type) and round once. A scalar written as a ``dt``
    constant is rounded first: ``x * 1e5`` in float16 became ``x * inf`` (inf where eager is
    finite, NaN at 0), and ``x * 0.1`` used 0.09998. Only mul and div: checked against eager,
    add/sub (scalar or alpha), pow, fmod and remainder round the scalar to ``dt`` first, as
    the constant does (``x - 1e5`` is NaN at inf in eager too)."""
    if dt not in (torch.float16, torch.bfloat16):
        return dt
    for s in operands:
        if isinstance(s, bool | int | float) and not math.isnan(s):
            f32 = torch.tensor(s, dtype=torch.float32)
            if not torch.equal(f32.to(dt).float(), f32):
                return torch.float32
    return dt


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
        ct = _opmath(dt, x, y) if op_type in ("Mul", "Div") else dt
        yv = b.t(y, ct)
        if alpha != 1:
            yv = b.op("Mul", yv, b.const(alpha, ct))
        return b.cast(b.op(op_type, b.t(x, ct), yv), ct, dt)

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
    if rank < 2:  # transpose(0-dim, 0, -1) and t(1-D) are the identity (and % 0 would raise)
        return b.t(x)
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


def _embedding(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    """A table lookup (``aten.embedding``) as ``Gather`` over the table's rows.

    Eager raises on a negative index; ONNX's Gather wraps it around. A negative index is moved
    past the table's end, so onnxruntime raises as well and the region falls back to eager,
    which raises eager's own error: a bad id is never looked up from the table's other end."""
    rows = _shape(a["weight"])[0]
    ids = b.t(a["indices"])
    dt = _dtype(a["indices"])
    ids = b.op("Where", b.op("Less", ids, b.const(0, dt)), b.const(rows, dt), ids)
    return b.op("Gather", b.t(a["weight"]), ids, axis=0)


def _cat(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    dt, rank = _dtype(n), len(_shape(n))
    axis = a["dim"] % rank
    # torch.cat still accepts legacy empty 1-D tensors of shape (0,) beside tensors of any
    # rank and skips them; ONNX's Concat needs equal ranks, so they are dropped here too
    parts = [x for x in a["tensors"] if rank == 1 or _shape(x) != [0]]
    return b.op("Concat", *(b.t(x, dt) for x in parts), axis=axis)


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
    the contiguous default is what a compiled model is compared against.) Which of the two
    aten's kernel does at +inf depends on the host's vector ISA for float16 (NaN on AVX2,
    inf on AVX512), so it is asked (:func:`_gelu_nan_at_inf`); the region key names the host.
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
    if dt == torch.float32:
        product = b.op("Mul", x, erf_1)
    else:  # float16: aten computes in float32, so halve first to keep x * 2 from overflowing
        product = b.op("Mul", b.op("Mul", x, b.const(0.5, dt)), erf_1)
    if _gelu_nan_at_inf(dt):  # (the formula alone gives NaN at -inf and inf at +inf)
        product = b.op("Sub", product, b.op("Sub", x, x))
    return b.op("Mul", product, b.const(0.5, dt)) if dt == torch.float32 else product


@functools.cache
def _gelu_nan_at_inf(dtype: torch.dtype) -> bool:
    """Whether this host's aten gelu (erf form) gives NaN at +inf for a contiguous tensor of
    ``dtype``. (Found when the suite moved to an AVX512 host: float16 gave inf there.)"""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        x = torch.full((64,), math.inf, dtype=dtype)
        return bool(torch.nn.functional.gelu(x).isnan().all())


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
