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
    # Targets (by name) this rule joins even when it is off by default: a plugin's way to add
    # a rule to a target another plugin owns (``@rule(..., targets=["my_device"])``).
    targets: frozenset[str] = field(default_factory=frozenset)
    # The declarative pattern the rule was built from (fxpass.pattern), if any: the test kit
    # generates graphs around it.
    pattern: Any = None

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
    targets: Iterable[str] = (),
    applies: Callable[[Any], bool] | None = None,
) -> Callable[[NodeFn], Rule]:
    """Decorate ``fn(node, rw) -> bool`` into a :class:`Rule` rooted at ``roots``.

    - ``roots``: the op overloads the rule is offered (the driver indexes rules by
      ``node.target``); with none, the rule is tried on every node (slow path).
    - ``priority``: among the rules rooted at one op, higher tries first; the first that
      fires wins that visit (ties keep registration order).
    - ``default``: on unless a target or the user disables it; ``default=False`` rules run
      only where a target (``Target.enable``/``enable_tags``, or the rule's ``targets``) or
      the user (``enable=``, ``FXPASS_ENABLE``) turns them on.
    - ``tags``: free-form labels a target can select by (``Target(enable_tags=...)``).
    - ``targets``: target names this rule joins (a plugin adding a rule to ``bpu``).
    - ``applies(gm) -> bool``: a cheap whole-graph gate, called once per run with the
      GraphModule; a rule that cannot apply is left out of the index for that run.

    The first paragraph of the docstring is the description ``fxpass rules`` prints.
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
            targets=frozenset(targets),
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
    targets: Iterable[str] = (),
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
            targets=frozenset(targets),
        )

    return wrap
