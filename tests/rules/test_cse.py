"""cse: identical pure nodes merge; reads around a write and random ops never do."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from fxpass import PassManager
from fxpass.rules import cse
from fxpass.testing import T, check_rule, traced_graphs
from tests.conftest import trace

aten = torch.ops.aten


def _twice(x, y, *, op, shared):
    """The same expression built twice (and, with ``shared``, over a shared intermediate)."""
    base = x * y if shared else x
    a = getattr(torch, op)(base) + y
    b = getattr(torch, op)(base) + y
    return a * b, a - b


def test_cse_property():
    cases = st.tuples(
        st.just([T((3, 4)), T((3, 4))]),
        st.fixed_dictionaries(
            {"op": st.sampled_from(["sin", "exp", "relu", "neg"]), "shared": st.booleans()}
        ),
    )
    assert check_rule(cse, traced_graphs(_twice, cases), max_examples=20) >= 10


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.target is target)


def test_duplicates_merge_into_one_node():
    x = torch.randn(3, 4)
    gm = trace(lambda t: t.sin() * t.sin() + t.sin(), x)
    expected = gm(x)
    assert PassManager([cse], check=True).run(gm).rewrites == {"cse": 1}
    assert _count(gm, aten.sin.default) == 1
    torch.testing.assert_close(gm(x), expected)


def test_reads_around_a_write_are_not_merged():
    def f(buf, v):
        a = buf.clone()
        buf.add_(v)
        b = buf.clone()
        return a, b

    buf, v = torch.zeros(4), torch.ones(4)
    gm = trace(f, buf, v)
    report = PassManager([cse], check=True).run(gm)
    assert report.total_rewrites == 0
    a, b = gm(torch.zeros(4), v)
    assert not torch.equal(a, b)


def test_random_ops_are_not_merged():
    gm = trace(lambda t: torch.rand_like(t) + torch.rand_like(t), torch.randn(8))
    assert PassManager([cse], check=True).run(gm).total_rewrites == 0
