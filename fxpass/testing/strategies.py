"""Hypothesis strategies that generate small, valid aten graphs with ``meta['val']``.

Two sources: :func:`aten_graphs` chains ops from a vocabulary over values of one shape (so
every op always has operands), and :func:`traced_graphs` traces a parameterised function with
``make_fx`` (for ops with structure, such as attention). Everything is drawn, so a failing
graph shrinks to a minimal one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from torch.fx import Graph, GraphModule, Node

from ..tracing import trace  # the core's tracer (pattern_from needs it without Hypothesis)

aten, prims = torch.ops.aten, torch.ops.prims
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Op:
    """A vocabulary entry: ``build(draw, pick)`` returns ``(target, args, kwargs)`` or None.

    ``pick(float_only=True)`` draws an existing value node of the graph being built.
    """

    name: str
    build: Callable[[Any, Callable[..., Node]], tuple[Any, tuple, dict] | None]


def _unary(target: Any) -> Op:
    return Op(str(target), lambda draw, pick: (target, (pick(),), {}))


def _binary(target: Any) -> Op:
    return Op(str(target), lambda draw, pick: (target, (pick(), pick()), {}))


def _scalar(target: Any, values: Sequence[float] = (0.5, 2.0, -1.0, 3)) -> Op:
    return Op(str(target), lambda draw, pick: (target, (pick(), draw(st.sampled_from(values))), {}))


def _cast(draw: Any, pick: Callable[..., Node]) -> tuple[Any, tuple, dict]:
    x = pick()
    dt = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
    form = draw(st.sampled_from(["_to_copy", "convert", "to"]))
    if form == "_to_copy":
        return aten._to_copy.default, (x,), {"dtype": dt}
    if form == "convert":
        return prims.convert_element_type.default, (x, dt), {}
    return aten.to.dtype, (x, dt), {}


def _where(draw: Any, pick: Callable[..., Node]) -> tuple[Any, tuple, dict]:
    cond_src = pick()
    return aten.where.self, (("gt", cond_src), pick(), pick()), {}


def _masked_softmax(target: Any) -> Op:
    """softmax over a row masked with -inf where the row is large: fully masked rows happen."""

    def build(draw: Any, pick: Callable[..., Node]) -> tuple[Any, tuple, dict]:
        x = ("mask_inf", pick(), pick())
        args = (x, -1) if target is aten._safe_softmax.default else (x, -1, False)
        return target, args, {}

    return Op(str(target), build)


def _full(draw: Any, pick: Callable[..., Node]) -> tuple[Any, tuple, dict]:
    """An input-independent constant the shape of an existing value (folding fodder)."""
    like = pick()
    value = draw(st.sampled_from([0.0, 1.0, -2.5, 0.125]))
    return (
        aten.full.default,
        (list(like.meta["val"].shape), value),
        {"dtype": like.meta["val"].dtype},
    )


VOCAB: dict[str, Op] = {
    "neg": _unary(aten.neg.default),
    "relu": _unary(aten.relu.default),
    "sigmoid": _unary(aten.sigmoid.default),
    "tanh": _unary(aten.tanh.default),
    "abs": _unary(aten.abs.default),
    "add": _binary(aten.add.Tensor),
    "sub": _binary(aten.sub.Tensor),
    "mul": _binary(aten.mul.Tensor),
    "maximum": _binary(aten.maximum.default),
    "add_scalar": _scalar(aten.add.Tensor),
    "mul_scalar": _scalar(aten.mul.Tensor),
    "mul.Scalar": _scalar(aten.mul.Scalar),
    "add.Scalar": _scalar(aten.add.Scalar),
    "sub.Scalar": _scalar(aten.sub.Scalar),
    "div.Scalar": _scalar(aten.div.Scalar, (2.0, -4.0, 0.5)),
    "pow": _scalar(aten.pow.Tensor_Scalar, (2, 3, 0.5)),
    "alias": _unary(aten.alias.default),
    "clone": _unary(aten.clone.default),
    "detach": _unary(aten.detach.default),
    "cast": Op("cast", _cast),
    "full": Op("full", _full),
    "where": Op("where", _where),
    "softmax": _masked_softmax(aten._softmax.default),
    "safe_softmax": _masked_softmax(aten._safe_softmax.default),
}
DEFAULT_OPS = ("neg", "relu", "add", "mul", "add_scalar", "mul_scalar", "sigmoid", "cast")


class _Builder:
    """One graph being drawn: a pool of values of one shape, ops appended from a vocabulary."""

    def __init__(self, draw: Any, dtypes: Sequence[torch.dtype], max_inputs: int, max_rank: int):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.draw, self.mode, self.g = draw, FakeTensorMode(), Graph()
        rank = draw(st.integers(1, max_rank))
        self.shape = tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
        self.pool: list[Node] = []
        self.outputs: list[Node] = []  # extra graph outputs: fan-out of intermediate values
        for _ in range(draw(st.integers(1, max_inputs))):
            self.placeholder(draw(st.sampled_from(list(dtypes))))

    def placeholder(self, dt: torch.dtype) -> Node:
        p = self.g.placeholder(f"x{len(self.g.find_nodes(op='placeholder'))}")
        with self.mode:
            p.meta["val"] = torch.empty(self.shape, dtype=dt)
        self.pool.append(p)
        return p

    def pick(self, float_only: bool = True) -> Node:
        pool = self.pool
        cands = [n for n in pool if n.meta["val"].dtype.is_floating_point] if float_only else pool
        return self.draw(st.sampled_from(cands or pool))

    def emit(self, target: Any, args: tuple, kwargs: dict) -> Node:
        from torch.fx.node import map_arg

        fargs, fkwargs = map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.mode:
            val = target(*fargs, **fkwargs)
        n = self.g.call_function(target, args, kwargs)
        n.meta["val"] = val
        return n

    def expand(self, a: Any) -> Any:
        # ("gt", x) -> x > 0 ; ("mask_inf", x, y) -> masked_fill(x, y > 0.3, -inf)
        if isinstance(a, tuple) and a and a[0] == "gt":
            return self.emit(aten.gt.Scalar, (a[1], 0.0), {})
        if isinstance(a, tuple) and a and a[0] == "mask_inf":
            m = self.emit(aten.gt.Scalar, (a[2], 0.3), {})
            return self.emit(aten.masked_fill.Scalar, (a[1], m, -math.inf), {})
        return a

    def random_ops(self, vocab: list[Op], count: int) -> None:
        for _ in range(count):
            built = self.draw(st.sampled_from(vocab)).build(self.draw, self.pick)
            if built is None:
                continue
            target, args, kwargs = built
            try:
                n = self.emit(target, tuple(self.expand(a) for a in args), kwargs)
            except Exception:  # noqa: BLE001 - operands of two shapes (after a pattern that
                continue  # changes shape, a slice say): that op is not drawn
            self.pool.append(n)
            self.maybe_fan_out(n)

    def maybe_fan_out(self, n: Node) -> None:
        """Often give ``n`` a second user (a graph output): rules that edit an inner value in
        place, or drop it, are wrong exactly there."""
        if self.draw(st.integers(0, 3)) == 0:
            self.outputs.append(n)

    def finish(self, extra: str = "") -> GraphModule:
        outs = [n for n in self.pool if not n.users and n.op != "placeholder"] or self.pool[-1:]
        outs += [n for n in self.outputs if n not in outs]
        self.g.output(tuple(outs))
        return _shown(GraphModule(torch.nn.Module(), self.g), extra)


@st.composite
def aten_graphs(
    draw: Any,
    ops: Sequence[str | Op] = DEFAULT_OPS,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    max_ops: int = 8,
    max_inputs: int = 3,
    max_rank: int = 3,
) -> GraphModule:
    """A GraphModule of 1..max_ops vocabulary ops over same-shaped inputs, with meta['val'].

    Operands are drawn from every value made so far, and intermediate values are often also
    graph outputs, so shared subexpressions (fan-out) are common.
    """
    vocab = [VOCAB[o] if isinstance(o, str) else o for o in ops]
    b = _Builder(draw, dtypes, max_inputs, max_rank)
    b.random_ops(vocab, draw(st.integers(1, max_ops)))
    return b.finish()


#: Python numbers a ``Num`` leaf of a pattern is instantiated with.
PATTERN_NUMBERS = (0.5, 2.0, -1.5, 3, 0.0)


@st.composite
def pattern_graphs(
    draw: Any,
    pattern: Any,
    ops: Sequence[str | Op] = DEFAULT_OPS,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    max_ops: int = 4,
    max_inputs: int = 3,
    max_rank: int = 3,
) -> GraphModule:
    """Graphs built around an instance of ``pattern`` (an :class:`fxpass.pattern.P` tree).

    Random vocabulary ops come before and after it; its leaves are drawn from the values made
    so far (so they are inputs or intermediates); its inner nodes often get a second user, and
    the same value often feeds two leaves. ``Var(dtype=...)`` leaves get a value of that
    dtype; ``Num`` leaves a number from :data:`PATTERN_NUMBERS`. A pattern whose instance does
    not type-check (fake propagation raises) is rejected, not failed.
    """
    from hypothesis import reject

    from ..pattern import ANY, Multi, Num, Or, P, Var

    vocab = [VOCAB[o] if isinstance(o, str) else o for o in ops]
    b = _Builder(draw, dtypes, max_inputs, max_rank)
    b.random_ops(vocab, draw(st.integers(0, max_ops)))
    bound: dict[str, Any] = {}
    # a quarter of the graphs keep the pattern's inner values private: with fan-out drawn per
    # inner node, a deep pattern (an RMSNorm has four inner ops) would seldom match whole
    shared_inner = draw(st.integers(0, 3)) > 0

    def leaf(v: Var) -> Node:
        if v.dtype is None:
            return b.pick()
        want = v.dtype if isinstance(v.dtype, tuple) else (v.dtype,)
        dt = draw(st.sampled_from(list(want)))
        cands = [n for n in b.pool if n.meta["val"].dtype == dt]
        return draw(st.sampled_from(cands)) if cands else b.placeholder(dt)

    def make(p: Any, inner: bool, where: tuple[str, Any] | None = None) -> Any:
        # ``where`` is (argument name, schema type) of the position ``p`` fills, when known
        if isinstance(p, Or):  # one alternative per graph: each is generated in turn
            p = draw(st.sampled_from(list(p.alternatives)))
        if isinstance(p, (Var, Num)):
            if p.name not in bound:
                if isinstance(p, Num):
                    bound[p.name] = draw(st.sampled_from(PATTERN_NUMBERS))
                elif where is not None and not _is_tensor_type(where[1]):
                    bound[p.name] = draw(_values_of(p, *where))
                else:
                    bound[p.name] = leaf(p)
            return bound[p.name]
        if p is ANY:
            return b.pick()
        if isinstance(p, (list, tuple)):
            elem = None
            if where is not None:
                typ = _unwrap_optional(where[1])
                if isinstance(typ, torch.ListType):
                    elem = (where[0], typ.getElementType())
            return type(p)(make(x, inner, elem) for x in p)
        if not isinstance(p, P):
            return p
        target = draw(st.sampled_from(list(p.targets)))
        schema = getattr(target, "_schema", None)
        positional = [a for a in schema.arguments if not a.kwarg_only] if schema else []
        by_name = {a.name: a for a in schema.arguments} if schema else {}

        def slot(a: Any) -> tuple[str, Any] | None:
            return (a.name, a.real_type) if a is not None else None

        args = tuple(
            make(a, True, slot(positional[i] if i < len(positional) else None))
            for i, a in enumerate(p.args)
        )
        kwargs = {k: make(v, True, slot(by_name.get(k))) for k, v in p.kwargs.items()}
        try:
            n = b.emit(target, args, kwargs)
        except Exception as e:
            _REJECTED[repr(pattern)] = f"{target}: {type(e).__name__}: {e}"
            reject()
        if not inner or shared_inner:
            b.pool.append(n)
        if inner and shared_inner:
            b.maybe_fan_out(n)
        return n

    for root in pattern.roots if isinstance(pattern, Multi) else (pattern,):
        make(root, False)  # a Multi's roots share their bindings: one Var, one value
    b.random_ops(vocab, draw(st.integers(0, max_ops)))
    return b.finish(f"around {pattern!r}")


#: The last reason an instance of a pattern failed to type-check, by ``repr(pattern)``: what
#: ``check_rule`` reports when every instance is rejected (Hypothesis' ``Unsatisfiable``).
_REJECTED: dict[str, str] = {}

#: Values a non-tensor ``Var`` is drawn from, by the schema type of the argument it fills:
#: ints that are valid dims of any rank (-1, 0), floats that look like what sits there (an
#: eps, a scale), both booleans. A pattern whose instance does not type-check is rejected.
_DRAWN: dict[str, tuple[Any, ...]] = {
    "int": (-1, 0),
    "SymInt": (-1, 0),
    "float": (1e-6, 1e-5, 0.5, 2.0),
    "Scalar": PATTERN_NUMBERS,
    "bool": (False, True),
}


def _unwrap_optional(typ: Any) -> Any:
    return typ.getElementType() if isinstance(typ, torch.OptionalType) else typ


def _is_tensor_type(typ: Any) -> bool:
    typ = _unwrap_optional(typ)
    return (
        typ is None
        or isinstance(typ, torch.TensorType)
        or (isinstance(typ, torch.ListType) and _is_tensor_type(typ.getElementType()))
    )


def _values_of(var: Any, argname: str, typ: Any) -> st.SearchStrategy:
    """Values for a non-tensor ``Var`` at argument ``argname`` of schema type ``typ``."""
    typ = _unwrap_optional(typ)
    if isinstance(typ, torch.ListType):
        inner = _values_of(var, argname, typ.getElementType())
        return st.lists(inner, min_size=1, max_size=1)
    values = _DRAWN.get(str(typ))
    if values is None:
        raise TypeError(
            f"check_rule cannot draw {var!r}: it fills argument {argname!r} of type {typ}, "
            "which is not a tensor, int, float, Scalar or bool. Write that argument's value "
            "into the pattern (or use ANY), or pass graphs= with a strategy that builds it"
        )
    return st.sampled_from(values)


def _shown(gm: GraphModule, extra: str = "") -> GraphModule:
    """Make Hypothesis print the generated graph (as first drawn) when it reports a failure."""
    src = gm.graph.python_code("self").src.strip()
    shapes = [
        f"{p.name}: {p.meta['val'].dtype}{tuple(p.meta['val'].shape)}"
        for p in gm.graph.find_nodes(op="placeholder")
    ]
    text = f"<generated graph {extra} inputs [{', '.join(shapes)}]:\n{src}\n>"
    type(gm).__repr__ = lambda self: text  # GraphModule instances each have their own class
    return gm


@dataclass(frozen=True)
class T:
    """A tensor input spec for :func:`traced_graphs`."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32


@st.composite
def traced_graphs(draw: Any, fn: Callable[..., Any], inputs: st.SearchStrategy) -> GraphModule:
    """Trace ``fn(*tensors, **params)`` with :func:`trace` on fake tensors.

    ``inputs`` draws ``(specs, params)``: a list of :class:`T` and a dict of non-tensor
    parameters (closed over, so they become constants of the graph).
    """
    specs, params = draw(inputs)
    examples = [torch.empty(s.shape, dtype=s.dtype) for s in specs]
    gm = trace(lambda *xs: fn(*xs, **params), *examples)
    return _shown(gm, f"params={params!r}")
