"""``check_rule``: property-test a rule on generated graphs (semantics, idempotence, ending)."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterable
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from torch.fx import GraphModule, Node

from ..passmanager import PassManager
from ..rule import Rule

#: Examples per ``check_rule`` call. Each is a graph run a few times; 100 keeps a typical
#: rule's check to a few seconds and finds bugs that need a rare combination (a shared
#: inner value, a special value where the pattern is).
DEFAULT_EXAMPLES = 100

#: (rtol, atol) per dtype; atol is scaled by the output's magnitude (max(1, max|x|)).
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


#: The IEEE values where rewrites that are equal "in real arithmetic" differ: a rule turning
#: ``maximum(a, b)`` into ``where(a > b, a, b)`` is wrong only on NaN.
SPECIAL_VALUES = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0)


def random_inputs(gm: GraphModule, seed: int, special: bool = False) -> list[torch.Tensor]:
    """Real inputs matching the placeholders' ``meta['val']`` (normal floats, small ints, bools).

    With ``special``, about one float element in four (chosen by ``seed``) is replaced by NaN,
    +-Inf or +-0 (:data:`SPECIAL_VALUES`), and one element of each float input is NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p in gm.graph.find_nodes(op="placeholder"):
        v = p.meta["val"]
        shape = tuple(int(s) for s in v.shape)
        if v.dtype.is_floating_point:
            x = torch.randn(shape, generator=gen, dtype=torch.float32)
            if special and x.numel():
                pick = torch.rand(shape, generator=gen) < 0.25
                which = torch.randint(0, len(SPECIAL_VALUES), shape, generator=gen)
                x = torch.where(pick, torch.tensor(SPECIAL_VALUES)[which], x)
                # one NaN per input for sure: the value rewrites most often get wrong
                x.view(-1)[int(torch.randint(0, x.numel(), (1,), generator=gen))] = math.nan
            out.append(x.to(v.dtype))
        elif v.dtype == torch.bool:
            out.append(torch.randint(0, 2, shape, generator=gen).bool())
        else:
            out.append(torch.randint(0, 5, shape, generator=gen).to(v.dtype))
    return out


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (tuple, list)):
        return [y for e in x for y in _flat(e)]
    return [x]


def assert_outputs_close(
    expected: Any,
    actual: Any,
    tolerance: dict[torch.dtype, tuple[float, float]] | None = None,
    signed_zeros: bool = True,
    computed_in: list[torch.dtype | None] | None = None,
) -> None:
    """Same structure, dtypes and shapes; values within the per-dtype tolerance (NaN == NaN);
    with ``signed_zeros``, zeros in both agree in sign.

    ``computed_in[i]``, when given, is the least precise float dtype output ``i`` was computed
    through (see :func:`computed_in`); its tolerance is used when it is looser than the
    output's own dtype: a float32 result cast to float64 carries float32 rounding.
    """
    tol = {**TOLERANCE, **(tolerance or {})}
    exp, act = _flat(expected), _flat(actual)
    assert len(exp) == len(act), f"output count changed: {len(exp)} -> {len(act)}"
    via = list(computed_in or [])
    for i, (e, a) in enumerate(zip(exp, act, strict=True)):
        if not isinstance(e, torch.Tensor):
            assert e == a, f"output {i}: {e!r} != {a!r}"
            continue
        assert isinstance(a, torch.Tensor), f"output {i}: tensor became {type(a).__name__}"
        assert a.dtype == e.dtype, f"output {i}: dtype changed {e.dtype} -> {a.dtype}"
        assert a.shape == e.shape, f"output {i}: shape changed {tuple(e.shape)} -> {tuple(a.shape)}"
        if not e.dtype.is_floating_point:
            assert torch.equal(e, a), f"output {i}: values differ (exact dtype {e.dtype})"
            continue
        rtol, atol = tol.get(e.dtype, (1e-5, 1e-5))
        if i < len(via) and via[i] is not None:
            rtol, atol = max((rtol, atol), tol.get(via[i], (rtol, atol)))
        finite = e[torch.isfinite(e)].abs()
        scale = max(1.0, float(finite.max())) if finite.numel() else 1.0
        torch.testing.assert_close(
            a,
            e,
            rtol=rtol,
            atol=atol * scale,
            equal_nan=True,
            msg=lambda m, i=i: f"output {i}: {m}",
        )
        # a zero's sign is a value (1 / -0.0 is -inf): where both are exactly zero it must
        # agree (found by a probe: x + 0.0 -> x passed, though aten's -0.0 + 0.0 is +0.0)
        if not signed_zeros:
            continue
        zeros = (e == 0) & (a == 0)
        flipped = zeros & (torch.signbit(e) != torch.signbit(a))
        assert not bool(flipped.any()), (
            f"output {i}: the sign of {int(flipped.sum())} zero(s) changed, first at index "
            f"{tuple(int(v) for v in flipped.nonzero()[0])}: expected "
            f"{float(e[flipped][0])!r}, got {float(a[flipped][0])!r}"
        )


