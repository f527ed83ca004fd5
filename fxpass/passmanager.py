"""The fixpoint driver: a worklist of nodes, rules indexed by target, a rewrite budget.

Modelled on MLIR's greedy pattern driver. Every node starts on the worklist in topological
order; a node is offered to the rules rooted at its target (highest priority first); when one
fires, the nodes it created, the users of replaced values and the producers of erased nodes go
back on the worklist. When the worklist drains, graph-level rules run; if any changes the graph
the worklist is re-seeded. Exceeding the budget raises :class:`FixpointError` with the rules
that kept firing and the cycle between them. ``recompile()`` runs once, at the end.
"""

from __future__ import annotations

import gc
import os
import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

from torch.fx import GraphModule, Node

from .graph import is_pure, require_meta
from .report import LedgerEntry, Report
from .rewriter import Rewriter, RuleError
from .rule import Rule


class FixpointError(RuntimeError):
    """The rules did not converge within the rewrite budget. The graph is left valid."""

    def __init__(self, message: str, rules: list[str], cycle: list[str], nodes: list[str]):
        super().__init__(message)
        self.rules, self.cycle, self.nodes = rules, cycle, nodes


class ContractError(RuntimeError):
    """A rule broke the rule contract (lied about changing the graph, or is not idempotent)."""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class PassManager:
    """Run ``rules`` over an aten GraphModule until nothing fires.

    ``check`` (default: env ``FXPASS_CHECK``) turns on the contract checks; ``budget_factor``
    scales the rewrite budget (``budget_factor * nodes + 64``); ``rewrite_limit`` (default: env
    ``FXPASS_REWRITE_LIMIT``) stops after that many rewrites, for bisecting a bad rewrite.
    """

    def __init__(
        self,
        rules: Iterable[Rule],
        *,
        check: bool | None = None,
        budget_factor: int = 8,
        rewrite_limit: int | None = None,
        ledger: bool = True,
    ):
        self.rules = list(rules)
        names = Counter(r.name for r in self.rules)
        dup = [n for n, c in names.items() if c > 1]
        if dup:
            raise ValueError(f"rule names must be unique in one PassManager; repeated: {dup}")
        self.check = _env_flag("FXPASS_CHECK") if check is None else check
        self.budget_factor = budget_factor
        env_limit = os.environ.get("FXPASS_REWRITE_LIMIT")
        self.rewrite_limit = (
            rewrite_limit if rewrite_limit is not None else (int(env_limit) if env_limit else None)
        )
        self.keep_ledger = ledger
        self._build_index(self.rules)

    def _build_index(self, rules: list[Rule]) -> None:
        order = sorted(rules, key=lambda r: -r.priority)  # stable: ties keep list order
        self._any = [r for r in order if not r.graph_level and r.roots is None]
        self._graph_rules = [r for r in order if r.graph_level]
        self._index: dict[Any, list[Rule]] = {}
        for r in order:
            if not r.graph_level and r.roots is not None:
                for t in r.roots:
                    self._index.setdefault(id(t), []).append(r)
        for t, lst in self._index.items():
            self._index[t] = sorted(lst + self._any, key=lambda r: -r.priority)

    # ---------------------------------------------------------------------------------------
    def run(self, gm: GraphModule, *, recompile: bool = True) -> Report:
        """Rewrite ``gm`` in place to fixpoint. ``recompile=False`` leaves codegen to the caller
        (it costs more than the rewriting on big graphs, and a backend may rewrite further).

        The cyclic garbage collector is paused for the run: FX graphs are large webs of
        objects, and full collections over them made the driver quadratic in graph size.
        """
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(gm, recompile)
        finally:
            if was_enabled:
                gc.enable()

    def _run(self, gm: GraphModule, recompile: bool) -> Report:
        require_meta(gm)
        gates: dict[Any, bool] = {}  # rules often share one gate (the BF16 pair does)
        for r in self.rules:
            if r.applies is not None and r.applies not in gates:
                gates[r.applies] = bool(r.applies(gm))
        self._build_index([r for r in self.rules if r.applies is None or gates[r.applies]])
        t_start = time.perf_counter()
        graph = gm.graph
        rw = Rewriter(gm)
        report = Report(nodes_before=len(graph.nodes))
        self._report, self._rw = report, rw
        budget = self.budget_factor * len(graph.nodes) + 64
        self._budget, self._done = budget, 0
        self._limit_hit = False
        index, any_rules = self._index, self._any
        _dce(graph)  # rules should not have to reason about dead users

        rounds = 0
        while True:
            rounds += 1
            work = deque(graph.nodes)
            queued = set(work)
            while work and not self._limit_hit:
                n = work.popleft()
                queued.discard(n)
                if n._erased or n.op != "call_function":
                    continue
                for r in index.get(id(n.target), any_rules):  # id: OpOverload hashing is slow
                    revisit = self._apply(r, n)
                    if revisit is not None:
                        for m in revisit:
                            if m not in queued and not m._erased:
                                queued.add(m)
                                work.append(m)
                        break
            changed = False
            for r in self._graph_rules:
                if self._limit_hit:
                    break
                if self._apply(r, None) is not None:
                    changed = True
            if not changed or self._limit_hit:
                break

        _dce(graph)
        if self.check:
            graph.lint()
            if not self._limit_hit:  # a bisection stop is not a fixpoint by design
                self._check_fixpoint(gm)
        if recompile:
            gm.recompile()
        report.rounds = rounds
        report.stopped_at_limit = self._limit_hit
        report.nodes_after = len(graph.nodes)
        report.skips = list(rw.skips)
        report.total_seconds = time.perf_counter() - t_start
        return report

    # ---------------------------------------------------------------------------------------
    def _apply(self, r: Rule, n: Node | None) -> list[Node] | None:
        """Try one rule; returns the nodes to revisit if it fired, else None."""
        rw, report = self._rw, self._report
        rw.begin(r.name, n)
        target = rw.gm if n is None else n
        if self.check:
            before = self._local_state(rw.gm, n)
        t0 = time.perf_counter()
        try:
            fired = r.fn(target, rw)
        except Exception as e:  # transactional: undo whatever the rule did
            rw.rollback()
            raise RuleError(r.name, n.name if n is not None else "<graph>", e) from e
        finally:
            report.seconds[r.name] = report.seconds.get(r.name, 0.0) + time.perf_counter() - t0
        if self.check:
            touched = rw.changed or self._local_state(rw.gm, n) != before
            if bool(fired) != touched:
                rw.rollback()
                what = (
                    "returned True but changed nothing"
                    if fired
                    else ("changed the graph but returned False")
                )
                raise ContractError(f"rule {r.name!r} {what} (node {getattr(n, 'name', n)})")
        if not fired or not rw.changed:
            if rw.changed:
                rw.rollback()
            return None
        created, erased, revisit = rw.commit()
        report.rewrites[r.name] = report.rewrites.get(r.name, 0) + 1
        if self.keep_ledger:
            report.ledger.append(
                LedgerEntry(
                    r.name,
                    n.name if n is not None else "<graph>",
                    [e.name for e in erased],
                    [c.name for c in created],
                )
            )
        if self.check:
            self._lint_local(created)
        self._done += 1
        if self.rewrite_limit is not None and self._done >= self.rewrite_limit:
            self._limit_hit = True
        if self._done > self._budget:
            self._fail()
        if n is not None and not n._erased:
            revisit.append(n)
        return revisit

    @staticmethod
    def _local_state(gm: GraphModule, n: Node | None) -> Any:
        g = gm.graph
        if n is None:
            return (len(g.nodes),)
        return (len(g.nodes), n._erased, n.args, tuple(n.kwargs.items()), len(n.users))

    @staticmethod
    def _lint_local(created: list[Node]) -> None:
        for c in created:
            if "val" not in c.meta:
                raise ContractError(f"node {c.name} created without meta['val']")
            for i in c.all_input_nodes:
                if i._erased or not i._sort_key < c._sort_key:
                    raise ContractError(f"node {c.name} uses {i.name} before it is defined")

    def _check_fixpoint(self, gm: GraphModule) -> None:
        """Confirm no rule fires on the result; a rule that does is not idempotent."""
        rw = self._rw
        for n in list(gm.graph.nodes):
            if n.op != "call_function":
                continue
            for r in self._index.get(id(n.target), self._any):
                rw.begin(r.name, n)
                fired = r.fn(n, rw)
                changed = rw.changed
                rw.rollback()
                if fired and changed:
                    raise ContractError(
                        f"rule {r.name!r} fires again at the fixpoint on node {n.name} "
                        f"({n.target}): it is not idempotent, or another rule undoes it"
                    )
        for r in self._graph_rules:
            rw.begin(r.name, None)
            fired = r.fn(gm, rw)
            changed = rw.changed
            rw.rollback()
            if fired and changed:
                raise ContractError(f"graph rule {r.name!r} fires again at the fixpoint")

    def _fail(self) -> None:
        ledger = self._report.ledger
        window = ledger[-min(len(ledger), 256) :]
        counts = Counter(e.rule for e in window) or Counter(self._report.rewrites)
        creator: dict[str, str] = {}
        edges: dict[str, dict[str, str]] = {}
        for e in window:
            src = creator.get(e.anchor)
            if src is not None:
                edges.setdefault(src, {}).setdefault(e.rule, e.anchor)
            for c in e.created:
                creator[c] = e.rule
        cycle, nodes = _find_cycle(edges)
        self._rw.gm.recompile()
        msg = (
            f"no fixpoint after {self._done} rewrites (budget {self._budget}); "
            f"rules still firing: {dict(counts.most_common())}"
        )
        if cycle:
            msg += f"; cycle: {' -> '.join(cycle)} (nodes {', '.join(nodes)})"
        elif not ledger:
            msg += " (run with ledger=True to find the cycle)"
        msg += ". Make each rule's output something no rule in the set rewrites back."
        raise FixpointError(msg, sorted(counts), cycle, nodes)


def _dce(graph: Any) -> None:
    for n in reversed(graph.nodes):
        if not n.users and is_pure(n):
            graph.erase_node(n)


def _find_cycle(edges: dict[str, dict[str, str]]) -> tuple[list[str], list[str]]:
    """A cycle in the rule -> rule 'rewrote the output of' graph (DFS with colours), with one
    example node per edge."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in edges.get(u, {}):
            if state.get(v) == 1:
                return stack[stack.index(v) :] + [v]
            if v not in state:
                found = dfs(v)
                if found:
                    return found
        state[u] = 2
        stack.pop()
        return None

    for start in list(edges):
        if start not in state:
            cyc = dfs(start)
            if cyc:
                return cyc, [edges[a][b] for a, b in zip(cyc, cyc[1:], strict=False)]
    return [], []
