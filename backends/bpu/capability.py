"""Which nodes the BPU can take, per march, and why not when it cannot.

Source: ``../shared/bpu/FACTS.md`` (the original pull request's whitelist, verified on an RDK
S600 with ``convert(advice=True)``, plus our reading of the public OpenExplorer constraint
tables). It is *data*: one table per march, so a correction never touches the partitioner.
A node is accepted only if its op family is in the march's table, every tensor it reads or
writes has an allowed dtype and a static shape, ranks and reduce sizes are within limits, and
the ONNX lowering can express it (the executor runs exactly what we lower).

Float tensors: the tensor engine computes in int8/int16; hbdk4's ``convert`` inserts Q/DQ for
float models (the pull request's qdq step), so float32/float16 are accepted here and
quantization accuracy is the compile step's concern.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from fxpass.backends.bpu.lower import _CHECKS, _TUPLE_OUTPUTS, LOWERINGS, can_lower
from fxpass.graph import is_static

aten, prims = torch.ops.aten, torch.ops.prims
F32, F16, BOOL = torch.float32, torch.float16, torch.bool
INT = {torch.int8, torch.int16, torch.int32, torch.uint8}

# op family -> aten overloads (what the built-in rules normalize to)
FAMILIES: dict[str, tuple[Any, ...]] = {
    "tensor_engine": (
        aten.convolution.default,
        aten.linear.default,
        aten.addmm.default,
        aten.mm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.matmul.default,
    ),
    "norm": (aten.native_layer_norm.default, aten._native_batch_norm_legit_no_training.default),
    "activation": (
        aten.relu.default,
        aten.hardtanh.default,
        aten.hardswish.default,
        aten.sigmoid.default,
        aten.tanh.default,
        aten.silu.default,
        aten.gelu.default,
    ),
    "pool": (
        aten.max_pool2d_with_indices.default,
        aten.avg_pool2d.default,
        aten._adaptive_avg_pool2d.default,
        aten.mean.dim,
    ),
    "arith": (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor),
    "rmsnorm": (aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.sqrt.default, aten.neg.default),
    "data_movement": (
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten.cat.default,
        aten.clone.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.unsqueeze.default,
        aten.slice.Tensor,
        aten.expand.default,
        aten.select.int,
        aten.split.Tensor,
        aten.split_with_sizes.default,
        operator.getitem,
    ),
    "masking": (
        aten._softmax.default,
        aten.eq.Scalar,
        aten.all.dim,
        aten.zeros_like.default,
        aten.where.self,
        prims.convert_element_type.default,
        aten._to_copy.default,
        aten.masked_fill.Scalar,
        aten.any.dim,
    ),
}


@dataclass(frozen=True)
class March:
    name: str
    families: frozenset[str]
    dtypes: frozenset[torch.dtype]
    max_rank: int = 10
    max_reduce: int = 65535
    max_io: int = 256
    cores: int = 1
    ops: frozenset[Any] = field(default=frozenset())

    def __post_init__(self) -> None:
        ops = frozenset(t for f in self.families for t in FAMILIES[f])
        object.__setattr__(self, "ops", ops)


_ALL = frozenset(FAMILIES)
MARCHES: dict[str, March] = {
    "nash-e": March("nash-e", _ALL, frozenset({F32, F16, BOOL, *INT})),
    "nash-m": March("nash-m", _ALL, frozenset({F32, F16, BOOL, *INT})),
    "nash-p": March("nash-p", _ALL, frozenset({F32, F16, BOOL, *INT}), cores=4),
    "nash-h": March("nash-h", _ALL, frozenset({F32, F16, BOOL, *INT}), cores=3),
}
DEFAULT_MARCH = "nash-p"
_REDUCE = {
    aten.mean.dim,
    aten.all.dim,
    aten.any.dim,
    aten._softmax.default,
    aten.native_layer_norm.default,
}


def march(name: str) -> March:
    if name not in MARCHES:
        raise ValueError(f"unknown march {name!r}; known: {sorted(MARCHES)} (default nash-p)")
    return MARCHES[name]


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in _tensors(x)]
    return [v] if isinstance(v, torch.Tensor) else []


def reject_reason(node: Node, m: March) -> str | None:
    """None if the BPU can take ``node``; otherwise a short human reason."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and isinstance(node.args[0], Node):
        why = reject_reason(node.args[0], m)  # an element goes where its tuple goes
        if why is not None:
            return f"element of a rejected tuple ({why})"
    if node.target not in m.ops:
        return f"{node.target} is not in the {m.name} operator table"
    vals = _tensors(node.meta.get("val"))
    for i in node.all_input_nodes:
        vals += _tensors(i.meta.get("val"))
    for v in vals:
        if not is_static(v):
            return "symbolic shape (the BPU needs every dimension at compile time)"
        if v.dtype == torch.bfloat16:
            return "bfloat16 (no BF16 on the BPU; enable bf16_promotion)"
        if v.dtype not in m.dtypes:
            return f"dtype {v.dtype} not supported on {m.name}"
        if v.dim() > m.max_rank:
            return f"rank {v.dim()} > {m.max_rank}"
    if node.target in _REDUCE and node.all_input_nodes:
        x = node.all_input_nodes[0].meta["val"]
        if any(s > m.max_reduce for s in x.shape[-1:]):
            return f"reduce axis size {x.shape[-1]} > {m.max_reduce}"
    if node.target is not operator.getitem and node.target not in LOWERINGS:
        return f"no ONNX lowering for {node.target}"
    return can_lower(node)


