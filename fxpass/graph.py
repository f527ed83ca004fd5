"""Small graph utilities shared by the rewriter, the rules and the backends."""

from __future__ import annotations

import operator
from functools import cache
from typing import Any

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten

#: meta key under which a placeholder carries the real tensor it is frozen to (weights, buffers).
FROZEN = "fxpass_frozen"
#: placeholder meta: the frozen tensor is a module buffer (state a model may write), not a
#: parameter
FROZEN_BUFFER = "fxpass_frozen_buffer"
#: placeholder meta: the frozen tensor's version counter when it was frozen, read from the
#: tensor itself (None: an inference tensor, which has none). The ``detach()`` kept under
#: :data:`FROZEN` shares that counter only where autograd's keys run: made inside an op's
#: kernel (a compiled model called from a custom op) it gets a counter of its own, at 0
FROZEN_VERSION = "fxpass_frozen_version"


def fake_mode_of(gm: GraphModule) -> Any:
    """The FakeTensorMode the graph's ``meta["val"]`` tensors live in, or a fresh one."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    modes = {
        id(m): m
        for n in gm.graph.nodes
        if (m := getattr(n.meta.get("val"), "fake_mode", None)) is not None
    }
    if len(modes) > 1:
        raise ValueError(
            f"this graph's meta['val'] tensors come from {len(modes)} different fake modes, so "
            "no rule can compute new values in it (PyTorch: 'Mixing fake modes NYI'). That is "
            "what make_fx(model)(x) on real inputs gives. Capture the graph with "
            "fxpass.capture(model, *args, **kwargs) (one shared fake mode, weights marked), or "
            "trace with make_fx under a single FakeTensorMode."
        )
    vals = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                mode = detect_fake_mode([v])
                if mode is not None:
                    break
    return mode if mode is not None else FakeTensorMode(allow_non_fake_inputs=True)


def require_meta(gm: GraphModule) -> None:
    """Fail with the fix when a graph has no ``meta['val']`` (rules need shapes and dtypes)."""
    missing = []
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "call_function", "get_attr") or "val" in n.meta:
            continue
        parent = n.args[0] if n.target is operator.getitem else None
        if isinstance(parent, Node) and isinstance(parent.meta.get("val"), (tuple, list)):
            n.meta["val"] = parent.meta["val"][n.args[1]]  # tracers skip non-tensor items
        elif isinstance(n.target, torch._ops.OpOverload) and not n.target._schema.returns:
            # an op that returns nothing (_assert_async, _assert_scalar, a profiler mark): its
            # value is None; tracers record no meta for it
            n.meta["val"] = None
        else:
            missing.append(n.name)
    if missing:
        raise ValueError(
            f"fxpass needs meta['val'] on every node; missing on {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}. Trace with make_fx / AOTAutograd, or run "
            "fxpass.graph.propagate_meta(gm, *example_inputs) first."
        )


def propagate_meta(gm: GraphModule, *example_inputs: torch.Tensor) -> GraphModule:
    """Fill ``meta['val']`` by fake-tensor propagation of ``example_inputs``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*example_inputs)
    return gm


def is_static(v: Any) -> bool:
    """True when a fake tensor (or a tuple of them) has only concrete sizes and strides.

    Strides count too: a view of a symbolically sized buffer has fixed sizes but symbolic
    strides (seen on a graph Dynamo made dynamic after recompiles), and rules that compare or
    key on layouts cannot use them."""
    if isinstance(v, (tuple, list)):
        return all(is_static(x) for x in v)
    if isinstance(v, torch.Tensor):
        if not all(isinstance(s, int) for s in v.shape):
            return False
        return v.layout is not torch.strided or all(isinstance(s, int) for s in v.stride())
    return not isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool)


def bind_args(node: Node) -> dict[str, Any]:
    """Schema argument name -> value (defaults filled in), so code reads ``a["dim"]`` instead
    of guessing whether an argument was passed positionally or by keyword."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same strides on every dimension that has more than one element."""
    if a.shape != b.shape:
        return False
    return all(
        sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride(), strict=True) if n != 1
    )


