"""Run the graph's CPU ops through torch's direct bindings, not the boxed operator call.

Why: the nodes that stay on the CPU (embedding, position arithmetic, the KV-cache writes: 35
per Qwen3 decode step) are emitted as ``torch.ops.aten.<op>.<overload>(...)``. That call goes
through the boxed path (``OpOverload.__call__`` -> schema-driven argument conversion ->
``Dispatcher::callBoxed``), about twice the cost of ``torch.index_copy``-style bindings, which
parse arguments in C++ and call the kernel unboxed. At one token per step every microsecond of
host work counts (``docs/generation.md``).

A node is switched only when its binding is *proved* to reach the node's own overload: the
binding runs once on fresh fake tensors of the node's input shapes under a dispatch mode that
records the aten calls, and it must record exactly that overload, once, on the tensors passed
in their argument order (``prim`` metadata
queries such as ``prim.device``, which ``Tensor.copy_`` makes under a mode, aside).
Anything else (no binding, a composite that decomposes, another overload chosen, no fake
values) keeps the boxed call. Numerics are the kernel's either way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["ATEN", "binding", "fast_calls"]

#: node meta key: the aten overload a switched node stands for (plans store it)
ATEN = "fxpass_aten"


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.namespace != "prim":  # metadata queries (prim.device) the mode itself causes
            self.calls.append((func, _tensor_ids(args, kwargs)))
        return func(*args, **(kwargs or {}))


def _tensor_ids(args: Any, kwargs: Any) -> list[int]:
    """The tensors of a call, in argument order (keyword arguments sorted by name)."""
    flat = tree_flatten((args, sorted((kwargs or {}).items())))[0]
    return [id(v) for v in flat if isinstance(v, torch.Tensor)]


def binding(op: torch._ops.OpOverload) -> Any:
    """The C++ binding of ``op``'s packet: the function, or for an in-place op the method."""
    name = op._schema.name.split("::", 1)[1]
    fn = getattr(torch._C._VariableFunctions, name, None)
    if fn is None and name.endswith("_"):
        fn = getattr(torch._C.TensorBase, name, None)
    return fn


def _fresh(v: Any) -> Any:
    """A new fake tensor like ``v`` (the graph's own fake values are never mutated)."""
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    return v


def _proved(node: Node, fn: Any) -> bool:
    def val(a: Any) -> Any:
        if isinstance(a, Node):
            v = a.meta.get("val")
            if v is None:
                raise LookupError(a.name)
            return v
        return a

    try:
        args, kwargs = tree_map(val, (node.args, node.kwargs))
        vals = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
        mode = detect_fake_mode(vals)
        if mode is None or any(not v.is_cpu for v in vals):
            return False
        with mode:
            args, kwargs = tree_map(_fresh, (args, kwargs))
            with _Record() as rec:
                fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - any failure means "not proved": keep the boxed call
        return False
    # the node's overload, once, on the very tensors passed, in the same argument order
    return rec.calls == [(node.target, _tensor_ids(args, kwargs))]


def fast_calls(gm: GraphModule, recompile: bool = True) -> int:
    """Point every provably equivalent aten node of ``gm`` at its direct binding (and
    recompile ``gm`` if any changed and ``recompile``). Returns how many nodes changed."""
    changed = 0
    for node in list(gm.graph.nodes):
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        if op.namespace != "aten":
            continue
        fn = binding(op)
        if fn is None:
            continue
        if _proved(node, fn):
            node.meta[ATEN], node.target = op, fn
            changed += 1
    if changed and recompile:
        gm.recompile()
    return changed
