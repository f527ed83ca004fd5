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


def _fake(target: Any, args: tuple, kwargs: dict, mode: Any) -> Any:
    from torch.fx.node import map_arg

    fargs, fkwargs = map_arg((args, kwargs), lambda n: n.meta["val"])
    with mode:
        return target(*fargs, **fkwargs)


@st.composite
def aten_graphs(
    draw: Any,
    ops: Sequence[str | Op] = DEFAULT_OPS,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    max_ops: int = 8,
    max_inputs: int = 3,
    max_rank: int = 3,
) -> GraphModule:
    """A GraphModule of 1..max_ops vocabulary ops over same-shaped inputs, with meta['val']."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    vocab = [VOCAB[o] if isinstance(o, str) else o for o in ops]
    mode = FakeTensorMode()
    rank = draw(st.integers(1, max_rank))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    g = Graph()
    pool: list[Node] = []
    for i in range(draw(st.integers(1, max_inputs))):
        dt = draw(st.sampled_from(list(dtypes)))
        p = g.placeholder(f"x{i}")
        with mode:
            p.meta["val"] = torch.empty(shape, dtype=dt)
        pool.append(p)

    def pick(float_only: bool = True) -> Node:
        cands = [n for n in pool if n.meta["val"].dtype.is_floating_point] if float_only else pool
        return draw(st.sampled_from(cands or pool))

    def emit(target: Any, args: tuple, kwargs: dict) -> Node:
        n = g.call_function(target, args, kwargs)
        n.meta["val"] = _fake(target, args, kwargs, mode)
        return n

    def expand(a: Any) -> Any:
        # ("gt", x) -> x > 0 ; ("mask_inf", x, y) -> masked_fill(x, y > 0.3, -inf)
        if isinstance(a, tuple) and a and a[0] == "gt":
            return emit(aten.gt.Scalar, (a[1], 0.0), {})
        if isinstance(a, tuple) and a and a[0] == "mask_inf":
            m = emit(aten.gt.Scalar, (a[2], 0.3), {})
            return emit(aten.masked_fill.Scalar, (a[1], m, -math.inf), {})
        return a

    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(vocab))
        built = op.build(draw, pick)
        if built is None:
            continue
        target, args, kwargs = built
        args = tuple(expand(a) for a in args)
        pool.append(emit(target, args, kwargs))
    outs = [n for n in pool if not n.users and n.op != "placeholder"] or pool[-1:]
    g.output(tuple(outs))
    return _shown(GraphModule(torch.nn.Module(), g))


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
    """Trace ``fn(*tensors, **params)`` with make_fx on fake tensors.

    ``inputs`` draws ``(specs, params)``: a list of :class:`T` and a dict of non-tensor
    parameters (closed over, so they become constants of the graph).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    specs, params = draw(inputs)
    mode = FakeTensorMode()
    with mode:
        fakes = [torch.empty(s.shape, dtype=s.dtype) for s in specs]
        gm = make_fx(lambda *xs: fn(*xs, **params), pre_dispatch=False)(*fakes)
    return _shown(gm, f"params={params!r}")