def constant_value(node: Any) -> torch.Tensor | None:
    """The real tensor behind a ``get_attr`` or a frozen placeholder, else None."""
    if not isinstance(node, Node):
        return None
    if node.op == "get_attr":
        obj: Any = node.graph.owning_module
        for part in str(node.target).split("."):
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, torch.Tensor) else None
    if node.op == "placeholder":
        return node.meta.get(FROZEN)
    return None


_IMPURE_TARGETS = {operator.setitem}


@cache
def writes(target: Any) -> bool:
    """Whether an op's schema writes to any of its arguments (in-place / out= / copy_)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


@cache
def is_view(target: Any) -> bool:
    """Whether an op returns an alias of its input (view, expand, alias, ...)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    r = schema.returns[0].alias_info
    return r is not None and not r.is_write


def is_pure(node: Node) -> bool:
    """Whether erasing an unused ``node`` cannot change behaviour."""
    if node.op in ("placeholder", "output"):
        return False
    if node.op == "get_attr":
        return True
    if node.op != "call_function" or node.target in _IMPURE_TARGETS:
        return False
    return not node.is_impure()


def erase_if_dead(node: Node, erased: list[Node] | None = None, force: bool = False) -> None:
    """Erase unused ``node`` and, transitively, pure producers that became unused.

    ``force`` erases ``node`` itself even if it is not provably pure (a rule replaced it, so
    it knows the value is dead; an op that writes to an argument is never forced: its effect
    is not its value). Producers are erased only if pure. Iterative, not recursive.
    """
    stack = [node]
    while stack:
        n = stack.pop()
        if n._erased or n.users or n.op in ("placeholder", "output"):
            continue
        forced = force and n is node and not (n.op == "call_function" and writes(n.target))
        if not forced and not is_pure(n):
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        if erased is not None:
            erased.append(n)
        stack.extend(inputs)


def fingerprint(gm: GraphModule) -> tuple:
    """Structure of a graph, for "did anything change?" within one process (check mode).

    One record per node, in order: ``(node, op, target, name, args, kwargs)``. It holds
    references, not text: building it is a few hundred nanoseconds per node (hashing the
    repr of every argument cost tens of microseconds), and comparing two with ``==`` is
    identity-fast for untouched nodes (torch.fx rebuilds ``args``/``kwargs`` on every
    assignment and freezes their lists, so an edit can never mutate a recorded tuple). Not
    stable across processes: do not use it as a persistent cache key. See
    :func:`fingerprint_diff` for what changed.
    """
    return tuple([(n, n.op, n.target, n.name, n._args, n._kwargs) for n in gm.graph.nodes])


_FIELDS = ("op", "target", "name", "args", "kwargs")


def fingerprint_diff(
    before: tuple, after: tuple, created: Any = (), edited: Any = ()
) -> str | None:
    """The first change from ``before`` to ``after`` not explained by ``created`` nodes (new,
    anywhere) and ``edited`` nodes (may differ in any field), described; None if none."""
    new = set(created)
    ok = set(edited)
    kept = [r for r in after if r[0] not in new] if new else list(after)
    was = {r[0] for r in before}
    now = {r[0] for r in kept}
    for r in kept:
        if r[0] not in was:
            return f"node {r[1]} {r[3]} ({r[2]}) was created"
    for r in before:
        if r[0] not in now:
            return f"node {r[3]} ({r[2]}) was erased"
    for b, a in zip(before, kept, strict=True):
        if b[0] is not a[0]:
            return f"node {a[3]} was moved (now where {b[3]} was)"
        if b != a and b[0] not in ok:
            for i, field in enumerate(_FIELDS, start=1):
                if b[i] != a[i]:
                    was_, now_ = repr(b[i])[:120], repr(a[i])[:120]
                    return f"node {b[3]}: {field} {was_} -> {now_}"
    return None
