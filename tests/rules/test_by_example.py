"""Patterns by example (pattern_from), alternatives (Or, Maybe), the square canonical form,
erf_gelu as one rule and rms_norm written by example; the guide's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fxpass import PassManager
from fxpass.pattern import ANY, Maybe, Multi, Or, P, Var, pattern_from, pattern_rule
from fxpass.plugins import select_rules
from fxpass.rules import rms_norm, square
from fxpass.testing import check_rule, trace

aten = torch.ops.aten
DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-rule.md"


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_or_matches_either_alternative_and_says_why_neither():
    pat = Or(P(aten.neg.default, Var("x")), P(aten.relu.default, Var("x")))
    for fn in (lambda a: torch.neg(a) + 1, lambda a: torch.relu(a) + 1):
        gm = trace(fn, torch.ones(3))
        root = next(n for n in gm.graph.nodes if n.target in pat.targets)
        assert pat.match(root).x.op == "placeholder"
    gm = trace(lambda a: torch.tanh(a), torch.ones(3))
    (t,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    why = pat.explain(t)
    assert "alternative 0" in why and "alternative 1" in why


def test_maybe_matches_with_and_without_the_cast():
    pat = Maybe(aten._to_copy.default, P(aten.neg.default, Var("x")), dtype=ANY)
    with_cast = trace(lambda a: (-a).to(torch.float64), torch.ones(3))
    without = trace(lambda a: -a, torch.ones(3))
    for gm, target in ((with_cast, aten._to_copy.default), (without, aten.neg.default)):
        root = next(n for n in gm.graph.nodes if n.target is target)
        assert pat.match(root) is not None


def test_pattern_from_is_shape_generic_and_merges_dtypes_as_alternatives():
    p = pattern_from(_rms, (torch.randn(2, 8), torch.randn(8)),
                     (torch.randn(3, 4, 16), torch.randn(16)), nums=["eps"], target="bpu")
    assert isinstance(p, P) and "Num('eps')" in repr(p) and "Var('x')" in repr(p)

    def cast(x, w, eps):
        return _rms(x.float(), w.float(), eps).to(x.dtype)

    bf16 = (torch.randn(2, 8).bfloat16(), torch.randn(8).bfloat16())
    q = pattern_from(cast, (torch.randn(2, 8), torch.randn(8)), bf16, nums=["eps"],
                     target="bpu")
    assert isinstance(q, Or) and len(q.alternatives) == 2  # float32 as is, bf16 with casts


def test_pattern_from_refuses_what_it_cannot_express():
    with pytest.raises(TypeError, match="never reach the graph as a constant"):
        pattern_from(lambda x, eps: x * (eps * 2), (torch.ones(2),), nums=["eps"], rules=[])
    with pytest.raises(TypeError, match="must return one tensor"):
        pattern_from(lambda x: (x + 1, x - 1), (torch.ones(2),), rules=[])
    with pytest.raises(TypeError, match="nums \\['e'\\] are not parameters"):
        pattern_from(lambda x: x + 1, (torch.ones(2),), nums=["e"], rules=[])
    with pytest.raises(TypeError, match="needs exactly one of target= .* and rules="):
        pattern_from(lambda x: x + 1, (torch.ones(2),))  # the core names no default target
    with pytest.raises(TypeError, match="needs exactly one of target="):
        pattern_from(lambda x: x + 1, (torch.ones(2),), target="bpu", rules=[])


def _hardswish(x):  # MobileNetV3's spelling
    return x * torch.nn.functional.relu6(x + 3) / 6


HARDSWISH = pattern_from(_hardswish, (torch.ones(2, 8),), target="bpu")


@pattern_rule(HARDSWISH, default=False)
def hardswish_by_example(rw, m):
    """x * relu6(x + 3) / 6 -> hardswish(x), by example."""
    return rw.call(aten.hardswish.default, m.x)


@pytest.mark.parametrize("spelling", ["relu6", "clamp", "clamp 3.0", "hardtanh 0.0"])
def test_one_traced_pattern_takes_every_equal_number_spelling(spelling):
    """One pattern, not an Or of traces: the numbers of ``torch.clamp(x + 3.0, 0.0, 6.0)``
    equal the traced ``relu6(x + 3)``'s on a float tensor, so their types do not matter."""
    f = {"relu6": _hardswish,
         "clamp": lambda x: x * torch.clamp(x + 3, 0, 6) / 6,
         "clamp 3.0": lambda x: x * torch.clamp(x + 3.0, 0.0, 6.0) / 6.0,
         "hardtanh 0.0": lambda x: x * torch.nn.functional.hardtanh(x + 3, 0.0, 6.0) / 6}[spelling]
    gm = trace(f, torch.randn(2, 8))
    report = PassManager([*select_rules(target="bpu"), hardswish_by_example]).run(gm)
    assert report.rewrites.get("hardswish_by_example") == 1, report.skip_reasons()
    x = torch.randn(2, 8) * 4
    torch.testing.assert_close(gm(x), torch.nn.functional.hardswish(x))


