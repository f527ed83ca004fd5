"""constant_folding: evaluate input-independent subgraphs into constants.

Before -> after: any subgraph whose leaves are constants (``get_attr``), frozen weights or
buffers (placeholders the backend marked with ``meta['fxpass_frozen']``) or nothing at all
(``arange``, ``full``, ``ones``, ``scalar_tensor``, ...) -> one ``get_attr`` per value the rest of
the graph uses. Position ids, rotary cos/sin tables, causal-mask construction and casts or
transposes of weights all become constants.

Why: those subgraphs are int64/bool index arithmetic a device cannot run; left in, they cut
the model into many small regions.

Left alone on purpose: a pure layout/dtype view of one weight (``t``, ``permute``, ``view``,
a bf16 -> f32 cast, chained; ``WEIGHT_VIEWS``) whose consumers read the whole weight. Folding
it would copy the weight for the lifetime of the graph (twice its size for a cast), while a
backend does it for free: a CPU op takes the view as is, and a lowering writes the transposed
or cast weight once into its own initializer. The report's skip reasons say so. A view that
an indexing op reads (``embedding``: a few rows per call) is still folded, since recomputing
the cast of a whole table per call would cost more than the copy.

Does not fire when: the result is much larger than its inputs (``FXPASS_FOLD_MAX_GROWTH``
times, default 64, and more than ``FXPASS_FOLD_MIN_BYTES``, default 4 MiB; e.g. a broadcast
``expand``): the fold is refused and the report says so; an op is random, mutating or
uninitialized (``empty``); the shape is symbolic; the value is a graph output (the caller may
write to it, and a folded constant would be one tensor shared by every call).

The two limits are read (and validated, by :mod:`fxpass.env`) each time the rule runs, not at
import: a bad value is then an error naming the variable when a graph is compiled, not an
import failure that takes the whole built-in rules plugin with it.
"""

from __future__ import annotations

import operator
from functools import cache
from typing import Any

import torch
from torch.fx.node import map_arg

from fxpass import env, graph_rule
from fxpass.graph import FROZEN, constant_value, is_static
from fxpass.rules._util import aten, prims, writes

_NEVER = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default}
#: pure layout/dtype ops: a chain of them over one weight is a view, not worth a copy
WEIGHT_VIEWS = frozenset(
    {
        aten.t.default,
        aten.transpose.int,
        aten.permute.default,
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.clone.default,
        aten._to_copy.default,
        prims.convert_element_type.default,
    }
)
#: consumers that read a few rows of a weight: a cast view feeding them is still folded
_INDEXING = frozenset(
    {
        aten.embedding.default,
        aten.index.Tensor,
        aten._unsafe_index.Tensor,
        aten.index_select.default,
        aten.gather.default,
        aten.select.int,
        aten.slice.Tensor,
    }
)


def _weight_view(n: Any) -> bool:
    """``n`` is a chain of ``WEIGHT_VIEWS`` over one weight, read whole by every consumer."""
    if any(u.target in _INDEXING for u in n.users):
        return False
    while n.op == "call_function":
        if n.target not in WEIGHT_VIEWS or len(n.all_input_nodes) != 1:
            return False
        n = n.all_input_nodes[0]
    return True  # a get_attr or a frozen placeholder (the caller knows n is constant)


@cache
def _foldable(target: Any) -> bool:
    if target is operator.getitem:  # an element of a folded tuple (weight norm's (w, norm))
        return True
    if not isinstance(target, torch._ops.OpOverload) or target in _NEVER or writes(target):
        return False
    if "empty" in target._schema.name:  # uninitialized memory: empty, new_empty, empty_permuted
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags


def _nbytes(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


@graph_rule(name="constant_folding", priority=-10)
def constant_folding(gm, rw):
    """Fold input-independent subgraphs (arange, masks, full, casts of constants/weights)."""
    max_growth = env.get("FXPASS_FOLD_MAX_GROWTH")
    min_bytes = env.get("FXPASS_FOLD_MIN_BYTES")
    graph = gm.graph
    leaf_bytes: dict[Any, int] = {}  # constant node -> bytes of the constant leaves under it
    for n in graph.nodes:
        if n.op == "get_attr" or (n.op == "placeholder" and FROZEN in n.meta):
            leaf_bytes[n] = _nbytes(n.meta.get("val"))
        elif (
            n.op == "call_function"
            and _foldable(n.target)
            and all(i in leaf_bytes for i in n.all_input_nodes)
        ):
            leaf_bytes[n] = sum(leaf_bytes[i] for i in n.all_input_nodes)
    frontier = [
        n
        for n in leaf_bytes
        if n.op == "call_function"
        and isinstance(n.meta.get("val"), torch.Tensor)
        and any(u not in leaf_bytes for u in n.users)
    ]
    values: dict[Any, Any] = {}

    def value(n: Any) -> Any:
        stack = [n]
        while stack:
            m = stack[-1]
            if m in values:
                stack.pop()
                continue
            todo = [i for i in m.all_input_nodes if i not in values]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            if m.op != "call_function":
                values[m] = constant_value(m)
                continue
            args, kwargs = map_arg((m.args, m.kwargs), lambda x: values[x])
            values[m] = m.target(*args, **kwargs)
        return values[n]

    changed = False
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # Folded constants go right after the placeholders, so one get_attr can serve every user;
    # identical subgraphs (the same arange in every layer) fold to one shared constant.
    top = next((n for n in graph.nodes if n.op != "placeholder"), None)
    shared: dict[Any, Any] = {}
    keys: dict[Any, Any] = {}

    def norm(a: Any) -> Any:
        # 1 == 1.0 == True and 0.0 == -0.0 in Python, but not as op arguments: key by repr
        if isinstance(a, (tuple, list)):
            return (type(a).__name__, tuple(norm(x) for x in a))
        if isinstance(a, dict):
            return tuple((k, norm(v)) for k, v in sorted(a.items()))
        return key(a) if isinstance(a, torch.fx.Node) else (type(a).__name__, repr(a))

    def key(m: Any) -> Any:
        if m in keys:
            return keys[m]
        k = ("leaf", m) if m.op != "call_function" else (m.target, norm(m.args), norm(m.kwargs))
        keys[m] = k
        return k

    with unset_fake_temporarily(), torch.no_grad():
        for n in frontier:
            if not is_static(n.meta["val"]):
                rw.skip(f"{n.name}: symbolic shape, not folded")
                continue
            if _weight_view(n):
                rw.skip("a layout/dtype view of one weight, left to the backend (not worth a copy)")
                continue
            if any(u.op == "output" for u in n.users):
                # the caller owns a returned tensor and may write to it: a folded constant
                # would be one tensor shared by every call (x.new_zeros(4) returned, then +=)
                rw.skip(f"{n.name}: returned by the graph, so computed fresh on every call")
                continue
            out = _nbytes(n.meta["val"])
            if out > min_bytes and out > max_growth * max(leaf_bytes[n], 1):
                rw.skip(
                    f"refused to fold {n.name} ({n.target}): {out} bytes from {leaf_bytes[n]} "
                    f"bytes of inputs exceeds the budget ({max_growth:g}x above {min_bytes} B)"
                )
                continue
            k = key(n)
            c = shared.get(k)
            if c is None:
                t = value(n)
                with rw.at(top):
                    c = shared[k] = rw.const(t.contiguous() if t.dim() else t, hint="fold")
            rw.replace(n, c)
            changed = True
    return changed
