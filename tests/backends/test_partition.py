"""Partitioner: convex, acyclic after contraction, maximal-ish, and MACs counted right."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx import Graph, GraphModule

from fxpass.partition.cost import macs
from fxpass.partition.partition import is_convex, partition
from tests.conftest import trace

aten = torch.ops.aten


@st.composite
def random_dags(draw):
    """A random DAG of unary/binary ops; each op node is 'supported' or not (drawn)."""
    g = Graph()
    nodes = [g.placeholder(f"x{i}") for i in range(draw(st.integers(1, 3)))]
    supported = {}
    for _ in range(draw(st.integers(1, 40))):
        arity = draw(st.integers(1, 2))
        args = tuple(draw(st.sampled_from(nodes)) for _ in range(arity))
        n = g.call_function(aten.add.Tensor if arity == 2 else aten.neg.default, args)
        n.meta["val"] = torch.empty(2)
        supported[n] = draw(st.booleans())
        nodes.append(n)
    g.output(tuple(n for n in nodes if not n.users))
    return GraphModule(torch.nn.Module(), g), supported


def _contracted_is_acyclic(gm, regions):
    owner = {n: r.id for r in regions for n in r.nodes}
    key = lambda n: ("r", owner[n]) if n in owner else ("n", n)  # noqa: E731
    edges = {}
    for n in gm.graph.nodes:
        for i in n.all_input_nodes:
            a, b = key(i), key(n)
            if a != b:
                edges.setdefault(a, set()).add(b)
    state = {}

    def dfs(u):
        state[u] = 1
        for v in edges.get(u, ()):
            if state.get(v) == 1 or (v not in state and not dfs(v)):
                return False
        state[u] = 2
        return True

    return all(dfs(u) for u in list(edges) if u not in state)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(random_dags())
def test_regions_are_convex_disjoint_and_contract_acyclically(dag):
    gm, supported = dag
    p = partition(gm, lambda n: None if supported.get(n) else "unsupported", min_compute_macs=0)
    # every region passes the independent convexity check; no node is in two regions
    seen = set()
    all_regions = p.regions + [r for r, _ in p.dropped]
    for r in all_regions:
        assert is_convex(gm, set(r.nodes))
        assert not seen & set(r.nodes)
        seen |= set(r.nodes)
        assert all(supported[n] for n in r.nodes)
    assert seen == {n for n, s in supported.items() if s}
    assert _contracted_is_acyclic(gm, all_regions)
    gm.graph.lint()  # sinking CPU nodes kept every input before its users


def test_side_branch_through_unsupported_op_splits_regions():
    # a -> b (supported) and a -> u (unsupported) -> c (supported) with c consuming b:
    # {a, b, c} is not convex (a -> u -> c leaves and re-enters), so c may not join a's region.
    g = Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.neg.default, (x,))
    b = g.call_function(aten.neg.default, (a,))
    u = g.call_function(aten.sin.default, (a,))
    c = g.call_function(aten.add.Tensor, (b, u))
    g.output((c,))
    for n in (a, b, u, c):
        n.meta["val"] = torch.empty(2)
    gm = GraphModule(torch.nn.Module(), g)
    p = partition(gm, lambda n: "no" if n is u else None)
    groups = [set(r.nodes) for r in p.regions + [r for r, _ in p.dropped]]
    assert {a, b} in groups and {c} in groups
    assert p.rejected == {u: "no"}


def test_an_early_cpu_consumer_is_sunk_and_does_not_seal_the_region():
    # a (device) -> u (CPU, written right after a, read only by the final write) and
    # a -> b -> c (device). Left in place, u seals {a} and b, c start a second region.
    g = Graph()
    x, buf = g.placeholder("x"), g.placeholder("buf")
    a = g.call_function(aten.neg.default, (x,))
    u = g.call_function(aten.sin.default, (a,))
    b = g.call_function(aten.mul.Tensor, (a, x))
    c = g.call_function(aten.add.Tensor, (b, x))
    w = g.call_function(aten.copy_.default, (buf, u))
    g.output((c,))
    for n in (x, buf, a, u, b, c, w):
        n.meta["val"] = torch.empty(2)
    w.meta["val"] = buf.meta["val"]
    gm = GraphModule(torch.nn.Module(), g)
    p = partition(gm, lambda n: "no" if n in (u, w) else None)
    assert [set(r.nodes) for r in p.regions + [r for r, _ in p.dropped]] == [{a, b, c}]
    order = list(gm.graph.nodes)
    assert order.index(u) == order.index(w) - 1  # moved down to its one user
    gm.graph.lint()


def test_a_sunk_cpu_node_still_reads_before_a_write_to_its_input():
    # u reads buf; buf is written in place before u's user runs: u must stay before the write
    def f(x, buf):
        u = buf.sin()  # CPU
        a = x.neg()  # device
        buf.add_(1.0)
        return a * u

    x, buf = torch.randn(4), torch.randn(4)
    gm = trace(f, x, buf.clone())
    sin = next(n for n in gm.graph.nodes if n.target is aten.sin.default)
    rejected = {sin} | {n for n in gm.graph.nodes if n.target is aten.add_.Tensor}
    expected = f(x, buf.clone())
    partition(gm, lambda n: "no" if n in rejected else None)
    gm.recompile()
    torch.testing.assert_close(gm(x, buf.clone()), expected)
    order = list(gm.graph.nodes)
    add_ = next(n for n in order if n.target is aten.add_.Tensor)
    assert order.index(sin) < order.index(add_)


def test_long_chain_splits_exactly_at_unsupported_nodes():
    # (speed is measured in benchmarks/scaling.py, never asserted here)
    g = Graph()
    x = g.placeholder("x")
    n = 5000
    for k in range(n):
        x = g.call_function(aten.neg.default if k % 7 else aten.sin.default, (x,))
        x.meta["val"] = torch.empty(2)
    g.output((x,))
    gm = GraphModule(torch.nn.Module(), g)
    p = partition(gm, lambda n: "no" if n.target is aten.sin.default else None)
    runs = p.regions + [r for r, _ in p.dropped]
    sizes = sorted(len(r.nodes) for r in runs)
    assert len(runs) == len(range(0, n, 7)) and sizes[1:] == [6] * (len(runs) - 1)


def test_macs_for_every_tensor_engine_op():
    x, w, b = torch.randn(3, 5), torch.randn(7, 5), torch.randn(7)
    cases = {  # independent formula: M * N * K with x [M=3, K=5], w [N=7, K=5]
        aten.mm.default: (lambda x, w, b: torch.mm(x, w.t()), 3 * 7 * 5),
        aten.addmm.default: (lambda x, w, b: torch.addmm(b, x, w.t()), 3 * 7 * 5),
        aten.bmm.default: (lambda x, w, b: torch.bmm(x[None], w.t()[None]), 3 * 7 * 5),
        aten.baddbmm.default: (
            lambda x, w, b: torch.baddbmm(b[None, None], x[None], w.t()[None]),
            3 * 7 * 5,
        ),
    }
    for target, (fn, want) in cases.items():
        gm = trace(fn, x, w, b)
        (node,) = [n for n in gm.graph.nodes if n.target is target]
        assert macs(node) == want, target
    # linear(x [3,5], w [7,5]) built directly (AOT would decompose it)
    g = Graph()
    px, pw = g.placeholder("x"), g.placeholder("w")
    lin = g.call_function(aten.linear.default, (px, pw))
    px.meta["val"], pw.meta["val"], lin.meta["val"] = x, w, torch.empty(3, 7)
    assert macs(lin) == 3 * 7 * 5


def test_macs_for_convolution_with_groups_stride_dilation_padding():
    x, w = torch.randn(2, 8, 17, 19), torch.randn(12, 4, 3, 5)  # groups=2: Cin/groups=4

    def conv(a, k):
        return torch.nn.functional.conv2d(
            a, k, stride=(2, 1), padding=(1, 2), dilation=(2, 1), groups=2
        )

    gm = trace(conv, x, w)
    (node,) = [n for n in gm.graph.nodes if n.target is aten.convolution.default]
    out = conv(x, w)
    # every output element: Cin/groups * kh * kw MACs (independent formula from the real output)
    assert macs(node) == out.numel() * (8 // 2) * 3 * 5


def test_a_long_chain_of_cpu_nodes_is_sunk_without_recursion():
    # emit() was recursive: a chain of 1200 held CPU nodes raised RecursionError (review)
    g = Graph()
    x = g.placeholder("x")
    cur, chain = x, []
    for _ in range(3000):
        cur = g.call_function(aten.neg.default, (cur,))
        chain.append(cur)
    out = g.call_function(aten.relu.default, (cur,))
    g.output((out,))
    for n in (x, *chain, out):
        n.meta["val"] = torch.empty(2)
    gm = GraphModule(torch.nn.Module(), g)
    p = partition(gm, lambda n: "no" if n in set(chain) else None)
    assert [r.nodes for r in p.regions + [r for r, _ in p.dropped]] == [[out]]
    gm.graph.lint()
