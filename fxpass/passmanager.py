"""The fixpoint driver: a worklist of nodes, rules indexed by target, a rewrite budget.

Modelled on MLIR's greedy pattern driver. Every node starts on the worklist in topological
order; a node is offered to the rules rooted at its target (highest priority first); when one
fires, the nodes it created, the users of replaced values and the producers of erased nodes go
back on the worklist. When the worklist drains, graph-level rules run; if any changes the graph
the worklist is re-seeded. Exceeding the budget raises :class:`FixpointError` with the rules
that kept firing and the cycle between them. ``recompile()`` runs once, at the end.

Every rule application is a transaction: whatever way it ends (an exception, a
``KeyboardInterrupt``, a contract violation, the rewrite limit), the Rewriter's log is rolled
back before the driver leaves it. Exceptions are wrapped in :class:`RuleError` (naming the rule
and the node); other ``BaseException`` s propagate unchanged. The same holds for the rules
re-run by the check-mode fixpoint check.

Check mode (``check=True`` / ``FXPASS_CHECK=1``) also fingerprints the graph around every
application (:func:`fxpass.graph.fingerprint`): a change the Rewriter did not log is a rule
editing the FX graph directly, which no rollback can undo, and is a :class:`ContractError`
naming the rule, whether the rule then returned or raised. That costs ~0.15 us per node per
application (one fingerprint per application: an unchanged graph's is reused), so check mode
is quadratic in graph size: fine for tests and models of a few thousand nodes, which is what
it is for; production runs leave it off.
Outside check mode every check is O(1) per rewrite. Environment variables are read through
:mod:`fxpass.env` (``FXPASS_CHECK``, ``FXPASS_REWRITE_LIMIT``).
"""

from __future__ import annotations

import gc
import threading
import time
import warnings
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

from torch.fx import GraphModule, Node

from . import env
from .graph import fingerprint, fingerprint_diff, is_pure, require_meta
from .report import LedgerEntry, Report
from .rewriter import Rewriter, rule_error
from .rule import Rule


class FixpointError(RuntimeError):
    """The rules did not converge within the rewrite budget. The graph is left valid."""

    def __init__(self, message: str, rules: list[str], cycle: list[str], nodes: list[str]):
        super().__init__(message)
        self.rules, self.cycle, self.nodes = rules, cycle, nodes


class ContractError(RuntimeError):
    """A rule broke the rule contract (lied about changing the graph, is not idempotent, or
    edited the graph without the Rewriter)."""


class PartialRewriteWarning(UserWarning):
    """A run stopped at the rewrite limit with rewrites pending: the graph is not a fixpoint."""


_gc_lock = threading.Lock()
_gc_runs = 0  # runs in progress (any thread); the collector is paused while > 0
_gc_was_enabled = True


def _where(n: Node | None) -> str:
    return n.name if n is not None else "<graph>"


