"""``check_rule`` with its defaults passes correct rules and catches wrong ones.

A kit that rejects a correct rule teaches authors to switch it off; one that passes a wrong
rule is worse. Ten correct rules of different shapes (one-ulp rewrites, results cast to a wider
dtype, non-tensor ``Var``s in dim and eps positions, patterns with checks) must pass with no
argument but the rule; ten wrong ones (fan-out, an in-place edit of a shared value, a changed
dtype, a lower internal precision, NaN and zero-sign handling, a wrong dim, non-idempotence, an
edit behind the driver's back) must each be caught.
"""

from __future__ import annotations

import pytest
import torch

from fxpass import FixpointError, rule
from fxpass.pattern import Num, P, Var, pattern_rule
from fxpass.testing import check_rule

aten = torch.ops.aten
SIGMOID_MUL = P(aten.mul.Tensor, Var("x"), P(aten.sigmoid.default, Var("x")), commute=True)
RMS = P(
    aten.mul.Tensor,
    Var("x"),
    P(
        aten.rsqrt.default,
        P(
            aten.add.Tensor,
            P(aten.mean.dim, P(aten.pow.Tensor_Scalar, Var("x"), 2), [Var("dim")], True),
            Num("eps"),
        ),
    ),
)


# ---- correct rules ---------------------------------------------------------------------------


@pattern_rule(SIGMOID_MUL)
def silu(rw, m):
    return rw.call(aten.silu.default, m.x)


@pattern_rule(RMS)
def rms_norm_spelled(rw, m):
    sq = rw.call(aten.mul.Tensor, m.x, m.x)
    ms = rw.call(aten.mean.dim, sq, [m.dim], True)
    return rw.call(
        aten.div.Tensor, m.x, rw.call(aten.sqrt.default, rw.call(aten.add.Tensor, ms, m.eps))
    )


@pattern_rule(P(aten.mul.Tensor, P(aten.mul.Tensor, Var("x"), Num("a")), Num("b")))
def fold_muls(rw, m):
    return rw.call(aten.mul.Tensor, m.x, m.a * m.b)


@pattern_rule(P(aten.sub.Tensor, Var("a"), Var("b")))
def sub_to_add_neg(rw, m):
    return rw.call(aten.add.Tensor, m.a, rw.call(aten.neg.default, m.b))


@pattern_rule(P(aten.neg.default, P(aten.neg.default, Var("x"))))
def double_neg(rw, m):
    return m.x


@pattern_rule(P(aten.relu.default, P(aten.relu.default, Var("x"))))
def double_relu(rw, m):
    return rw.call(aten.relu.default, m.x)


@pattern_rule(P(aten.div.Tensor, Var("x"), Num("a")), check=lambda m: m.a != 0 or "a is zero")
def div_to_mul(rw, m):
    return rw.call(aten.mul.Tensor, m.x, 1.0 / m.a)


@pattern_rule(P(aten.mul.Tensor, Var("x"), P(aten.rsqrt.default, Var("y"))))
def rsqrt_to_div(rw, m):
    return rw.call(aten.div.Tensor, m.x, rw.call(aten.sqrt.default, m.y))


@pattern_rule(
    P(
        aten._to_copy.default,
        P(aten._to_copy.default, Var("x", dtype=torch.float32), dtype=torch.float64),
        dtype=torch.float32,
    )
)
def f32_round_trip(rw, m):
    return m.x


@pattern_rule(P(aten.pow.Tensor_Scalar, Var("x"), 2))
def square(rw, m):
    return rw.call(aten.mul.Tensor, m.x, m.x)


CORRECT = [
    (silu, {}),
    (rms_norm_spelled, {}),
    (fold_muls, {}),
    (sub_to_add_neg, {}),
    (double_neg, {}),
    (double_relu, {}),
    (div_to_mul, {}),
    (rsqrt_to_div, {}),
    (f32_round_trip, {}),
    (square, {}),
]


# ---- wrong rules -----------------------------------------------------------------------------


@rule(aten.mul.Tensor)
def silu_fan_out(node, rw):
    """Replaces the sigmoid for *all* its users, not only inside the match."""
    a, b = node.args[:2]
    for x, s in ((a, b), (b, a)):
        if isinstance(s, torch.fx.Node) and s.target == aten.sigmoid.default and s.args[0] is x:
            rw.replace(s, rw.call(aten.silu.default, x))
            return True
    return False


@pattern_rule(
    P(aten.mul.Tensor, Var("x"), P(aten.sigmoid.default, Var("x"), name="s", shared=True))
)
def silu_edits_shared(rw, m):
    """Marks the sigmoid shared, then rewrites it for every user anyway."""
    out = rw.call(aten.silu.default, m.x)
    rw.replace(m.s, out)
    return out


@pattern_rule(SIGMOID_MUL)
def silu_in_half(rw, m):
    """Computes in float16 and casts back: the dtype is right, the precision is not."""
    h = rw.call(aten._to_copy.default, m.x, dtype=torch.float16)
    return rw.call(aten._to_copy.default, rw.call(aten.silu.default, h), dtype=torch.float32)


@pattern_rule(SIGMOID_MUL)
def silu_to_half(rw, m):
    """Changes the output dtype."""
    return rw.call(aten.silu.default, rw.call(aten._to_copy.default, m.x, dtype=torch.float16))


@pattern_rule(P(aten.maximum.default, Var("a"), Var("b")))
def maximum_by_where(rw, m):
    """Wrong on NaN: maximum propagates it, where(a > b, a, b) does not."""
    return rw.call(aten.where.self, rw.call(aten.gt.Tensor, m.a, m.b), m.a, m.b)


@pattern_rule(P(aten.add.Tensor, Var("x"), 0.0))
def add_zero(rw, m):
    """Wrong on -0.0: -0.0 + 0.0 is +0.0."""
    return m.x


