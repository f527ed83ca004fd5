"""The Rewriter: the only way rules touch a graph.

It keeps every mutation of one rule application in an undo log, so a rule that raises (or
that the driver rejects) leaves the graph exactly as it was, and it tells the driver what to
revisit. New nodes get ``meta['val']`` by running the op on the inputs' fake tensors, so later
rules and the partitioner always see shapes and dtypes.

Replacing a value by one of another dtype or shape (``replace``, ``replace_input``,
``retarget(val=...)``) is refused, always, not only under check: the users keep the
``meta['val']`` they were traced with, which would go stale, and a backend running without
checks would silently return a different dtype or shape. The check is O(rank) per call.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from .graph import constant_value, erase_if_dead, fake_mode_of, is_static

_MISSING = object()


class RuleError(RuntimeError):
    """A rule raised; its Rewriter edits were rolled back. Names the rule and the node."""

    def __init__(self, rule: str, node: str, cause: BaseException):
        super().__init__(f"rule {rule!r} failed on node {node!r}: {type(cause).__name__}: {cause}")
        self.rule, self.node, self.cause = rule, node, cause


class MetaMismatchError(ValueError):
    """A replacement value's dtype or shape differs from the value it replaces."""


class MetaRuleError(RuleError, AssertionError):
    """The :class:`RuleError` for a :class:`MetaMismatchError`. Also an ``AssertionError``:
    a changed dtype or shape is a wrong result, and wrong results are what the test kit
    (``fxpass.testing.check_rule``) reports as assertion failures."""


def rule_error(rule: str, node: str, cause: Exception) -> RuleError:
    """The RuleError the driver raises for ``cause``."""
    cls = MetaRuleError if isinstance(cause, MetaMismatchError) else RuleError
    return cls(rule, node, cause)


def _same_dim(a: Any, b: Any) -> bool:
    if a is b or (type(a) is int and type(b) is int):
        return a == b
    # symbolic: refuse only what is provably different, and never add a guard to the graph
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return not statically_known_true(a != b)


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
    return f"the Python {type(v).__name__} {v!r}"


def meta_mismatch(old: Any, new: Any) -> str | None:
    """Why value ``new`` cannot stand in for ``old`` (fake tensors, tuples of them, scalars),
    or None if it can. Only dtype and shape are compared: both are O(rank). An old value that
    is not recorded (None) cannot be compared and is accepted; tuples compare element-wise."""
    if old is None:
        return None
    if isinstance(old, torch.Tensor):
        if not isinstance(new, torch.Tensor):
            return (
                f"a tensor {_describe(old)} would be replaced by {_describe(new)} (a tensor "
                "becomes a Python value; use rw.const(torch.tensor(...)) to keep a tensor)"
            )
        if old.dtype != new.dtype:
            return f"dtype {old.dtype} -> {new.dtype}"
        if len(old.shape) != len(new.shape) or not all(
            _same_dim(a, b) for a, b in zip(old.shape, new.shape, strict=True)
        ):
            return f"shape {list(old.shape)} -> {list(new.shape)}"
        return None
    if isinstance(old, (tuple, list)):
        if not isinstance(new, (tuple, list)) or len(new) != len(old):
            what = f"{len(new)} values" if isinstance(new, (tuple, list)) else _describe(new)
            return f"a tuple of {len(old)} values -> {what}"
        for i, (o, n) in enumerate(zip(old, new, strict=True)):
            why = meta_mismatch(o, n)
            if why is not None:
                return f"element {i}: {why}"
        return None
    if isinstance(new, torch.Tensor):  # a scalar (a size, say) would become a tensor
        return f"the Python {type(old).__name__} {old!r} -> a tensor {_describe(new)}"
    return None


