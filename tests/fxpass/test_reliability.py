"""The driver's transactional guarantees: meta-checked replacement, rollback on every exit
path (BaseException, the final fixpoint check), and detection of rules that edit the graph
behind the Rewriter's back."""

import pytest
import torch

from fxpass import ContractError, PassManager, RuleError, graph_rule, rule
from fxpass.graph import fingerprint
from tests.conftest import trace

aten = torch.ops.aten


def _f(x, y):
    return torch.relu(x * 2.0 + y).neg()


def _gm():
    return trace(_f, torch.randn(3, 4), torch.randn(3, 4))


# -- 1. replace() refuses a value with another dtype or shape ------------------------------


@rule(aten.relu.default)
def relu_to_double(node, rw):
    rw.replace(node, rw.call(aten._to_copy.default, node.args[0], dtype=torch.float64))
    return True


@rule(aten.relu.default)
def relu_to_sum(node, rw):
    rw.replace(node, rw.call(aten.sum.default, node.args[0]))
    return True


@rule(aten.relu.default)
def relu_to_scalar(node, rw):
    rw.replace(node, 0.0)
    return True


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize(
    "bad, why",
    [(relu_to_double, "dtype"), (relu_to_sum, "shape"), (relu_to_scalar, "Python")],
)
def test_replace_refuses_other_dtype_or_shape(bad, why, check):
    gm = _gm()
    before = str(gm.graph)
    with pytest.raises(RuleError) as ei:
        PassManager([bad], check=check).run(gm)
    err = ei.value
    assert err.rule == bad.name and err.node == "relu"
    assert why in str(err) and "meta" in str(err)  # says what differs and why it matters
    assert str(gm.graph) == before  # rolled back


def test_replace_compares_tuples_element_wise():
    @rule(aten.max.dim)
    def max_to_min(node, rw):  # same (values, indices) dtypes and shapes: allowed
        rw.replace(node, rw.call(aten.min.dim, *node.args))
        return True

    @rule(aten.max.dim)
    def max_to_sort(node, rw):  # (values, indices) of another shape: refused
        rw.replace(node, rw.call(aten.sort.default, node.args[0], node.args[1]))
        return True

    x = torch.randn(3, 4)
    gm = trace(lambda a: torch.max(a, 1)[0] + 1, x)
    assert PassManager([max_to_min]).run(gm).rewrites == {"max_to_min": 1}
    torch.testing.assert_close(gm(x), torch.min(x, 1)[0] + 1)
    gm = trace(lambda a: torch.max(a, 1)[0] + 1, x)
    with pytest.raises(RuleError, match="shape"):
        PassManager([max_to_sort], check=False).run(gm)


def test_replace_input_is_checked_too():
    @rule(aten.neg.default)
    def feed_double(node, rw):
        rw.replace_input(node, node.args[0], rw.call(aten.sum.default, node.args[0]))
        return True

    with pytest.raises(RuleError, match="shape"):
        PassManager([feed_double], check=False).run(_gm())


def test_retarget_with_another_val_is_refused():
    @rule(aten.relu.default)
    def relu_to_double_in_place(node, rw):
        v = node.meta["val"]
        with rw.fake_mode:
            val = v.to(torch.float64)
        rw.retarget(node, aten._to_copy.default, node.args[0], dtype=torch.float64, val=val)
        return True

    gm = _gm()
    before = str(gm.graph)
    with pytest.raises(RuleError, match="dtype"):
        PassManager([relu_to_double_in_place], check=False).run(gm)
    assert str(gm.graph) == before


def test_symbolic_shapes_compare_without_false_alarms():
    from torch.fx.experimental.proxy_tensor import make_fx

    @rule(aten.relu.default)
    def relu_to_clamp(node, rw):
        rw.replace(node, rw.call(aten.clamp_min.default, node.args[0], 0.0))
        return True

    x = torch.randn(5, 3)
    gm = make_fx(lambda a: torch.relu(a).neg(), tracing_mode="symbolic")(x)
    assert PassManager([relu_to_clamp]).run(gm).rewrites == {"relu_to_clamp": 1}
    torch.testing.assert_close(gm(x), -torch.relu(x))
    gm = make_fx(lambda a: torch.relu(a).neg(), tracing_mode="symbolic")(x)
    with pytest.raises(RuleError, match="shape"):
        PassManager([relu_to_sum], check=False).run(gm)


# -- 2. BaseException: rolled back, re-raised unchanged ------------------------------------