@pattern_rule(RMS)
def rms_wrong_dim(rw, m):
    """Always normalizes over the last dim, whatever dim the pattern bound."""
    ms = rw.call(aten.mean.dim, rw.call(aten.mul.Tensor, m.x, m.x), [-1], True)
    return rw.call(
        aten.mul.Tensor, m.x, rw.call(aten.rsqrt.default, rw.call(aten.add.Tensor, ms, m.eps))
    )


@pattern_rule(P(aten.sub.Tensor, Var("a"), Var("b")))
def sub_forgets_neg(rw, m):
    return rw.call(aten.add.Tensor, m.a, m.b)


@pattern_rule(P(aten.tanh.default, Var("x")))
def tanh_grows(rw, m):
    """tanh(x) -> tanh(x + 0): fires on its own output forever."""
    return rw.call(aten.tanh.default, rw.call(aten.add.Tensor, m.x, 0.0))


@pattern_rule(P(aten.neg.default, Var("x")))
def neg_behind_the_back(rw, m):
    """Edits the node directly instead of through the Rewriter."""
    m.root.target = aten.mul.Tensor
    m.root.args = (m.x, -1.0)
    return True


WRONG = [
    (silu_fan_out, {"around": SIGMOID_MUL}, AssertionError, "not close"),
    (silu_edits_shared, {}, AssertionError, "not close"),
    (silu_in_half, {}, AssertionError, "not close"),
    (silu_to_half, {}, Exception, "dtype torch.float32 -> torch.float16"),
    (maximum_by_where, {}, AssertionError, "not close"),
    (add_zero, {}, AssertionError, "sign of"),
    (rms_wrong_dim, {}, AssertionError, "not close"),
    (sub_forgets_neg, {}, AssertionError, "not close"),
    (tanh_grows, {}, FixpointError, "tanh_grows -> tanh_grows"),
    (neg_behind_the_back, {}, Exception, "bypassing the Rewriter"),
]


@pytest.mark.slow
@pytest.mark.parametrize("r,kw", CORRECT, ids=[r.name for r, _ in CORRECT])
def test_correct_rule_passes_with_defaults(r, kw):
    assert check_rule(r, **kw) > 0


@pytest.mark.slow
@pytest.mark.parametrize("r,kw,exc,why", WRONG, ids=[w[0].name for w in WRONG])
def test_wrong_rule_is_caught(r, kw, exc, why):
    with pytest.raises(exc, match=why):
        check_rule(r, **kw)


def test_float32_result_cast_to_float64_is_compared_at_float32():
    """The case a user hit: silu(x) differs from x * sigmoid(x) by one float32 ulp, and the
    generated graph then casts to float64. Fast tier: a few examples, the float64 cast forced."""
    from hypothesis import strategies as st

    from fxpass.testing import T, assert_outputs_close, traced_graphs

    specs = st.integers(1, 64).map(lambda n: ([T((n,)), T((n,), torch.float64)], {}))
    graphs = traced_graphs(lambda x, y: (x * torch.sigmoid(x)).double() + y, specs)
    assert check_rule(silu, graphs, max_examples=20, special_values=False) > 0

    e = torch.tensor([1.0], dtype=torch.float64)
    a = e + 1.2e-7
    with pytest.raises(AssertionError):
        assert_outputs_close(e, a)  # float64 tolerance when computed in float64
    assert_outputs_close(e, a, computed_in=[torch.float32])


def test_non_tensor_var_is_drawn_by_its_position():
    """Var("dim") in mean's dim list and Num("eps") are drawn as an int and a number, not as
    tensors (which ended in Hypothesis' Unsatisfiable with no hint)."""
    assert check_rule(rms_norm_spelled, max_examples=20) > 0


def test_a_var_that_cannot_be_drawn_is_named():
    @pattern_rule(P(aten._to_copy.default, Var("x"), dtype=Var("dt")))
    def any_cast(rw, m):
        return None

    with pytest.raises(TypeError, match=r"Var\('dt'\).*'dtype'"):
        check_rule(any_cast, max_examples=5)


@pytest.mark.slow  # 3.5 s: the fast tier's budget
def test_unsatisfiable_patterns_say_why():
    @pattern_rule(P(aten.cat.default, [Var("a"), Var("b")], 5))  # no generated rank has dim 5
    def never_types(rw, m):
        return None

    with pytest.raises(AssertionError, match="failed to type-check; the last error"):
        check_rule(never_types, max_examples=5)


def test_pattern_repr_shows_every_flag():
    p = P(aten.mul.Tensor, Var("x"), P(aten.sigmoid.default, Var("x"), name="s", shared=True))
    assert "name='s'" in repr(p) and "shared=True" in repr(p)
    assert "commute=True" in repr(SIGMOID_MUL)


def test_a_node_name_bound_twice_must_be_the_same_node():
    from fxpass.testing import trace

    pat = P(
        aten.add.Tensor,
        P(aten.neg.default, Var("x"), name="n"),
        P(aten.neg.default, Var("y"), name="n"),
    )
    gm = trace(lambda a, b: -a + -b, torch.ones(2), torch.ones(2))
    root = next(n for n in gm.graph.nodes if n.target == aten.add.Tensor)
    assert pat.match(root) is None
    assert "'n' is bound to" in pat.explain(root)
    gm2 = trace(lambda a: -a + -a, torch.ones(2))
    root2 = next(n for n in gm2.graph.nodes if n.target == aten.add.Tensor)
    # make_fx gives each neg its own node: different nodes, same name -> refused too
    assert (pat.match(root2) is None) == (
        len(gm2.graph.find_nodes(op="call_function", target=aten.neg.default)) == 2
    )
