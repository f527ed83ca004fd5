"""The CPU ops of a spliced graph call torch's direct bindings only where that is proved to
reach the node's own aten overload (``backends/bpu/fastcall.py``)."""

import json

import torch
from torch.fx import Graph, GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

from fxpass.backends.bpu import plan
from fxpass.backends.bpu.fastcall import ATEN, fast_calls

aten = torch.ops.aten


def _host_step(cache, pos, new, ids, table):
    """What a decode step leaves on the CPU: embedding, position arithmetic, a cache write."""
    e = torch.embedding(table, ids)
    p = pos + 1
    mask = torch.arange(cache.shape[0]).unsqueeze(-1) == torch.index_select(
        torch.arange(cache.shape[0]), 0, p
    )
    cache.index_copy_(0, p, new)
    pos.copy_(p)
    return e * 2.0, mask, torch.cos(e)


def _inputs():
    torch.manual_seed(0)
    return (
        torch.zeros(8, 4),
        torch.tensor([2]),
        torch.randn(1, 4),
        torch.tensor([[1, 5, 3]]),
        torch.randn(10, 4),
    )


def _boxed(gm: GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_switched_graph_equals_the_boxed_one():
    gm = make_fx(_host_step, tracing_mode="fake")(*_inputs())
    before = _boxed(gm)
    assert all(isinstance(t, torch._ops.OpOverload) for t in before)
    n = fast_calls(gm)
    switched = {n.meta[ATEN] for n in gm.graph.nodes if ATEN in n.meta}
    assert n >= len(switched) > 0
    # the ops a decode step runs every token are among the switched ones
    assert {aten.embedding.default, aten.index_copy_.default, aten.eq.Tensor,
            aten.index_select.default, aten.copy_.default} <= switched
    for node in gm.graph.nodes:
        if ATEN in node.meta:
            assert not isinstance(node.target, torch._ops.OpOverload)
    ref_in, got_in = _inputs(), _inputs()
    ref = _host_step(*ref_in)
    got = gm(*got_in)
    for r, g in zip(ref, got, strict=True):
        assert r.dtype == g.dtype and torch.equal(r, g)
    for r, g in zip(ref_in, got_in, strict=True):  # the in-place writes happened
        assert torch.equal(r, g)


def _one_node(target, args, vals):
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    g = Graph()
    phs = []
    for i, v in enumerate(vals):
        p = g.placeholder(f"x{i}")
        if v is not None:
            p.meta["val"] = mode.from_tensor(v)
        phs.append(p)
    node = g.call_function(target, tuple(phs[i] if isinstance(i, int) else i.v for i in args))
    g.output(node)
    return GraphModule(torch.nn.Module(), g), node


class _Lit:
    def __init__(self, v):
        self.v = v


def test_a_binding_that_picks_another_overload_stays_boxed():
    # torch.add(x, 2) reaches add.Tensor (the scalar wrapped), not the node's add.Scalar
    gm, node = _one_node(aten.add.Scalar, (0, _Lit(2)), [torch.ones(3)])
    assert fast_calls(gm) == 0 and node.target is aten.add.Scalar
    # the same binding proved for add.Tensor is switched
    gm, node = _one_node(aten.add.Tensor, (0, 1), [torch.ones(3), torch.ones(3)])
    assert fast_calls(gm) == 1 and node.meta[ATEN] is aten.add.Tensor


def test_a_composite_binding_and_missing_fake_values_stay_boxed():
    # torch.matmul on 2-D tensors dispatches aten.mm, not aten.matmul
    gm, node = _one_node(aten.matmul.default, (0, 1), [torch.ones(2, 3), torch.ones(3, 2)])
    assert fast_calls(gm) == 0 and node.target is aten.matmul.default
    gm, node = _one_node(aten.add.Tensor, (0, 1), [torch.ones(3), None])  # nothing to prove on
    assert fast_calls(gm) == 0 and node.target is aten.add.Tensor


def test_a_plan_keeps_the_switch_and_its_overload():
    gm = make_fx(_host_step, tracing_mode="fake")(*_inputs())
    fast_calls(gm)
    body, consts = plan.encode(gm, [], {})
    text = json.loads(body)
    assert any(isinstance(r[2], str) and r[2].startswith("fast:aten.index_copy_")
               for r in text["nodes"])
    back = plan.decode(text, consts, {})
    want = {n.name: (n.target, n.meta.get(ATEN)) for n in gm.graph.nodes
            if n.op == "call_function"}
    got = {n.name: (n.target, n.meta.get(ATEN)) for n in back.graph.nodes
           if n.op == "call_function"}
    assert got == want
    ref_in, got_in = _inputs(), _inputs()
    for r, g in zip(_host_step(*ref_in), back(*got_in), strict=True):
        assert torch.equal(r, g)
    assert all(torch.equal(r, g) for r, g in zip(ref_in, got_in, strict=True))


def test_the_proof_checks_which_tensor_goes_where():
    from fxpass.backends.bpu import fastcall

    gm, node = _one_node(aten.sub.Tensor, (0, 1), [torch.ones(3), torch.ones(3)])
    assert fastcall._proved(node, lambda a, b: torch.sub(a, b))
    assert not fastcall._proved(node, lambda a, b: torch.sub(b, a))  # same overload, swapped
    assert not fastcall._proved(node, lambda a, b: torch.sub(a, b) + 0)  # a second call