class _Stop(BaseException):
    pass


@pytest.mark.parametrize("exc", [KeyboardInterrupt("ctrl-c"), SystemExit(3), _Stop()])
@pytest.mark.parametrize("check", [False, True])
def test_base_exception_in_a_rule_rolls_back_and_propagates_unchanged(exc, check):
    @rule(aten.relu.default)
    def interrupted(node, rw):
        rw.replace(node, rw.call(aten.sigmoid.default, node.args[0]))
        raise exc

    gm = _gm()
    before = str(gm.graph)
    with pytest.raises(BaseException) as ei:
        PassManager([interrupted], check=check).run(gm)
    assert ei.value is exc  # not wrapped
    assert str(gm.graph) == before


# -- 3. a rule that raises during the final fixpoint check ---------------------------------


def _late_raiser(exc):
    calls = []

    @rule(aten.relu.default)
    def late(node, rw):
        calls.append(node)
        if len(calls) == 1:
            return False  # the main loop: nothing to do
        rw.replace(node, rw.call(aten.sigmoid.default, node.args[0]))  # the fixpoint check
        raise exc

    return late


def test_rule_raising_in_fixpoint_check_is_wrapped_and_rolled_back():
    gm = _gm()
    before = str(gm.graph)
    with pytest.raises(RuleError) as ei:
        PassManager([_late_raiser(ValueError("late boom"))], check=True).run(gm)
    assert ei.value.rule == "late" and ei.value.node == "relu" and "late boom" in str(ei.value)
    assert str(gm.graph) == before


def test_base_exception_in_fixpoint_check_rolls_back_and_propagates():
    gm = _gm()
    before = str(gm.graph)
    exc = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as ei:
        PassManager([_late_raiser(exc)], check=True).run(gm)
    assert ei.value is exc
    assert str(gm.graph) == before


def test_graph_rule_raising_in_fixpoint_check_is_wrapped():
    calls = []

    @graph_rule()
    def late_graph(gm, rw):
        calls.append(1)
        if len(calls) == 1:
            return False
        raise ValueError("late graph boom")

    with pytest.raises(RuleError) as ei:
        PassManager([late_graph], check=True).run(_gm())
    assert ei.value.rule == "late_graph" and ei.value.node == "<graph>"


# -- 4. direct edits (bypassing the Rewriter) are caught in check mode ----------------------


def _direct_edit_then_raise(node, rw):
    with node.graph.inserting_before(node):
        s = node.graph.call_function(aten.sigmoid.default, node.args)
    s.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(s)
    raise ValueError("oops")


def _direct_target_edit(node, rw):
    node.target = aten.sigmoid.default
    return True


def _direct_edit_elsewhere(node, rw):
    user = next(iter(node.users))  # the neg: not the anchor
    user.args = (node.args[0],)
    return False


def _direct_edit_plus_rewriter(node, rw):
    rw.replace(node, rw.call(aten.sigmoid.default, node.args[0]))  # logged
    add = node.args[0]
    add.args = (add.args[1], add.args[0])  # not logged
    return True


@pytest.mark.parametrize(
    "fn",
    [
        _direct_edit_then_raise,
        _direct_target_edit,
        _direct_edit_elsewhere,
        _direct_edit_plus_rewriter,
    ],
)
def test_direct_graph_edit_is_a_contract_error_naming_the_rule(fn):
    bad = rule(aten.relu.default, name="sneaky")(fn)
    gm = _gm()
    with pytest.raises(ContractError, match="sneaky") as ei:
        PassManager([bad], check=True).run(gm)
    msg = str(ei.value)
    assert "directly" in msg and "Rewriter" in msg
    assert "rolled back" not in msg.replace("not rolled back", "")  # never claims a clean undo


def test_direct_edit_by_a_graph_rule_is_caught():
    @graph_rule()
    def sneaky_graph(gm, rw):
        for n in gm.graph.nodes:
            if n.target is aten.neg.default:
                n.target = aten.sigmoid.default
                return False
        return False

    with pytest.raises(ContractError, match="sneaky_graph.*directly"):
        PassManager([sneaky_graph], check=True).run(_gm())


def test_direct_edit_in_fixpoint_check_is_caught():
    calls = []

    @rule(aten.neg.default)
    def sneaky_late(node, rw):
        calls.append(1)
        if len(calls) > 1:
            node.target = aten.sigmoid.default
        return False

    with pytest.raises(ContractError, match="sneaky_late.*directly"):
        PassManager([sneaky_late], check=True).run(_gm())


