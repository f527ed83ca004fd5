"""The rule API: a named, idempotent rewrite rooted at a set of op overloads.

A node rule is ``fn(node, rewriter) -> bool``; it returns whether it changed the graph and
touches the graph only through the rewriter, so the driver can index it by ``node.target``,
roll it back when it raises, and know what to revisit. A graph rule is
``fn(graph_module, rewriter) -> bool`` for rewrites that need a whole region at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

NodeFn = Callable[..., bool]


@dataclass(frozen=True, eq=False)
class Rule:
    """One rewrite. ``roots=None`` means the rule is tried on every node (slow path)."""

    name: str
    fn: NodeFn
    roots: tuple[Any, ...] | None = None
    priority: int = 0
    description: str = ""
    graph_level: bool = False
    default: bool = True  # enabled unless a target or the user disables it
    tags: frozenset[str] = field(default_factory=frozenset)
    plugin: str = "<unregistered>"  # distribution/plugin that provided it; set by the registry
    # Optional cheap whole-graph gate, checked once per run: a rule that cannot apply to this
    # graph (no BF16 anywhere, say) is left out of the index instead of tried on every node.
    applies: Callable[[Any], bool] | None = None

    def __call__(self, node: Any, rewriter: Any) -> bool:
        return bool(self.fn(node, rewriter))

    def __repr__(self) -> str:
        return f"Rule({self.name!r})"


def _describe(fn: Callable, description: str | None) -> str:
    text = description if description is not None else (fn.__doc__ or "")
    return " ".join(text.strip().split("\n\n")[0].split())


def rule(
    *roots: Any,
    name: str | None = None,
    priority: int = 0,
    description: str | None = None,
    default: bool = True,
    tags: Iterable[str] = (),
    applies: Callable[[Any], bool] | None = None,
) -> Callable[[NodeFn], Rule]:
    """Decorate ``fn(node, rw) -> bool`` into a :class:`Rule` rooted at ``roots``.

    With no roots the rule is tried on every node. The first paragraph of the docstring is
    the description ``fxpass rules`` prints.
    """

    def wrap(fn: NodeFn) -> Rule:
        return Rule(
            name=name or fn.__name__,
            fn=fn,
            roots=tuple(roots) if roots else None,
            priority=priority,
            description=_describe(fn, description),
            default=default,
            tags=frozenset(tags),
            applies=applies,
        )

    return wrap


def graph_rule(
    *,
    name: str | None = None,
    priority: int = 0,
    description: str | None = None,
    default: bool = True,
    tags: Iterable[str] = (),
) -> Callable[[NodeFn], Rule]:
    """Decorate ``fn(graph_module, rw) -> bool`` into a graph-level :class:`Rule`.

    Graph rules run when the node worklist is empty; if one changes the graph, the driver
    re-seeds the worklist and goes round again.
    """

    def wrap(fn: NodeFn) -> Rule:
        return Rule(
            name=name or fn.__name__,
            fn=fn,
            roots=None,
            priority=priority,
            description=_describe(fn, description),
            graph_level=True,
            default=default,
            tags=frozenset(tags),
        )

    return wrap