def computed_in(gm: GraphModule) -> list[torch.dtype | None]:
    """Per output of ``gm``, the least precise float dtype of any value it depends on.

    Why: the tolerance must come from the precision the computation ran in, not from the
    dtype it ends in. A rule that turns float32 ``x * sigmoid(x)`` into ``silu(x)`` is right to
    one float32 ulp; if the graph then casts to float64, float64's tolerance would fail it.
    Taken from the graph *before* the rule: a rule that quietly computes in a lower precision
    is still held to the original's.
    """
    rank = {dt: tol[0] for dt, tol in TOLERANCE.items()}

    def looser(a: torch.dtype | None, b: torch.dtype | None) -> torch.dtype | None:
        if a is None or (b is not None and rank.get(b, 0) > rank.get(a, 0)):
            return b
        return a

    loosest: dict[Node, torch.dtype | None] = {}
    for n in gm.graph.nodes:
        d = None
        for v in _flat(n.meta.get("val")):
            if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
                d = looser(d, v.dtype)
        for a in n.all_input_nodes:
            d = looser(d, loosest.get(a))
        loosest[n] = d
    out = next(iter(gm.graph.find_nodes(op="output")))
    return [loosest.get(x) if isinstance(x, Node) else None for x in _flat(out.args[0])]


def check_meta(gm: GraphModule, inputs: list[torch.Tensor]) -> None:
    """Every node's ``meta['val']`` exists and matches the real value's shape and dtype."""

    class _Check(torch.fx.Interpreter):
        def run_node(self, n: Node) -> Any:
            out = super().run_node(n)
            if n.op in ("placeholder", "call_function", "get_attr"):
                assert "val" in n.meta, f"node {n.name} ({n.target}) has no meta['val']"
                for r, f in zip(_flat(out), _flat(n.meta["val"]), strict=False):
                    if isinstance(r, torch.Tensor) and isinstance(f, torch.Tensor):
                        assert r.dtype == f.dtype and tuple(r.shape) == tuple(f.shape), (
                            f"meta['val'] of {n.name} is {f.dtype}{tuple(f.shape)} but the node "
                            f"computes {r.dtype}{tuple(r.shape)}"
                        )
            return out

    _Check(gm).run(*inputs)


