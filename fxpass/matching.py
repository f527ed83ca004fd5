"""The matcher behind :mod:`fxpass.pattern`: a pattern tree against a node, top-down.

Arguments are compared after filling in the schema's defaults (strict by construction); every
inner node must be pure and used only inside the match unless ``shared``; ``Or`` tries its
alternatives in order; a ``Multi`` finds its other roots among the first root's neighbours. A
failure returns the reason with the path to the failing argument (a near-miss the report
shows), never just "no match".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from .graph import is_pure, writes
from .pattern import _NO_DEFAULT, ANY, Match, Multi, Num, Or, P, Var, _Any


@dataclass
class _State:
    bindings: dict[str, Any] = field(default_factory=dict)
    nodes: list[tuple[Node, P]] = field(default_factory=list)
    depth: int = 0  # how many op patterns matched their target (near-miss if > 1)


def _label(v: Any) -> str:
    if isinstance(v, Node):
        return f"{v.name} ({v.target})" if v.op == "call_function" else f"{v.name} ({v.op})"
    return repr(v)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Node) or isinstance(b, Node):
        return a is b
    try:
        return bool(type(a) is type(b) and a == b) or (
            isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) == list(b)
        )
    except Exception:  # a tensor, say: no unambiguous equality
        return a is b


def _match_value(pat: Any, v: Any, st: _State, where: str) -> str | None:
    if pat is ANY:
        return None
    if isinstance(pat, P):
        return _match_op(pat, v, st, where)
    if isinstance(pat, Or):
        whys = []
        for alt in pat.alternatives:
            saved = (dict(st.bindings), list(st.nodes), st.depth)
            why = _match_value(alt, v, st, where)
            if why is None:
                return None
            whys.append(why)
            st.bindings, st.nodes, depth = saved
            st.depth = max(st.depth, depth)
        return " / ".join(f"alternative {i}: {w}" for i, w in enumerate(whys))
    if isinstance(pat, (list, tuple)) and any(isinstance(x, (P, Or, Var, Num, _Any)) for x in pat):
        if not isinstance(v, (list, tuple)) or len(v) != len(pat):
            return f"{where}: wants a list of {len(pat)}, got {_label(v)}"
        for i, (p, x) in enumerate(zip(pat, v, strict=True)):
            why = _match_value(p, x, st, f"{where}[{i}]")
            if why is not None:
                return why
        return None
    if isinstance(pat, (Var, Num)):
        if isinstance(pat, Num) and (
            isinstance(v, (bool, Node)) or not isinstance(v, (int, float))
        ):
            return f"{where}: {pat!r} wants a Python number, got {_label(v)}"
        if isinstance(pat, Var) and pat.dtype is not None:
            val = v.meta.get("val") if isinstance(v, Node) else None
            want = pat.dtype if isinstance(pat.dtype, tuple) else (pat.dtype,)
            if not isinstance(val, torch.Tensor) or val.dtype not in want:
                got = val.dtype if isinstance(val, torch.Tensor) else type(v).__name__
                return f"{where}: {pat!r} wants a tensor of {want}, got {_label(v)}: {got}"
        if pat.name in st.bindings:
            if not _same(st.bindings[pat.name], v):
                return (
                    f"{where}: {pat.name!r} is bound to {_label(st.bindings[pat.name])} "
                    f"elsewhere in the pattern, here to {_label(v)}"
                )
            return None
        st.bindings[pat.name] = v
        return None
    if not _same(pat, v):
        return f"{where}: wants {pat!r}, got {_label(v)}"
    return None


def _normalized(pat: P, node: Node) -> tuple[list[tuple[str, Any, Any]], str | None]:
    """(argument name, pattern value, node value) for every argument, defaults filled in."""
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is None:  # a Python callable (operator.getitem, ...): compare as written
        if len(pat.args) != len(node.args) or set(pat.kwargs) != set(node.kwargs):
            return [], f"{node.name} has arguments {node.args}, {node.kwargs}"
        pairs = [
            (f"arg {i}", p, v) for i, (p, v) in enumerate(zip(pat.args, node.args, strict=True))
        ]
        pairs += [(k, pat.kwargs[k], node.kwargs[k]) for k in pat.kwargs]
        return pairs, None
    out = []
    names = {a.name for a in schema.arguments}
    extra = set(pat.kwargs) - names
    if extra:
        return [], f"pattern keyword(s) {sorted(extra)} are not arguments of {target}"
    if len(pat.args) > len(schema.arguments):
        return [], f"pattern has {len(pat.args)} positional arguments; {target} takes fewer"
    for i, a in enumerate(schema.arguments):
        default = a.default_value if a.has_default_value() else _NO_DEFAULT
        if i < len(node.args) and not a.kwarg_only:
            v = node.args[i]
        else:
            v = node.kwargs.get(a.name, default)
        if i < len(pat.args) and not a.kwarg_only:
            p = pat.args[i]
        else:
            p = pat.kwargs.get(a.name, default)
        if p is _NO_DEFAULT:
            return [], f"the pattern gives no value for {target}'s required argument {a.name!r}"
        out.append((a.name, p, v))
    return out, None


def _match_op(pat: P, v: Any, st: _State, where: str) -> str | None:
    if not isinstance(v, Node) or v.op != "call_function" or id(v.target) not in pat._ids:
        want = pat.targets[0] if len(pat.targets) == 1 else list(pat.targets)
        return f"{where}: wants {want}, got {_label(v)}"
    st.depth += 1
    pairs, why = _normalized(pat, v)
    if why is not None:
        return f"{where}: {why}"
    orders = [pairs]
    if pat.commute:
        swapped = list(pairs)
        (n0, p0, _), (n1, p1, _) = swapped[0], swapped[1]
        swapped[0], swapped[1] = (n0, p1, pairs[0][2]), (n1, p0, pairs[1][2])
        orders.append(swapped)
    first_why = None
    for order in orders:
        saved = (dict(st.bindings), list(st.nodes), st.depth)
        for argname, p, val in order:
            why = _match_value(p, val, st, f"{argname} of {v.name}")
            if why is not None:
                break
        else:
            why = _bind_node(pat, v, st, where)
            if why is None:
                st.nodes.append((v, pat))
                return None
        first_why = first_why or why
        st.bindings, st.nodes, depth = saved
        st.depth = max(st.depth, depth)
    return first_why


def _bind_node(pat: P, v: Node, st: _State, where: str) -> str | None:
    """Bind ``P(name=...)``; a name bound twice must be the same node (as for ``Var``)."""
    if pat.name is None:
        return None
    if pat.name in st.bindings and not _same(st.bindings[pat.name], v):
        old, new = _label(st.bindings[pat.name]), _label(v)
        return f"{where}: {pat.name!r} is bound to {old} elsewhere in the pattern, here to {new}"
    st.bindings[pat.name] = v
    return None


def _more_roots(pat: Multi, first: Node, st: _State) -> tuple[list[Node], str | None]:
    """The roots after the first: each the first user (in graph order) of a node matched or
    bound so far that matches its pattern with the bindings so far."""
    roots = [first]
    for i, p in enumerate(pat.roots[1:], 1):
        taken = {n for n, _ in st.nodes} | set(roots)
        seeds = taken | {v for v in st.bindings.values() if isinstance(v, Node)}
        pool = sorted({u for n in seeds for u in n.users if u not in taken},
                      key=lambda u: _order(u))
        for cand in pool:
            saved = (dict(st.bindings), list(st.nodes), st.depth)
            if _match_value(p, cand, st, f"root {i}") is None:
                roots.append(cand)
                break
            st.bindings, st.nodes, st.depth = saved
        else:
            return roots, f"root {i} ({p!r}) matches no user of the values root 0 matched"
    return roots, None


def _order(n: Node) -> int:
    """A node's position (FX keeps nodes in a linked list: count from the graph's start)."""
    i = 0
    for i, x in enumerate(n.graph.nodes):  # noqa: B007 - the index is the answer
        if x is n:
            break
    return i


def _match_root(pat: P | Or | Multi, node: Node) -> tuple[Match | None, str | None, int]:
    st = _State()
    first = pat.roots[0] if isinstance(pat, Multi) else pat
    why = _match_value(first, node, st, "root")
    if why is not None:
        return None, why, st.depth
    roots = [node]
    if isinstance(pat, Multi):
        roots, why = _more_roots(pat, node, st)
        if why is not None:
            return None, why, max(st.depth, 2)
    matched = {n for n, _ in st.nodes}
    for n, p in st.nodes:
        if n in roots:
            continue
        if not is_pure(n) or writes(n.target):
            return None, f"{n.name} ({n.target}) is not a pure value (it writes or is impure)", 9
        if not p.shared:
            outside = [u.name for u in n.users if u not in matched]
            if outside:
                return (
                    None,
                    (
                        f"{n.name} ({n.target}) is also used by {outside}, outside the pattern: "
                        f"the rewrite would duplicate it or change it under them; mark it "
                        f"P(..., shared=True) if the rewrite only reads it"
                    ),
                    9,
                )
    bindings = dict(st.bindings)
    return Match(node, bindings, [n for n, _ in st.nodes], roots), None, st.depth
