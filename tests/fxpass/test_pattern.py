"""The pattern layer (fxpass.pattern) and the kit's fan-out / special-value generation."""

from __future__ import annotations

import pytest
import torch

from fxpass import PassManager, capture, rule
from fxpass.pattern import ANY, Num, P, Var, pattern_rule
from fxpass.testing import aten_graphs, check_rule, pattern_graphs

aten = torch.ops.aten

FOLD = P(aten.mul.Tensor, P(aten.mul.Tensor, Var("x"), Num("a")), Num("b"))


@pattern_rule(FOLD)
def fold_muls(rw, m):
    """x * a * b -> x * (a * b) for Python numbers a, b."""
    return rw.call(aten.mul.Tensor, m.x, m.a * m.b)


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_pattern_rule_folds_and_is_indexed_by_root():
    assert fold_muls.roots == (aten.mul.Tensor,)
    assert fold_muls.pattern is FOLD
    gm = capture(lambda x: x * 2.0 * 3.0, torch.randn(3))[0]
    report = PassManager([fold_muls], check=True).run(gm)
    assert report.rewrites == {"fold_muls": 1}
    (mul,) = _calls(gm)
    assert mul.args[1] == 6.0
    x = torch.randn(3)
    torch.testing.assert_close(gm(x)[0], x * 6.0)


def test_shared_inner_node_is_refused_with_the_reason():
    def f(x):
        y = x * 2.0
        return y * 3.0, y

    gm = capture(f, torch.randn(3))[0]
    report = PassManager([fold_muls], check=True).run(gm)
    assert report.rewrites == {}
    (why,) = [r for name, _, r in report.skips if name == "fold_muls"]
    assert "also used by" in why and "shared=True" in why


def test_explain_names_the_failing_argument():
    gm = capture(lambda x: (x + 2.0) * 3.0, torch.randn(3))[0]
    root = _calls(gm)[-1]
    why = FOLD.explain(root)
    assert "arg" in why or "self of" in why
    assert "aten.mul.Tensor" in why and "add" in why
    assert FOLD.match(root) is None


def test_defaults_are_filled_in_so_patterns_are_strict():
    # sum(x, [1]) matches a pattern that leaves keepdim out (False, its default) ...
    pat = P(aten.sum.dim_IntList, Var("x"), [1])
    gm = capture(lambda x: x.sum(1), torch.randn(2, 3))[0]
    assert pat.match(_calls(gm)[0]) is not None
    # ... but not keepdim=True, and a pattern keyword that is no argument is an error message
    gm = capture(lambda x: x.sum(1, keepdim=True), torch.randn(2, 3))[0]
    assert "keepdim" in pat.explain(_calls(gm)[0])
    assert "not arguments" in P(aten.sum.dim_IntList, Var("x"), bogus=1).explain(_calls(gm)[0])
    # a cast with an explicit memory_format is not the plain cast
    cast = P(aten._to_copy.default, Var("x"), dtype=torch.float16)
    gm = capture(
        lambda x: (
            x.to(torch.float16),
            x.to(torch.float16, memory_format=torch.channels_last),
        ),
        torch.randn(1, 2, 3, 4),
    )[0]
    a, b = [n for n in _calls(gm) if n.target is aten._to_copy.default]
    assert cast.match(a) is not None
    assert cast.match(b) is None