def test_on_integer_tensors_the_traced_number_type_is_kept():
    """``x + 3.0`` on an int64 tensor promotes to float; ``x + 3`` does not: a pattern traced
    with one does not match the other, and the reason names type promotion."""
    pat = pattern_from(lambda x: x + 3, (torch.ones(4, dtype=torch.int64),), target="bpu")
    gm = trace(lambda x: x + 3.0, torch.ones(4, dtype=torch.int64))
    (add,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert pat.match(add) is None and "type promotion" in pat.explain(add)


def test_square_is_one_spelling_and_passes_the_kit():
    from fxpass.testing import aten_graphs

    assert check_rule(square, aten_graphs(ops=["mul", "pow", "neg"], max_ops=5)) > 0
    gm = trace(lambda a, b: a * b + (a * a).int() * 1, torch.ones(3), torch.ones(3))
    PassManager([square]).run(gm)
    assert len(gm.graph.find_nodes(op="call_function", target=aten.pow.Tensor_Scalar)) == 1


@pytest.mark.parametrize("spelling", ["pow2", "pow2.0", "mul"])
def test_rms_norm_matches_every_square_spelling(spelling):
    sq = {"pow2": lambda x: x.pow(2), "pow2.0": lambda x: x ** 2.0, "mul": lambda x: x * x}
    f = sq[spelling]
    gm = trace(lambda x, w: w * (x * torch.rsqrt(f(x).mean(-1, keepdim=True) + 1e-6)),
               torch.randn(2, 8), torch.randn(8))
    rules = select_rules(target="bpu", enable=["rms_norm"])
    assert PassManager(rules).run(gm).rewrites.get("rms_norm") == 1
    x, w = torch.randn(2, 8), torch.randn(8)
    torch.testing.assert_close(gm(x, w), _rms(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rms_norm_finds_every_norm_of_a_captured_hf_model(family, dtype):
    import fxpass
    from fxpass.tools import zoo

    torch._dynamo.reset()  # see test_models: captures in one process share HF's wrapper frame
    model, kw = zoo.get(family, dtype=dtype)
    (gm,) = fxpass.capture(model, **kw)
    report = PassManager(select_rules(target="bpu", enable=["rms_norm"])).run(gm)
    layers = model.config.num_hidden_layers
    per_layer = 4 if family == "qwen3" else 2  # Qwen3 also norms q and k
    assert report.rewrites.get("rms_norm") == per_layer * layers + 1, report.rewrites


def test_rms_norm_passes_check_rule_with_defaults_and_is_off_by_default():
    assert check_rule(rms_norm) > 0
    assert not rms_norm.default
    assert "rms_norm" not in {r.name for r in select_rules(target="bpu")}


def test_the_guides_by_example_rule_runs_and_passes_the_kit():
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
                if "pattern_from(" in b]
    assert len(block.strip().splitlines()) <= 15
    ns: dict = {}
    exec(compile(block, str(DOC), "exec"), ns)
    assert check_rule(ns["my_rms_norm"]) > 0


# ---- multi-output patterns ---------------------------------------------------------------


HALVES = Multi(P(aten.slice.Tensor, Var("x"), Var("dim"), 0, Var("d")),
               P(aten.slice.Tensor, Var("x"), Var("dim"), Var("d"), Var("end")))


def _halves_check(m):
    shape = m.x.meta["val"].shape
    if not (isinstance(m.dim, int) and m.dim % len(shape) == len(shape) - 1):
        return "not the last dim"
    n = shape[-1]
    return (isinstance(m.d, int) and m.end >= n and 2 * m.d == n) or "not two equal halves"


@pattern_rule(HALVES, name="halves_to_split", check=_halves_check)
def halves_to_split(rw, m):
    """x[..., :d], x[..., d:] -> split(x, d, -1): one op, both outputs at once."""
    import operator

    s = rw.call(aten.split.Tensor, m.x, m.d, -1)
    return rw.call(operator.getitem, s, 0), rw.call(operator.getitem, s, 1)


def _rotate_half(x):  # HF's rotary helper: both halves of the last dim
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), -1)


def test_multi_output_pattern_replaces_both_roots_exactly():
    gm = trace(_rotate_half, torch.randn(2, 3, 8))
    report = PassManager([halves_to_split], check=True).run(gm)
    assert report.rewrites == {"halves_to_split": 1}
    assert not gm.graph.find_nodes(op="call_function", target=aten.slice.Tensor)
    x = torch.randn(2, 3, 8)
    assert torch.equal(gm(x), _rotate_half(x))


def test_multi_output_pattern_passes_check_rule():
    from hypothesis import strategies as st

    from fxpass.testing import T, traced_graphs

    specs = st.tuples(st.integers(1, 3), st.sampled_from([2, 4, 8])).map(
        lambda s: ([T((s[0], s[1]))], {}))
    assert check_rule(halves_to_split, traced_graphs(_rotate_half, specs), max_examples=20) > 0


def test_multi_output_single_use_covers_the_whole_match():
    shared_relu = Multi(P(aten.neg.default, P(aten.relu.default, Var("x"), name="r")),
                        P(aten.tanh.default, P(aten.relu.default, Var("x"), name="r")))
    gm = trace(lambda a: (-torch.relu(a), torch.tanh(torch.relu(a))), torch.ones(3))
    PassManager([r for r in select_rules(target="bpu") if r.name == "cse"]).run(gm)
    neg = next(n for n in gm.graph.nodes if n.target is aten.neg.default)
    assert shared_relu.match(neg) is not None  # relu's two users are both roots of the match
    gm2 = trace(lambda a: (-torch.relu(a), torch.tanh(torch.relu(a)), torch.relu(a) * 2),
                torch.ones(3))
    PassManager([r for r in select_rules(target="bpu") if r.name == "cse"]).run(gm2)
    neg2 = next(n for n in gm2.graph.nodes if n.target is aten.neg.default)
    assert "also used by" in shared_relu.explain(neg2)  # a third user outside the match