def test_rewriter_only_rules_pass_the_direct_edit_check():
    @rule(aten.neg.default)
    def neg_to_mul(node, rw):
        rw.replace(node, rw.call(aten.mul.Tensor, node.args[0], -1.0))
        return True

    @rule(aten.relu.default)
    def relu_in_place(node, rw):
        rw.retarget(node, aten.clamp_min.default, node.args[0], 0.0)
        return True

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    gm = trace(_f, x, y)
    report = PassManager([neg_to_mul, relu_in_place], check=True).run(gm)
    assert report.rewrites == {"neg_to_mul": 1, "relu_in_place": 1}
    torch.testing.assert_close(gm(x, y), _f(x, y))


def test_fingerprint_sees_args_target_and_order():
    gm = _gm()
    fp = fingerprint(gm)
    assert fingerprint(gm) == fp
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    relu.target = aten.sigmoid.default
    assert fingerprint(gm) != fp
    relu.target = aten.relu.default
    assert fingerprint(gm) == fp
    add = relu.args[0]
    add.args = (add.args[1], add.args[0])
    assert fingerprint(gm) != fp


def test_is_static_needs_concrete_strides_too():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fxpass.graph import is_static

    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        x = mode.from_tensor(torch.randn(4, 12), symbolic_context=None)
    sym = mode.shape_env.create_unbacked_symint()
    with mode:
        wide = torch.empty_strided((4, 8), (sym, 1))  # fixed sizes, a symbolic stride
    assert is_static(x) and is_static((x, 3))
    assert not is_static(wide) and not is_static((x, wide))


# -- rw.inline's trace cache: keyed by argument position, value type, rule and function ----


def _sub(a, b):
    return aten.sub.Tensor(a, b) if isinstance(a, torch.Tensor) else aten.rsub.Scalar(b, a)


@rule(aten.sub.Tensor, aten.rsub.Scalar)
def spell_sub(node, rw):
    """x - c and c - x through one traced function under one key (found by a probe: the
    second spliced the first's trace, x - 2 for 2 - x)."""
    if node.meta.get("spelled") or not isinstance(node.args[1], float):
        return False
    args = node.args if node.target is aten.sub.Tensor else (node.args[1], node.args[0])
    out = rw.inline(_sub, *args, key="spell_sub")
    out.meta["spelled"] = True
    rw.replace(node, out)
    return True


@rule(aten.neg.default)
def neg_by_inline(node, rw):
    rw.replace(node, rw.inline(lambda x: aten.mul.Tensor(x, -1.0), node.args[0], key="k"))
    return True


@rule(aten.abs.default)
def abs_by_inline(node, rw):
    if node.meta.get("spelled"):
        return False
    spelled = rw.inline(lambda x: aten.abs.default(x), node.args[0], key="k")
    spelled.meta["spelled"] = True
    rw.replace(node, spelled)
    return True


@rule(aten.silu.default, aten.hardswish.default)
def decompose_by_table(node, rw):
    from torch._decomp import decomposition_table

    rw.replace(node, rw.inline(decomposition_table[node.target], node.args[0], key="decomp"))
    return True


@rule(aten.add.Tensor)
def add_by_inline(node, rw):
    if node.meta.get("spelled") or not isinstance(node.args[1], float):
        return False
    out = rw.inline(lambda x, c: aten.add.Tensor(x, c), *node.args[:2], key="add")
    out.meta["spelled"] = True
    rw.replace(node, out)
    return True


@pytest.mark.parametrize("rules, f", [
    ([spell_sub], lambda x: (x - 2.0, 2.0 - x)),
    ([neg_by_inline, abs_by_inline], lambda x: (-x, x.abs())),  # one key, two rules
    # (from the review) torch._decomp's functions share their wrappers' code objects
    ([decompose_by_table], lambda x: (torch.nn.functional.silu(x),
                                      torch.nn.functional.hardswish(x))),
    ([add_by_inline], lambda x: (x + 0.0, x + -0.0)),  # -0.0 == 0.0 as a key, not as a value
])
def test_inline_trace_cache_never_splices_another_call(rules, f):
    gm = trace(f, torch.randn(4))
    x = torch.tensor([-0.0, 0.0, -1.5, 2.0])
    expected = gm(x)
    PassManager(rules).run(gm)
    for got, want in zip(gm(x), expected, strict=True):
        torch.testing.assert_close(got, want)
        assert torch.equal(torch.signbit(got), torch.signbit(want))
