"""Declarative patterns: match a tree of ops, bind its leaves, rewrite; single use for free.

A multi-node rule written by hand has to remember that an inner node may have other users,
that an in-place op is not a value, that ``_to_copy(x, dtype=f32)`` is not the same op as
``_to_copy(x, dtype=f32, memory_format=...)``. A pattern states the tree once::

    FOLD = P(aten.mul.Tensor, P(aten.mul.Tensor, Var("x"), Num("a")), Num("b"))

    @pattern_rule(FOLD)
    def fold_muls(rw, m):
        "x * a * b -> x * (a * b) for Python numbers a, b."
        return rw.call(aten.mul.Tensor, m.x, m.a * m.b)

Matching (top-down from the root node the driver offers, so the rule is indexed by the root's
targets like any ``@rule``):

- ``P(target, *args, **kwargs)`` matches a ``call_function`` node whose target is ``target``
  (an overload, a packet meaning all its overloads, or a tuple of them). Arguments are compared
  position by position *after filling in the schema's defaults*, so an argument the pattern
  leaves out must have its default value in the node: strict by construction.
- ``Var("x")`` binds anything (a node or a Python value); the same name twice must bind the
  same value. ``Var("x", dtype=torch.float32)`` also requires a tensor of that dtype.
- ``Num("a")`` binds a Python int or float (not a bool, not a tensor).
- ``ANY`` matches anything without binding. Any other Python value must be equal.
- ``P(..., name="inner")`` binds the matched node as ``m.inner`` (the root is ``m.root``).
- Every node the pattern matched below the root must be used only inside the match, and be
  pure: the rewrite replaces the root, so an inner node with another user would be either
  duplicated or (if edited in place) wrong for that user. ``P(..., shared=True)`` allows other
  users (the rewrite then must not edit that node; it can read it).
- ``P(..., commute=True)`` also tries the two first arguments swapped.

The rewrite function gets ``(rw, m)`` and returns the replacement for the root (a node or a
Python value), ``True`` if it made its own edits through ``rw``, or ``None``/``False`` for "not
here" (after ``rw.skip(why)`` when a reader would want to know). An optional
``check(m)`` returning ``True``/``None`` to proceed, or ``False``/a reason string to refuse,
keeps the condition apart from the rewrite (onnxscript's pattern/check/rewrite split).

A near-miss (the root and at least one inner op matched, then something failed) is recorded
as a skip reason in the report, with the path to the failing argument; ``pattern.explain(node)``
gives the reason for any node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from .rule import Rule, _describe, rule

__all__ = ["ANY", "Match", "Maybe", "Multi", "Num", "Or", "P", "Var",  # noqa: F822
           "pattern_from", "pattern_rule"]  # pattern_from: the module __getattr__ below

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
        m, _, _ = _matching._match_root(self, node)
        return m

    def explain(self, node: Node) -> str | None:
        """Why the pattern does not match at ``node`` (None if it does)."""
        _, why, _ = _matching._match_root(self, node)
        return why


class P(_Rooted):
    """An op node pattern (see the module docstring)."""

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


RewriteFn = Callable[[Any, Match], Any]


def pattern_rule(
    pattern: P,
    *,
    name: str | None = None,
    check: Callable[[Match], bool | str | None] | None = None,
    priority: int = 0,
    description: str | None = None,
    default: bool = True,
    tags: Iterable[str] = (),
    targets: Iterable[str] = (),
    applies: Callable[[Any], bool] | None = None,
) -> Callable[[RewriteFn], Rule]:
    """Decorate ``fn(rw, m)`` into a :class:`Rule` rooted at ``pattern``'s targets.

    The rule carries the pattern (``rule.pattern``), so ``fxpass.testing.check_rule`` also
    generates graphs around it, shared inner values included.
    """
    if not isinstance(pattern, (P, Or, Multi)) or not pattern.targets:
        raise TypeError(f"pattern_rule wants a P(...), Or(P(...), ...) or Multi(P(...), ...) "
                        f"pattern at the root, got {pattern!r}")

    def wrap(fn: RewriteFn) -> Rule:
        def apply(node: Node, rw: Any) -> bool:
            m, why, depth = _matching._match_root(pattern, node)
            if m is None:
                if depth > 1:  # a near-miss: worth a line in the report
                    rw.skip(f"pattern: {why}")
                return False
            if check is not None:
                ok = check(m)
                if ok is False or isinstance(ok, str):
                    return rw.skip(ok if isinstance(ok, str) else f"check {check.__name__} failed")
            if isinstance(pattern, Multi):
                return _rewrite_multi(rw, m, fn)
            out = fn(rw, m)
            if out is None or out is False:
                return False
            if out is True:
                return True
            rw.replace(node, out)
            return True

        made = rule(
            *pattern.targets,
            name=name or fn.__name__,
            priority=priority,
            description=_describe(fn, description),
            default=default,
            tags=tags,
            targets=targets,
            applies=applies,
        )(apply)
        return dataclasses.replace(made, pattern=pattern)

    return wrap


def _rewrite_multi(rw: Any, m: Match, fn: RewriteFn) -> bool:
    """A multi-root rewrite, built before the earliest root (every root's users come after
    it); its inputs must all be defined before that point, else the rule skips."""
    first = min(m.roots, key=_matching._order)
    start = _matching._order(first)
    late = [v.name for v in m.bindings.values()
            if isinstance(v, Node) and v not in m.nodes and _matching._order(v) > start]
    if late:
        return rw.skip(f"pattern: {late} are defined after the first root {first.name}")
    with rw.at(first):
        out = fn(rw, m)
    if out is None or out is False:
        return False
    if out is True:
        return True
    if not isinstance(out, (tuple, list)) or len(out) != len(m.roots):
        raise TypeError(f"a Multi pattern's rewrite returns one replacement per root "
                        f"({len(m.roots)}), got {out!r}")
    for root, new in zip(m.roots, out, strict=True):
        rw.replace(root, new)
    return True



def __getattr__(name: str) -> Any:
    """``pattern_from`` lives in :mod:`fxpass.by_example`, which builds on the classes above;
    loaded on first use, so either module may be imported first."""
    if name == "pattern_from":
        from .by_example import pattern_from

        return pattern_from
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# the engine reads the classes above: imported once they exist, as a module (its names are
# looked up at call time, so importing fxpass.matching first works too)
from . import matching as _matching  # noqa: E402
