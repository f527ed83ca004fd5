"""The ONNX builder every emitter writes into, and the small helpers they share.

One ``_Builder`` accumulates the nodes, initializers and value names of one region. ONNX has
no implicit type promotion, so the helpers here (``_result_type``, ``_widen``, ``_Builder.t``)
are how an emitter casts its operands to the dtype PyTorch computes in; ``meta["val"]`` is
the ground truth for every result.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import fx

from fxpass.graph import bind_args

aten = torch.ops.aten


class Limits(Protocol):
    """What a device hands the lowering about itself (the BPU's ``March``): its name, the op
    families it runs, the dtypes it takes, and its rank and reduction limits. The lowering
    reads these and imports no device."""

    name: str
    families: frozenset[str]
    dtypes: frozenset[torch.dtype]
    max_rank: int
    max_reduce: int


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


Emitter = Callable[["_Builder", fx.Node, dict[str, Any]], "str | list[str]"]


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
        with np.errstate(over="ignore"):  # 1e5 as float16 is inf, as it is in aten's cast
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
    def emit(self, n: fx.Node, emitter: Emitter) -> None:
        """Run ``emitter`` for ``n`` and name its result(s) after the FX node."""
        self.cur, self._temps, self._op_counts = n.name, 0, {}
        start, inits_before = len(self.nodes), set(self.inits)
        out = emitter(self, n, bind_args(n))
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
