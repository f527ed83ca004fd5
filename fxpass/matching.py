"""The pattern language of :mod:`fxpass.pattern` (``P``, ``Var``, ``Num``, ``ANY``, ``Or``,
``Maybe``, ``Multi``, ``Match``) and its matcher: a pattern tree against a node, top-down.

One module for both because each needs the other (a pattern's ``match`` runs the matcher, the
matcher dispatches on the pattern classes): split, they were an import circle.
:mod:`fxpass.pattern` is the public face (it re-exports these and adds ``pattern_rule`` and
``pattern_from``); import from there.

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

_NO_DEFAULT = object()


class _Any:
    def __repr__(self) -> str:
        return "ANY"


ANY = _Any()


@dataclass(frozen=True)
class Var:
    """Binds any value under ``name``; ``dtype`` (one or a tuple) also requires a tensor of it."""

    name: str
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None

    def __repr__(self) -> str:
        return f"Var({self.name!r})" if self.dtype is None else f"Var({self.name!r}, {self.dtype})"


@dataclass(frozen=True)
class Num:
    """Binds a Python int or float (not a bool, not a tensor) under ``name``."""

    name: str

    def __repr__(self) -> str:
        return f"Num({self.name!r})"


def _overloads(t: Any) -> tuple[Any, ...]:
    if isinstance(t, (tuple, list, set, frozenset)):
        return tuple(o for x in t for o in _overloads(x))
    if isinstance(t, torch._ops.OpOverloadPacket):
        return tuple(getattr(t, name) for name in t.overloads())
    return (t,)


class _Rooted:
    """``match``/``explain`` at a node, for every pattern that can be a rule's root."""

    def match(self, node: Node) -> Match | None:
        """The match rooted at ``node``, or None (see :meth:`explain` for why not)."""
        m, _, _ = _match_root(self, node)
        return m

    def explain(self, node: Node) -> str | None:
        """Why the pattern does not match at ``node`` (None if it does)."""
        _, why, _ = _match_root(self, node)
        return why


class P(_Rooted):
    """An op node pattern (see :mod:`fxpass.pattern` for the language)."""

    def __init__(
        self,
        target: Any,
        *args: Any,
        name: str | None = None,
        shared: bool = False,
        commute: bool = False,
        **kwargs: Any,
    ):
        self.targets = _overloads(target)
        if not self.targets:
            raise ValueError(f"P({target!r}): no op overloads to match")
        self.args, self.kwargs = args, kwargs
        self.name, self.shared, self.commute = name, shared, commute
        if commute and len(args) < 2:
            raise ValueError("P(commute=True) needs at least two positional arguments")
        self._ids = frozenset(id(t) for t in self.targets)

    def __repr__(self) -> str:
        t = self.targets[0] if len(self.targets) == 1 else list(self.targets)
        flags = [f"name={self.name!r}"] if self.name is not None else []
        flags += [f"{f}=True" for f in ("shared", "commute") if getattr(self, f)]
        inner = ", ".join(
            [repr(a) for a in self.args]
            + [f"{k}={v!r}" for k, v in self.kwargs.items()]
            + flags  # every flag: a failing pattern must show the one at fault
        )
        return f"P({t}{', ' if inner else ''}{inner})"

    def nodes(self) -> list[P]:
        """This pattern and every op pattern below it, root first."""
        out: list[P] = [self]
        for a in (*self.args, *self.kwargs.values()):
            for x in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(x, (P, Or)):
                    out.extend(x.nodes())
        return out


class Or(_Rooted):
    """Matches if one of ``alternatives`` does (tried in order; the first match's bindings
    are kept). A ``Var`` bound in only some alternatives may be missing from the match: test
    ``"name" in m.bindings``. At the root, the rule is indexed by every alternative's root."""

    def __init__(self, *alternatives: Any):
        if len(alternatives) < 2:
            raise ValueError("Or(...) needs at least two alternatives")
        self.alternatives = alternatives

    @property
    def targets(self) -> tuple[Any, ...]:
        out: list[Any] = []
        for a in self.alternatives:
            for t in getattr(a, "targets", ()):
                if t not in out:
                    out.append(t)
        return tuple(out)

    def nodes(self) -> list[P]:
        return [n for a in self.alternatives if isinstance(a, (P, Or)) for n in a.nodes()]

    def __repr__(self) -> str:
        return f"Or({', '.join(repr(a) for a in self.alternatives)})"


def Maybe(target: Any, inner: Any, *args: Any, **kwargs: Any) -> Or:  # noqa: N802
    """``inner``, or ``inner`` wrapped in one ``target`` node (a cast that may or may not be
    there): ``Maybe(aten._to_copy.default, P(...), dtype=ANY)``."""
    return Or(P(target, inner, *args, **kwargs), inner)