def _root(fn, *examples):
    from fxpass.tracing import trace

    return _calls(trace(fn, *examples))[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_an_int_constant_matches_the_equal_float_on_float_tensors(dtype):
    """``x + 3`` and ``x + 3.0`` compute the same on a float tensor (the number is converted to
    its dtype either way): one pattern, either spelling, and either way round."""
    x = torch.ones(3, dtype=dtype)
    by_int = P(aten.add.Tensor, Var("x"), 3)
    by_float = P(aten.add.Tensor, Var("x"), 3.0)
    assert by_int.match(_root(lambda a: a + 3.0, x)) is not None
    assert by_float.match(_root(lambda a: a + 3, x)) is not None
    relu6 = P(aten.hardtanh.default, Var("x"), 0, 6)  # F.relu6's numbers, F.hardtanh's 0.0
    assert relu6.match(_root(lambda a: torch.nn.functional.hardtanh(a, 0.0, 6.0), x)) is not None
    # equal only: 3.5 is not 3, a bool is not 1, and a repeated Var still wants one value
    assert "wants 3, got 3.5" in by_int.explain(_root(lambda a: a + 3.5, x))
    assert P(aten.mul.Tensor, Var("x"), 1).match(_root(lambda a: a * True, x)) is None


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_an_int_constant_and_the_equal_float_stay_apart_where_promotion_differs(dtype):
    """On integer or bool tensors ``x + 3.0`` is a float tensor and ``x + 3`` is not: one
    pattern must not take both, and the near-miss says why."""
    x = torch.ones(3, dtype=dtype)
    spelled = _root(lambda a: a + 3.0, x)
    assert spelled.meta["val"].dtype.is_floating_point  # what makes them differ
    by_int = P(aten.add.Tensor, Var("x"), 3)
    assert by_int.match(spelled) is None
    why = by_int.explain(spelled)
    assert "wants 3, got 3.0" in why and "type promotion" in why and str(dtype) in why
    assert P(aten.add.Tensor, Var("x"), 3.0).match(_root(lambda a: a + 3, x)) is None


def test_a_float_argument_matches_an_equal_int_whatever_the_tensors():
    """An argument the schema declares ``float`` is converted before the op sees it: there the
    number's type cannot matter, even on an integer tensor."""
    spelled = _root(lambda a: torch.nan_to_num(a, nan=0.0), torch.ones(3, dtype=torch.int64))
    assert P(aten.nan_to_num.default, Var("x"), 0).match(spelled) is not None


def test_bindings_repeated_var_num_commute_any_dtype():
    sq = P(aten.mul.Tensor, Var("x"), Var("x"))
    gm = capture(lambda x, y: (x * x, x * y), torch.randn(3), torch.randn(3))[0]
    same, diff = _calls(gm)
    assert sq.match(same).x is same.args[0]
    assert "bound to" in sq.explain(diff)
    num = P(aten.add.Tensor, Var("x"), Num("c"))
    gm = capture(lambda x, y: (x + 2, x + y), torch.randn(3), torch.randn(3))[0]
    by_num, by_tensor = _calls(gm)
    assert num.match(by_num).c == 2
    assert "Python number" in num.explain(by_tensor)
    # commute: 2 * x is mul(x, 2) or mul(2, x)-shaped depending on capture; both match
    com = P(aten.mul.Tensor, Num("c"), Var("x"), commute=True)
    gm = capture(lambda x: x * 3.0, torch.randn(3))[0]
    m = com.match(_calls(gm)[0])
    assert m is not None and m.c == 3.0
    with pytest.raises(ValueError, match="two positional"):
        P(aten.neg.default, Var("x"), commute=True)
    # dtype-constrained leaf and ANY
    f16 = P(aten.neg.default, Var("x", dtype=torch.float16))
    gm = capture(lambda x: -x, torch.randn(3))[0]
    assert "float16" in f16.explain(_calls(gm)[0])
    assert P(aten.neg.default, ANY).match(_calls(gm)[0]) is not None
    with pytest.raises(AttributeError, match="no binding"):
        _ = P(aten.neg.default, Var("x")).match(_calls(gm)[0]).y


def test_inner_in_place_op_is_never_consumed():
    # built by hand: capture would functionalize the add_ away
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    add_ = g.call_function(aten.add_.Tensor, (x, y))
    neg = g.call_function(aten.neg.default, (add_,))
    g.output((neg,))
    pat = P(aten.neg.default, P(aten.add_.Tensor, Var("x"), Var("y")))
    assert "not a pure value" in pat.explain(neg)
    assert pat.match(neg) is None
    # the same tree over the out-of-place add matches
    add_.target = aten.add.Tensor
    assert P(aten.neg.default, P(aten.add.Tensor, Var("x"), Var("y"))).match(neg) is not None


def test_check_and_near_miss_reasons_reach_the_report():
    @pattern_rule(FOLD, check=lambda m: "b is zero" if m.b == 0 else None)
    def fold_nonzero(rw, m):
        return rw.call(aten.mul.Tensor, m.x, m.a * m.b)

    gm = capture(lambda x: x * 2.0 * 0.0, torch.randn(3))[0]
    report = PassManager([fold_nonzero], check=True).run(gm)
    assert report.rewrites == {}
    assert ("fold_nonzero", _calls(gm)[-1].name, "b is zero") in report.skips


def test_pattern_graphs_contain_the_pattern_and_fan_out():
    from hypothesis import given, settings

    seen = {"match": 0, "shared": 0, "n": 0}

    @settings(max_examples=60, derandomize=True, database=None, deadline=None)
    @given(pattern_graphs(FOLD))
    def prop(gm):
        seen["n"] += 1
        for n in _calls(gm):
            if n.target is aten.mul.Tensor and isinstance(n.args[0], torch.fx.Node):
                inner = n.args[0]
                if inner.target is aten.mul.Tensor and not isinstance(n.args[1], torch.fx.Node):
                    seen["match"] += 1
                    seen["shared"] += len(inner.users) > 1

    prop()
    assert seen["match"] >= seen["n"]  # every graph holds an instance
    assert seen["shared"] >= seen["n"] // 6  # and inner values are often shared


# -- the kit catches what the issue says it let through -----------------------------------


@rule(aten.mul.Tensor)
def fold_in_place(node, rw):
    """The bug from the report: edits the inner mul in place (wrong when it has other users)."""
    inner, b = node.args
    if not isinstance(inner, torch.fx.Node) or inner.target is not aten.mul.Tensor:
        return False
    x, a = inner.args
    if isinstance(b, torch.fx.Node) or isinstance(a, torch.fx.Node):
        return False
    rw.retarget(inner, aten.mul.Tensor, x, a * b)
    rw.replace(node, inner)
    return True


def test_check_rule_catches_the_in_place_fold_through_fan_out():
    with pytest.raises(AssertionError):
        check_rule(fold_in_place, around=FOLD)
    # the pattern version of the same rule passes (single use is enforced for it)
    assert check_rule(fold_muls) > 0


def test_check_rule_catches_a_shared_pattern_rule_that_edits_in_place():
    @pattern_rule(
        P(
            aten.mul.Tensor,
            P(aten.mul.Tensor, Var("x"), Num("a"), shared=True, name="inner"),
            Num("b"),
        )
    )
    def wrong_shared(rw, m):
        rw.retarget(m.inner, aten.mul.Tensor, m.x, m.a * m.b)
        rw.replace(m.root, m.inner)
        return True

    with pytest.raises(AssertionError):
        check_rule(wrong_shared)


@rule(aten.maximum.default)
def maximum_to_where(node, rw):
    """maximum(a, b) -> where(a > b, a, b): equal except where a or b is NaN."""
    a, b = node.args
    gt = rw.call(aten.gt.Tensor, a, b)
    rw.replace(node, rw.call(aten.where.self, gt, a, b))
    return True


def test_check_rule_catches_maximum_to_where_on_nan_by_default():
    graphs = aten_graphs(ops=("maximum", "add", "neg"), max_ops=4)
    with pytest.raises(AssertionError, match="NaN"):
        check_rule(maximum_to_where, graphs)
    # the opt-out exists for rules that legitimately differ there, and then it passes
    assert check_rule(maximum_to_where, graphs, special_values=False) > 0


def test_check_rule_catches_direct_graph_edits():
    @rule(aten.neg.default)
    def sneaky(node, rw):
        """Edits the graph directly and reports it through nothing."""
        if node.meta.get("seen"):
            return False
        node.meta["seen"] = True
        with node.graph.inserting_after(node):
            node.graph.call_function(aten.relu.default, (node,))
        return False

    from fxpass import ContractError

    with pytest.raises(ContractError, match="bypassing the Rewriter"):
        check_rule(sneaky, aten_graphs(ops=("neg", "add")), must_fire=False)


def test_check_rule_without_graphs_or_pattern_says_what_to_pass():
    with pytest.raises(TypeError, match="needs graphs"):
        check_rule(maximum_to_where)


def test_ported_bf16_cast_cancel_is_a_pattern_rule():
    from fxpass.rules.bf16_promotion import ROUND_TRIP, bf16_cast_cancel

    assert bf16_cast_cancel.pattern is ROUND_TRIP


def test_readme_rule_runs_and_passes_the_kit():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "@" in b]
    ns: dict = {}
    exec(compile(block, "README.md", "exec"), ns)
    assert check_rule(ns["fold_muls"]) > 0
