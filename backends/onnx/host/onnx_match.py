"""Small matchers over onnx_ir graphs, shared by the host fusions (attention, rotary,
output views): a producer of given op types, a static shape, a constant's value, a new
initializer."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

__all__ = ["add_initializer", "const_array", "producer_of", "static_shape"]


def static_shape(v: ir.Value | None) -> tuple[int, ...] | None:
    """``v``'s shape if every dimension is a known int, else None."""
    if v is None or v.shape is None or not all(isinstance(d, int) for d in v.shape):
        return None
    return tuple(v.shape)


def const_array(v: ir.Value | None) -> np.ndarray | None:
    """``v``'s value if it is an initializer or a ``Constant`` node's output, else None."""
    if v is None:
        return None
    t = v.const_value
    if t is None and v.producer() is not None and v.producer().op_type == "Constant":
        attr = v.producer().attributes.get("value")
        t = attr.value if attr is not None else None
    return None if t is None else t.numpy()


def producer_of(v: ir.Value | None, *types: str) -> ir.Node | None:
    """The producer of ``v`` if it is a default-domain node of one of ``types``."""
    p = v.producer() if v is not None else None
    return p if p is not None and p.domain == "" and p.op_type in types else None


def add_initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """A new initializer ``name`` holding ``array``, registered in ``graph``."""
    v = ir.Value(name=name)
    v.const_value = ir.tensor(array)
    graph.register_initializer(v)
    return v