class Multi(_Rooted):
    """Several roots matched together (a multi-output pattern): ``Multi(p0, p1, ...)``.

    The rule is indexed by ``p0``'s targets; each further root is looked for among the users
    of the nodes matched or bound so far, with the same bindings (a ``Var`` named in two roots
    is one value). The single-use rule covers the whole match: an inner node may be used by
    any node of any root, by nothing else. The rewrite returns one replacement per root (a
    tuple, in order), built before the earliest root."""

    def __init__(self, *roots: P):
        if len(roots) < 2 or not all(isinstance(r, P) for r in roots):
            raise ValueError("Multi(...) takes two or more P(...) roots")
        self.roots = roots

    @property
    def targets(self) -> tuple[Any, ...]:
        return self.roots[0].targets

    def nodes(self) -> list[P]:
        return [n for r in self.roots for n in r.nodes()]

    def __repr__(self) -> str:
        return f"Multi({', '.join(repr(r) for r in self.roots)})"


class Match:
    """Bindings by name (``m.x``), the root node (``m.root``; every root of a ``Multi`` in
    ``m.roots``) and every matched node."""

    def __init__(self, root: Node, bindings: dict[str, Any], nodes: list[Node],
                 roots: list[Node] | None = None):
        self.root, self.bindings, self.nodes = root, bindings, nodes
        self.roots = roots or [root]

    def __getattr__(self, key: str) -> Any:
        try:
            return self.__dict__["bindings"][key]
        except KeyError:
            raise AttributeError(
                f"pattern has no binding {key!r}; bound: {sorted(self.__dict__['bindings'])}"
            ) from None

    def __getitem__(self, key: str) -> Any:
        return self.bindings[key]

    def __repr__(self) -> str:
        return f"Match(root={self.root.name}, {self.bindings})"



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


def _equal_numbers(a: Any, b: Any) -> bool:
    """An int and a float of one value (``3`` and ``3.0``; never a bool, which reads as a flag)."""
    kinds = (type(a), type(b))
    return kinds in ((int, float), (float, int)) and a == b


def _promotion(owner: Node, argname: str) -> str | None:
    """Why an int and a float of one value can give ``owner`` different results as its argument
    ``argname``; None where they cannot, and the pattern's number matches either spelling.

    They cannot where the schema declares the argument ``float`` (an int is converted before the
    op sees it), or where one of the node's tensor inputs is floating point or complex: a
    Python number then never changes the result's dtype (tensors win type promotion within a
    category, and float is the highest a Python int or float reaches), and it is converted to
    that dtype before use, so ``x + 3`` and ``x + 3.0`` on a float ``x`` compute the same. On
    integer or bool tensors ``x + 3.0`` is a float tensor and ``x + 3`` is not: distinct.
    Without a schema (``operator.*`` on sizes) the types stay strict."""
    schema = getattr(owner.target, "_schema", None)
    if schema is None:
        return f"{owner.name} ({owner.target}) has no schema to say the number's type is moot"
    arg = next((a for a in schema.arguments if a.name == argname), None)
    kind = arg.type if arg is not None else None
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    if isinstance(kind, torch.FloatType):
        return None
    dtypes = [v.dtype for n in owner.all_input_nodes
              if isinstance(v := n.meta.get("val"), torch.Tensor)]
    if any(d.is_floating_point or d.is_complex for d in dtypes):
        return None
    got = ", ".join(str(d) for d in dtypes) if dtypes else "none with a known dtype"
    return (f"the number's type matters here: {owner.name}'s tensor inputs are not floating "
            f"point ({got}), so an int and a float give results of different dtypes (type "
            f"promotion)")


def _match_value(
    pat: Any, v: Any, st: _State, where: str, owner: tuple[Node, str] | None = None
) -> str | None:
    """Match ``pat`` against ``v``; ``owner`` is (the node, the argument name) ``v`` fills, for
    comparing a number of the pattern with one of another type (:func:`_promotion`)."""
    if pat is ANY:
        return None
    if isinstance(pat, P):
        return _match_op(pat, v, st, where)
    if isinstance(pat, Or):
        whys = []
        for alt in pat.alternatives:
            saved = (dict(st.bindings), list(st.nodes), st.depth)
            why = _match_value(alt, v, st, where, owner)
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
            why = _match_value(p, x, st, f"{where}[{i}]", owner)
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
    if _same(pat, v):
        return None
    if _equal_numbers(pat, v):
        why = _promotion(*owner) if owner is not None else "not an argument of an op"
        return None if why is None else f"{where}: wants {pat!r}, got {v!r}: {why}"
    return f"{where}: wants {pat!r}, got {_label(v)}"


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
            why = _match_value(p, val, st, f"{argname} of {v.name}", (v, argname))
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