class PassManager:
    """Run ``rules`` over an aten GraphModule until nothing fires.

    ``check`` (default: env ``FXPASS_CHECK``) turns on the contract checks; ``budget_factor``
    scales the rewrite budget (``budget_factor * nodes + 64``); ``rewrite_limit`` (default: env
    ``FXPASS_REWRITE_LIMIT``; an integer >= 0, ``None`` for no limit) stops after that many
    rewrites, for bisecting a bad rewrite: ``0`` applies none. A run that stops with a rewrite
    pending reports ``stopped_at_limit`` and warns (:class:`PartialRewriteWarning`); a run
    that converges within the limit is a fixpoint and does neither.
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
        self.check = env.get("FXPASS_CHECK") if check is None else bool(check)
        self.budget_factor = budget_factor
        if rewrite_limit is None:
            rewrite_limit = env.get("FXPASS_REWRITE_LIMIT")
        elif isinstance(rewrite_limit, bool) or not isinstance(rewrite_limit, int):
            raise TypeError(f"rewrite_limit must be an int >= 0 or None, got {rewrite_limit!r}")
        elif rewrite_limit < 0:
            raise ValueError(
                f"rewrite_limit must be >= 0 (0: no rewrites) or None (no limit), "
                f"got {rewrite_limit}"
            )
        self.rewrite_limit: int | None = rewrite_limit
        self.keep_ledger = ledger

    # ---------------------------------------------------------------------------------------
    def run(self, gm: GraphModule, *, recompile: bool = True) -> Report:
        """Rewrite ``gm`` in place to fixpoint. ``recompile=False`` leaves codegen to the caller
        (it costs more than the rewriting on big graphs, and a backend may rewrite further).

        All per-run state lives in a run object, so one PassManager can be reused, and used
        from several threads at once on different graphs.

        The cyclic garbage collector is paused for the run: FX graphs are large webs of
        objects, and full collections over them made the driver quadratic in graph size.
        ``gc.disable()`` is process-wide: other threads run without cyclic collection while a
        run is in progress (reference counting still frees everything acyclic), and the
        collector is re-enabled when the last concurrent run ends, if it was enabled before.
        """
        global _gc_runs, _gc_was_enabled
        with _gc_lock:
            if _gc_runs == 0:
                _gc_was_enabled = gc.isenabled()
                gc.disable()
            _gc_runs += 1
        try:
            return _Run(self, gm).execute(recompile)
        finally:
            with _gc_lock:
                _gc_runs -= 1
                if _gc_runs == 0 and _gc_was_enabled:
                    gc.enable()


class _Run:
    """One run of a PassManager over one graph: the worklist driver and its state."""

    def __init__(self, pm: PassManager, gm: GraphModule):
        self.rules, self.check, self.rewrite_limit = pm.rules, pm.check, pm.rewrite_limit
        self.keep_ledger, self.budget_factor, self.gm = pm.keep_ledger, pm.budget_factor, gm

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

    def execute(self, recompile: bool) -> Report:
        gm = self.gm
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
        self._fp: tuple | None = None  # check mode: fingerprint of the graph as it is now

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
        self._fp = None
        if self.check:
            graph.lint()
            if not self._limit_hit:  # a bisection stop is not a fixpoint by design
                self._check_fixpoint(gm)
        if self._limit_hit:
            last = report.ledger[-1] if report.ledger else None
            warnings.warn(
                f"fxpass stopped at the rewrite limit ({self.rewrite_limit}, from "
                f"rewrite_limit= or FXPASS_REWRITE_LIMIT) with rewrites still pending: the "
                f"graph is only partially rewritten, not a fixpoint"
                + (f"; last rewrite: {last.rule} at {last.anchor}" if last else ""),
                PartialRewriteWarning,
                stacklevel=3,
            )
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
        rw, report, check = self._rw, self._report, self.check
        rw.begin(r.name, n)
        before = None
        if check:
            before = self._fp if self._fp is not None else fingerprint(rw.gm)
        t0 = time.perf_counter()
        try:
            fired = self._call(r, n, before)
        finally:
            report.seconds[r.name] = report.seconds.get(r.name, 0.0) + time.perf_counter() - t0
        try:
            if check:
                self._check_contract(r, n, fired, before)
            if not fired or not rw.changed:
                if rw.changed:
                    rw.rollback()
                self._fp = before  # unchanged (verified in check mode)
                return None
            if self.rewrite_limit is not None and self._done >= self.rewrite_limit:
                rw.rollback()  # checked before applying: the limit is exact, 0 means none
                self._fp = before
                self._limit_hit = True
                return None
            if check:
                self._lint_local(rw)
        except BaseException:
            rw.rollback()  # every exit path leaves the graph as the rule found it
            raise
        self._fp = None
        created, erased, revisit = rw.commit()
        report.rewrites[r.name] = report.rewrites.get(r.name, 0) + 1
        if self.keep_ledger:
            report.ledger.append(
                LedgerEntry(r.name, _where(n), [e.name for e in erased], [c.name for c in created])
            )
        self._done += 1
        if self._done > self._budget:
            self._fail()
        if n is not None and not n._erased:
            revisit.append(n)
        return revisit

    def _call(self, r: Rule, n: Node | None, before: tuple | None) -> bool:
        """Run the rule. If it raises, roll back, then: a ``BaseException`` that is not an
        ``Exception`` (KeyboardInterrupt, SystemExit) propagates unchanged; in check mode a
        graph that still differs from ``before`` is a :class:`ContractError` (the rule edited
        it directly, and that cannot be undone); otherwise :class:`RuleError`."""
        rw = self._rw
        try:
            return bool(r.fn(rw.gm if n is None else n, rw))
        except BaseException as e:
            rw.rollback()
            if not isinstance(e, Exception):
                raise
            if before is not None:
                what = fingerprint_diff(before, fingerprint(rw.gm))
                if what is not None:
                    raise ContractError(
                        f"rule {r.name!r} edited the graph directly, bypassing the Rewriter, "
                        f"and then raised {type(e).__name__}: {e} (node {_where(n)}). Its "
                        f"Rewriter edits were undone but the direct ones cannot be: the graph "
                        f"is left modified ({what}). Edit only through rw.* so a failing rule "
                        f"can be undone."
                    ) from e
            raise rule_error(r.name, _where(n), e) from e

    def _check_contract(self, r: Rule, n: Node | None, fired: bool, before: tuple) -> None:
        """Check mode, after the rule returned: every change must be in the Rewriter's log,
        and the return value must say whether it changed the graph."""
        rw = self._rw
        after = fingerprint(rw.gm)
        if after != before:
            what = fingerprint_diff(before, after, *rw.logged())
            if what is not None:
                rw.rollback()
                raise ContractError(
                    f"rule {r.name!r} edited the graph directly, bypassing the Rewriter "
                    f"(node {_where(n)}: {what}). Its Rewriter edits were undone but the direct "
                    f"ones cannot be: the graph is left modified. Edit only through rw.*: the "
                    f"driver must be able to undo a rule and to know what to revisit."
                )
        if fired != rw.changed:
            rw.rollback()
            what = "returned True but changed nothing" if fired else "changed the graph but "
            what += "" if fired else "returned False"
            raise ContractError(f"rule {r.name!r} {what} (node {_where(n)})")

    @staticmethod
    def _lint_local(rw: Rewriter) -> None:
        """New and retargeted nodes have meta and only use what is defined before them.
        Runs before commit, so a failure is rolled back like any other."""
        for c in [*rw._created, *(e for e, _, _ in rw._retargets)]:
            if "val" not in c.meta:
                raise ContractError(
                    f"rule {rw.rule_name!r}: node {c.name} created without meta['val']"
                )
            for i in c.all_input_nodes:
                if i._erased or not i._sort_key < c._sort_key:
                    raise ContractError(
                        f"rule {rw.rule_name!r}: node {c.name} uses {i.name} before it is defined"
                    )

    def _check_fixpoint(self, gm: GraphModule) -> None:
        """Confirm no rule fires on the result; a rule that does is not idempotent."""
        for n in list(gm.graph.nodes):
            if n.op != "call_function":
                continue
            for r in self._index.get(id(n.target), self._any):
                if self._probe(r, n):
                    raise ContractError(
                        f"rule {r.name!r} fires again at the fixpoint on node {n.name} "
                        f"({n.target}): it is not idempotent, or another rule undoes it"
                    )
        for r in self._graph_rules:
            if self._probe(r, None):
                raise ContractError(f"graph rule {r.name!r} fires again at the fixpoint")

    def _probe(self, r: Rule, n: Node | None) -> bool:
        """Run a rule and always roll it back: whether it would fire and change the graph.
        Raising, and direct edits, are reported as in the main loop."""
        rw = self._rw
        rw.begin(r.name, n)
        before = self._fp if self._fp is not None else fingerprint(rw.gm)
        self._fp = before
        try:
            fired = self._call(r, n, before)
            changed = rw.changed
        finally:
            rw.rollback()
        after = fingerprint(rw.gm)
        what = fingerprint_diff(before, after) if after != before else None
        if what is not None:
            raise ContractError(
                f"rule {r.name!r} edited the graph directly, bypassing the Rewriter, during the "
                f"fixpoint check (node {_where(n)}: {what}); the graph is left modified. Edit "
                f"only through rw.*."
            )
        return fired and changed

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