def _meta_key(v: Any) -> Any:
    return (tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else repr(v)


class Rewriter:
    """Transactional graph editing with fake-tensor meta propagation."""

    def __init__(self, gm: GraphModule, fake_mode: Any = None):
        self.gm = gm
        self.graph = gm.graph
        self.fake_mode = fake_mode if fake_mode is not None else fake_mode_of(gm)
        self.rule_name = ""
        self.anchor: Node | None = None
        self.skips: dict[tuple[str, str, str], None] = {}  # (rule, node, reason), ordered set
        self._insert: Node | None = None
        self._created: list[Node] = []
        self._snapshots: list[tuple[Node, tuple, dict]] = []
        self._retargets: list[tuple[Node, Any, Any]] = []  # (node, old target, old val)
        self._to_erase: list[tuple[Node, bool]] = []  # (node, force)
        self._buffers: list[str] = []
        self._revisit: list[Node] = []
        self._const_id = 0
        self._traces: dict[Any, GraphModule] = {}

    # -- transaction control (used by the driver) -------------------------------------------
    def begin(self, rule_name: str, anchor: Node | None) -> None:
        self.rule_name, self.anchor, self._insert = rule_name, anchor, anchor
        self._created, self._snapshots, self._to_erase, self._revisit = [], [], [], []
        self._retargets, self._buffers = [], []

    @property
    def changed(self) -> bool:
        return bool(self._created or self._snapshots or self._to_erase or self._retargets)

    def logged(self) -> tuple[list[Node], list[Node]]:
        """(nodes created, existing nodes edited) by the pending transaction, for the driver's
        check-mode comparison with a graph fingerprint."""
        edited = [u for u, _, _ in self._snapshots]
        edited.extend(n for n, _, _ in self._retargets)
        return self._created, edited

    def rollback(self) -> None:
        """Undo the pending transaction. Idempotent: the log is cleared."""
        for node, target, val in reversed(self._retargets):
            node.target = target
            node.meta["val"] = val
        for user, args, kwargs in reversed(self._snapshots):
            user.args, user.kwargs = args, kwargs
        for n in reversed(self._created):
            if not n._erased and not n.users:
                self.graph.erase_node(n)
        for name in self._buffers:
            delattr(self.gm, name)
        self._created, self._snapshots, self._to_erase, self._revisit = [], [], [], []
        self._retargets, self._buffers = [], []

    def commit(self) -> tuple[list[Node], list[Node], list[Node]]:
        """Apply deferred erasures; return (created, erased, revisit)."""
        erased: list[Node] = []
        revisit = list(self._revisit)
        revisit.extend(u for u, _, _ in self._snapshots)
        for n, force in self._to_erase:
            if n._erased:
                continue
            producers = n.all_input_nodes
            erase_if_dead(n, erased, force=force)
            revisit.extend(producers)
        created = [n for n in self._created if not n._erased]
        revisit.extend(created)
        for node, _, _ in self._retargets:
            node.meta["fxpass_from"] = (self.rule_name, node.name)
            revisit.extend(node.users)  # users may match the node's new op
            created.append(node)  # for the ledger: this rule produced the node's current op
        self._created, self._snapshots, self._to_erase, self._revisit = [], [], [], []
        self._retargets, self._buffers = [], []
        return created, erased, revisit

    # -- queries ----------------------------------------------------------------------------
    @staticmethod
    def val(node: Any) -> Any:
        return node.meta.get("val") if isinstance(node, Node) else node

    @staticmethod
    def constant(node: Any) -> torch.Tensor | None:
        """Real tensor behind a constant or frozen-weight node, else None."""
        return constant_value(node)

    def static(self, *nodes: Any) -> bool:
        """True if all nodes have fully static shapes and strides; otherwise records a skip
        reason."""
        for n in nodes:
            if isinstance(n, Node) and not is_static(n.meta.get("val")):
                self.skip(f"symbolic shape or stride on {n.name}; rule needs static shapes")
                return False
        return True

    def skip(self, reason: str) -> bool:
        """Record why the current rule did not fire here (shown in the report). Returns False."""
        anchor = self.anchor.name if self.anchor is not None else "<graph>"
        self.skips[(self.rule_name, anchor, reason)] = None
        return False

    # -- building ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def at(self, node: Node) -> Iterator[None]:
        """Insert new nodes before ``node`` (graph rules choose their own insertion point)."""
        old, self._insert = self._insert, node
        try:
            yield
        finally:
            self._insert = old

    def infer(self, target: Any, args: tuple, kwargs: dict, override: dict | None = None) -> Any:
        """The fake ``meta["val"]`` that ``target(*args, **kwargs)`` would have (no node made).

        ``override`` maps nodes to stand-in values, to ask "what if this input were F32?"
        before creating anything.
        """
        o = override or {}
        fargs, fkwargs = map_arg((args, kwargs), lambda n: o[n] if n in o else n.meta["val"])
        if target is operator.getitem:
            return fargs[0][fargs[1]]
        with self.fake_mode:
            return target(*fargs, **fkwargs)

    def _place(self) -> Any:
        if self._insert is not None:
            return self.graph.inserting_before(self._insert)
        return self.graph.inserting_before(None)

    def call(self, target: Any, *args: Any, val: Any = _MISSING, **kwargs: Any) -> Node:
        """Create ``target(*args, **kwargs)``; ``val=`` skips fake propagation when known."""
        v = self.infer(target, args, kwargs) if val is _MISSING else val
        with self._place():
            # Created empty, then given its arguments: Graph.create_node scans non-empty args
            # with pytree for raw SymInts (our args come from traced graphs and carry none),
            # which was ~40% of the cost of a rewrite.
            n = self.graph.create_node("call_function", target)
        n.args, n.kwargs = args, kwargs
        n.meta["val"] = v
        self._stamp(n)
        return n

    def const(self, tensor: torch.Tensor, hint: str = "c") -> Node:
        """A ``get_attr`` node holding ``tensor`` (a real tensor stored on the module)."""
        while True:
            name = f"_fxpass_{hint}{self._const_id}"
            self._const_id += 1
            if not hasattr(self.gm, name):
                break
        self.gm.register_buffer(name, tensor.detach(), persistent=False)
        self._buffers.append(name)
        with self._place():
            n = self.graph.get_attr(name)
        with self.fake_mode:
            n.meta["val"] = self.fake_mode.from_tensor(tensor, static_shapes=True)
        self._stamp(n)
        return n

    def inline(
        self,
        fn: Callable,
        *args: Any,
        decomposition_table: dict | None = None,
        key: Any = None,
    ) -> Any:
        """Trace ``fn`` with make_fx on the args' fake values and splice its graph in.

        Returns the node (or tuple of nodes) that ``fn`` returned. This is how a rule reuses a
        ``torch._decomp`` decomposition instead of writing the graph by hand. ``key`` (hashable,
        covering everything ``fn`` closes over) caches the trace per input shape/dtype/stride:
        tracing costs milliseconds, and a model repeats the same attention in every layer.
        """
        from torch.fx.experimental.proxy_tensor import make_fx

        node_args = [a for a in args if isinstance(a, Node)]
        fake_args = self._distinct_fakes(node_args)
        cache_key = None
        if key is not None:
            # every argument in its place (fn(x, 2.0) is not fn(2.0, x)), a Python value with
            # its type (2, 2.0 and True are equal as keys, not as operands), and the rule and
            # function: one plugin's key="decomp" is not another's (found by a probe: abs(x)
            # came out as -x)
            fakes = iter(fake_args)
            placed = tuple(
                ("node", _meta_key(next(fakes))) if isinstance(a, Node)
                else ("value", type(a).__name__, repr(a))  # repr: -0.0 is not 0.0
                for a in args
            )
            # the function's own code, under its wrappers: torch._decomp's decompositions
            # share their decorators' code objects (found in review: hardswish became silu)
            inner = inspect.unwrap(fn)
            code = getattr(inner, "__code__", None) or inner
            cache_key = (self.rule_name, code, key, placed)
        sub = self._traces.get(cache_key) if cache_key is not None else None
        if sub is None:

            def traced(*tensors: Any) -> Any:
                it = iter(tensors)
                real = [next(it) if isinstance(a, Node) else a for a in args]
                return fn(*real)

            with self.fake_mode:
                sub = make_fx(traced, decomposition_table=decomposition_table or {})(*fake_args)
            if cache_key is not None:
                self._traces[cache_key] = sub
        env: dict[Node, Any] = {}
        phs = sub.graph.find_nodes(op="placeholder")
        env.update(zip(phs, node_args, strict=True))
        out: Any = None
        for sn in sub.graph.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "output":
                out = map_arg(sn.args[0], lambda x: env[x])
                break
            if sn.op == "get_attr":
                t = getattr(sub, str(sn.target))
                env[sn] = self.const(t, "k")
                continue
            nargs, nkwargs = map_arg((sn.args, sn.kwargs), lambda x: env[x])
            v = sn.meta.get("val", _MISSING)
            env[sn] = self.call(sn.target, *nargs, val=v, **nkwargs)
        if isinstance(out, list):
            out = tuple(out)
        return out

    def _distinct_fakes(self, nodes: list[Node]) -> list[Any]:
        """The nodes' fake values, one distinct tensor object per distinct node.

        Why: ``make_fx`` tracks tensors by identity, so two arguments that are the same fake
        object become one placeholder's value: the trace reads the last of them for both.
        Distinct nodes do share a fake object, because a cached trace splices the same
        ``meta["val"]`` into every copy (the K and V cache updates of one layer, say). A T5
        cross-attention traced that way multiplied the queries by the values instead of the
        keys. Every repeat gets a fresh fake tensor of the same shape, strides and dtype, also
        the same node passed twice: a trace of ``f(x, x)`` that used one placeholder for both
        is cached under a key that cannot tell, and ``f(b, c)`` would reuse it as ``f(c, c)``.
        """
        seen: set[int] = set()
        out = []
        for n in nodes:
            v = n.meta["val"]
            if isinstance(v, torch.Tensor) and (id(v) in seen or seen.add(id(v))):
                with self.fake_mode:
                    v = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            out.append(v)
        return out

    def _stamp(self, n: Node) -> None:
        a = self.anchor
        n.meta["fxpass_from"] = (self.rule_name, a.name if a is not None else "<graph>")
        if a is not None and "stack_trace" in a.meta:
            n.meta.setdefault("stack_trace", a.meta["stack_trace"])
        self._created.append(n)

    # -- editing ----------------------------------------------------------------------------
    def _check_meta(self, what: str, old: Node, new: Any) -> None:
        if isinstance(new, Node):
            if "val" not in new.meta:
                return  # nothing to compare (check mode reports created nodes without meta)
            nv = new.meta["val"]
        else:
            nv = new
        why = meta_mismatch(old.meta.get("val"), nv)
        if why is not None:
            label = new.name if isinstance(new, Node) else _describe(new)
            raise MetaMismatchError(
                f"{what}({old.name}, {label}) changes the value: {why}. Refused: the users of "
                f"{old.name} keep their meta['val'], which would go stale, and a backend "
                "running without checks would return a different dtype/shape. Cast or reshape "
                "the replacement to match (or rewrite the users as well)."
            )

    def replace(self, old: Node, new: Any) -> None:
        """Point every use of ``old`` at ``new`` (a node or a Python value); erase ``old``.

        ``new`` must have ``old``'s dtype and shape (see the module docstring).
        """
        self._check_meta("replace", old, new)
        for user in list(old.users):
            self._snapshots.append((user, user.args, dict(user.kwargs)))
            user.args = map_arg(user.args, lambda x: new if x is old else x)
            user.kwargs = map_arg(user.kwargs, lambda x: new if x is old else x)
        self._to_erase.append((old, True))

    def replace_input(self, user: Node, old: Node, new: Any) -> None:
        """Point one use (``user``'s input ``old``) at ``new`` (same dtype and shape)."""
        self._check_meta("replace_input", old, new)
        self._snapshots.append((user, user.args, dict(user.kwargs)))
        user.args = map_arg(user.args, lambda x: new if x is old else x)
        user.kwargs = map_arg(user.kwargs, lambda x: new if x is old else x)
        self._to_erase.append((old, False))  # other uses may remain; erased only if pure+dead

    def retarget(
        self, node: Node, target: Any, *args: Any, val: Any = _MISSING, **kwargs: Any
    ) -> None:
        """Rewrite ``node`` in place to ``target(*args, **kwargs)``, keeping its users.

        Cheaper than creating a node and replacing uses (torch.fx node creation dominates
        the cost of simple canonicalizations); ``val`` defaults to the node's current one,
        which is right when the rewrite keeps the value (an overload change, say); a ``val``
        of another dtype or shape is refused, as in :meth:`replace`.
        """
        if val is not _MISSING:
            self._check_meta("retarget", node, val)
        self._retargets.append((node, node.target, node.meta.get("val")))
        self._snapshots.append((node, node.args, dict(node.kwargs)))
        node.target = target
        node.args, node.kwargs = args, kwargs
        if val is not _MISSING:
            node.meta["val"] = val

    def erase(self, node: Node) -> None:
        """Erase ``node`` at commit (it must have no users by then, else it is kept)."""
        self._to_erase.append((node, True))

    def revisit(self, *nodes: Node) -> None:
        """Ask the driver to try the rules on ``nodes`` again."""
        self._revisit.extend(nodes)