class Capability:
    """``reject_reason`` for one graph, with each value's verdict computed once.

    A value feeds several nodes; checking its dtype, rank and static shape once per value
    instead of once per use, and consulting the lowering's argument checks only for ops that
    have them, is what keeps partitioning linear and cheap on 100k-node graphs.
    """

    def __init__(self, m: March):
        self.m = m
        self._value: dict[Node, str | None] = {}
        self._node: dict[Node, str | None] = {}

    def value_reason(self, n: Node) -> str | None:
        if n in self._value:
            return self._value[n]
        why = None
        for v in _tensors(n.meta.get("val")):
            if not is_static(v):
                why = "symbolic shape (the BPU needs every dimension at compile time)"
            elif v.dtype == torch.bfloat16:
                why = "bfloat16 (no BF16 on the BPU; enable bf16_promotion)"
            elif v.dtype not in self.m.dtypes:
                why = f"dtype {v.dtype} not supported on {self.m.name}"
            elif v.dim() > self.m.max_rank:
                why = f"rank {v.dim()} > {self.m.max_rank}"
            if why:
                break
        self._value[n] = why
        return why

    def __call__(self, node: Node) -> str | None:
        if node in self._node:
            return self._node[node]
        why = self._reason(node)
        self._node[node] = why
        return why

    def _reason(self, node: Node) -> str | None:
        m, t = self.m, node.target
        if node.op != "call_function":
            return None
        if t is operator.getitem and isinstance(node.args[0], Node):
            why = self(node.args[0])
            if why is not None:
                return f"element of a rejected tuple ({why})"
            return can_lower(node)
        if t not in m.ops:
            return f"{t} is not in the {m.name} operator table"
        if t not in LOWERINGS:
            return f"no ONNX lowering for {t}"
        for i in node.all_input_nodes:
            why = self.value_reason(i)
            if why:
                return why
        if t not in _TUPLE_OUTPUTS:
            why = self.value_reason(node)
            if why:
                return why
        if t in _REDUCE and node.all_input_nodes:
            x = node.all_input_nodes[0].meta["val"]
            if any(s > m.max_reduce for s in x.shape[-1:]):
                return f"reduce axis size {x.shape[-1]} > {m.max_reduce}"
        if t in _TUPLE_OUTPUTS:
            return can_lower(node)
        check = _CHECKS.get(t)  # argument checks of the lowering (rounding mode, ...)
        return check(node) if check is not None else None