def check_rule(
    rule: Rule,
    graphs: st.SearchStrategy[GraphModule] | None = None,
    *,
    around: Any = None,
    with_rules: Iterable[Rule] = (),
    must_fire: bool = True,
    max_examples: int = DEFAULT_EXAMPLES,
    tolerance: dict[torch.dtype, tuple[float, float]] | None = None,
    derandomize: bool | None = None,
    special_values: bool = True,
    signed_zeros: bool = True,
) -> int:
    """Property-test ``rule`` on generated graphs; returns how often it fired.

    Graphs come from ``graphs``, and also, when the rule was built from a pattern
    (:func:`fxpass.pattern.pattern_rule`) or ``around=`` names one, from
    :func:`~fxpass.testing.pattern_graphs` around that pattern (inner values shared with
    other users included). For each graph: run it on random real inputs (on half of the
    examples a quarter of the float elements are NaN, +-Inf or +-0, unless
    ``special_values=False``); run a checked PassManager with ``rule`` (and ``with_rules``) to
    fixpoint (lint, contract checks: every edit must go through the Rewriter, termination via
    the budget); compare outputs, and the inputs the graph writes to, with the per-dtype
    tolerance (a zero's sign included, unless ``signed_zeros=False``: a rule that inlines one of
    torch._decomp's decompositions inherits its signs, relu(-0.0) = +0.0 say); check every
    node's ``meta['val']`` against the real values; run the rule again
    and require that it changes nothing (idempotence). With ``must_fire``, the rule must have
    fired on at least one graph, so the test cannot pass vacuously; with ``must_fire=False``
    the count is returned, so "must not fire here" is ``assert check_rule(...) == 0``.

    Reproducible by default: a fixed seed (``derandomize=True``), the same graphs every run.
    ``FXPASS_HYPOTHESIS_RANDOM=1`` (or ``derandomize=False``) draws new graphs each run, to
    explore. Hypothesis shrinks a failing graph to a minimal one and prints it.
    """
    from .strategies import pattern_graphs

    fired = [0]
    rules = [rule, *with_rules]
    pattern = around if around is not None else rule.pattern
    sources = [g for g in (graphs,) if g is not None]
    if pattern is not None:
        sources.append(pattern_graphs(pattern))
    if not sources:
        raise TypeError(
            f"check_rule({rule.name!r}) needs graphs: pass a strategy (fxpass.testing."
            "aten_graphs(...), traced_graphs(...)) or around=P(...), or build the rule with "
            "fxpass.pattern.pattern_rule"
        )
    if derandomize is None:  # reproducible in CI; FXPASS_HYPOTHESIS_RANDOM=1 explores new cases
        derandomize = os.environ.get("FXPASS_HYPOTHESIS_RANDOM", "") != "1"

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=derandomize,
        # shrink, but skip the "explain" phase: it re-runs failing graphs many more times
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.one_of(sources), st.integers(0, 2**31 - 1), st.sampled_from([False, True]))
    def prop(gm: GraphModule, seed: int, special: bool) -> None:
        special = special and special_values
        inputs = random_inputs(gm, seed, special=special)
        before = copy.deepcopy(gm)
        # each run gets its own copy of the inputs: a graph that writes to an input (a KV
        # cache, say) must leave the same values behind before and after the rule
        ins_before, ins_after = [t.clone() for t in inputs], [t.clone() for t in inputs]
        expected = before(*ins_before)
        report = PassManager(rules, check=True).run(gm)
        fired[0] += report.rewrites.get(rule.name, 0)
        gm.graph.lint()
        check_meta(gm, [t.clone() for t in inputs])
        via = computed_in(before)
        try:
            assert_outputs_close(expected, gm(*ins_after), tolerance, signed_zeros, via)
            try:
                assert_outputs_close(ins_before, ins_after, tolerance, signed_zeros)
            except AssertionError as e:
                msg = f"the rule changed what the graph writes to its inputs: {e}"
                raise AssertionError(msg) from e
        except AssertionError as e:
            if not special:
                raise
            msg = (
                f"{e}\n(on inputs containing NaN/+-Inf/+-0; if rule {rule.name!r} legitimately "
                "differs there, pass special_values=False and say why in the test)"
            )
            raise AssertionError(msg) from e
        again = PassManager([rule], check=True).run(gm)
        assert again.total_rewrites == 0, (
            f"rule {rule.name!r} is not idempotent: fired {again.total_rewrites}x on its own output"
        )

    try:
        prop()
    except Unsatisfiable as e:
        from .strategies import _REJECTED

        why = _REJECTED.get(repr(pattern)) if pattern is not None else None
        hint = (
            f"every generated instance of {pattern!r} failed to type-check; the last error: "
            f"{why}. Give the pattern's leaves a dtype (Var(..., dtype=...)), write constant "
            "arguments into it, or pass graphs= with a strategy that builds valid instances"
            if why
            else "Hypothesis could not generate valid graphs; pass graphs= with a strategy"
        )
        raise AssertionError(f"check_rule({rule.name!r}): {hint}") from e
    if must_fire:
        assert fired[0] > 0, (
            f"rule {rule.name!r} never fired on {max_examples} generated graphs; choose an op "
            "vocabulary where it applies (or pass must_fire=False)"
        )
    return fired[0]
