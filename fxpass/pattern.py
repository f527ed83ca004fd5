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
- ``ANY`` matches anything without binding. Any other Python value must be equal; an int
  and a float of one value (``3``, ``3.0``) are equal where the type cannot change the op's
  result (a float tensor's operand, a ``float`` argument), and distinct where it can (type
  promotion on integer tensors), which the near-miss reason says.
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

Layout (one direction, no import circle): this module is what rule authors import; the pattern
classes and the matcher are :mod:`fxpass.matching`, ``pattern_from`` is
:mod:`fxpass.by_example`, and its tracer is :mod:`fxpass.tracing` (no test kit needed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from torch.fx import Node

from .by_example import pattern_from
from .matching import ANY, Match, Maybe, Multi, Num, Or, P, Var, _match_root, _order
from .rule import Rule, _describe, rule

__all__ = ["ANY", "Match", "Maybe", "Multi", "Num", "Or", "P", "Var", "pattern_from",
           "pattern_rule"]

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
            m, why, depth = _match_root(pattern, node)
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
    first = min(m.roots, key=_order)
    start = _order(first)
    late = [v.name for v in m.bindings.values()
            if isinstance(v, Node) and v not in m.nodes and _order(v) > start]
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
