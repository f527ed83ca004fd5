"""sum_to_mean, vector_norm, clamp_to_hardtanh, erf_gelu: float reductions and activations in
the forms the BPU table has (they split WavLM, Swin v2, ConvNeXt V2 and ESM)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import strategies as st

from fxpass import PassManager
from fxpass.rules import (
    clamp_to_hardtanh,
    erf_gelu,
    sum_to_mean,
    vector_norm,
)
from fxpass.testing import T, check_rule, trace, traced_graphs

aten = torch.ops.aten


@st.composite
def _reduce_cases(draw, dtypes=(torch.float32, torch.float64)):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 5)) for _ in range(rank))
    dims = draw(st.lists(st.integers(-rank, rank - 1), min_size=1, max_size=rank,
                         unique_by=lambda d: d % rank))
    return [T(shape, draw(st.sampled_from(dtypes)))], {
        "dims": dims, "keepdim": draw(st.booleans())}


def test_sum_to_mean_property():
    fired = check_rule(
        sum_to_mean,
        traced_graphs(lambda x, dims, keepdim: torch.sum(x * 2, dims, keepdim), _reduce_cases()),
        max_examples=50,
    )
    assert fired >= 40


def test_vector_norm_property():
    # with sum_to_mean, as the target runs them: the norm ends as sqrt(mean(x * x) * n)
    fired = check_rule(
        vector_norm,
        traced_graphs(lambda x, dims, keepdim: torch.linalg.vector_norm(x + 1, 2, dims, keepdim),
                      _reduce_cases()),
        with_rules=[sum_to_mean], max_examples=50,
    )
    assert fired >= 40




@pytest.mark.parametrize(
    "why, fn, x",
    [
        ("an integer sum", lambda x: x.sum(0), torch.empty(3, dtype=torch.int64)),
        ("a bf16 sum", lambda x: x.sum(0), torch.empty(3, dtype=torch.bfloat16)),
        ("a full reduction", lambda x: x.sum(), torch.empty(3)),
        ("an empty reduction", lambda x: x.sum(0), torch.empty(0, 3)),
        ("a 1-norm", lambda x: torch.linalg.vector_norm(x, 1, [0]), torch.empty(3)),
    ],
)
def test_reductions_left_alone(why, fn, x):
    gm = trace(fn, x)
    assert not PassManager([sum_to_mean, vector_norm], check=True).run(gm).rewrites, why


@st.composite
def _clamp_cases(draw):
    shape = tuple(draw(st.integers(1, 4)) for _ in range(draw(st.integers(0, 3))))
    lo = draw(st.sampled_from([None, -1.0, 0, 1e-12]))
    hi = draw(st.sampled_from([None, 0.5, 2]))
    if lo is None and hi is None:
        lo = 0
    kind = draw(st.sampled_from(["clamp", "min", "max"]))
    return [T(shape, draw(st.sampled_from([torch.float32, torch.float16])))], {
        "lo": lo, "hi": hi, "kind": kind}


def _clamp(x, lo, hi, kind):
    y = x * 3
    if kind == "min" and lo is not None:
        return torch.clamp_min(y, lo)
    if kind == "max" and hi is not None:
        return torch.clamp_max(y, hi)
    return torch.clamp(y, lo, hi) if lo is None or hi is None or lo <= hi else y


def test_clamp_to_hardtanh_property():
    # NaN and +-Inf inputs included (check_rule's special values): hardtanh passes them as clamp
    fired = check_rule(clamp_to_hardtanh, traced_graphs(_clamp, _clamp_cases()), max_examples=50)
    assert fired >= 35


def test_clamp_left_alone_on_integers_and_tensor_bounds():
    gm = trace(lambda x: x.clamp(0, 3), torch.empty(3, dtype=torch.int64))
    assert not PassManager([clamp_to_hardtanh], check=True).run(gm).rewrites
    gm = trace(lambda x, b: x.clamp(b), torch.empty(3), torch.empty(3))
    assert not PassManager([clamp_to_hardtanh], check=True).run(gm).rewrites


SPELLINGS = [
    lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),  # ESM's gelu
    lambda x: 0.5 * x * (1 + torch.erf(x * 0.7071067811865476)),
    lambda x: x * 0.5 * (torch.erf(x / math.sqrt(2.0)) + 1.0),
]


@st.composite
def _gelu_cases(draw):
    shape = tuple(draw(st.integers(1, 5)) for _ in range(draw(st.integers(0, 3))))
    return [T(shape, draw(st.sampled_from([torch.float32, torch.float64])))], {
        "k": draw(st.integers(0, len(SPELLINGS) - 1)), "shared": draw(st.booleans())}


def _spelled(x, k, shared):
    y = x * 2
    g = SPELLINGS[k](y)
    return (g, y * 0.5) if shared else g  # an inner value also used outside the match


def test_erf_gelu_property():
    # special_values=False: at +inf aten's gelu kernel gives NaN where the spelled-out formula
    # gives inf (the rule's docstring); test_erf_gelu_differs_only_at_plus_inf pins exactly that
    fired = check_rule(erf_gelu, traced_graphs(_spelled, _gelu_cases()), max_examples=40,
                       special_values=False)
    assert fired >= 8  # all three spellings are one rule's (Or of x / sqrt(2), x * sqrt(0.5))


def test_erf_gelu_differs_only_at_plus_inf():
    gm = trace(lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))), torch.empty(5))
    x = torch.tensor([-math.inf, math.nan, -0.0, 3.0, math.inf])
    spelled = gm(x)
    PassManager([erf_gelu], check=True).run(gm)
    torch.testing.assert_close(gm(x)[:4], spelled[:4], equal_nan=True)
    assert spelled[4] == math.inf and math.isnan(gm(x)[4])  # aten.gelu(+inf) is NaN on CPU


@pytest.mark.parametrize("fn", SPELLINGS)
def test_erf_gelu_finds_the_spellings_and_matches_gelu(fn):
    gm = trace(lambda x: fn(x + 1), torch.empty(4, 8))
    rewrites = PassManager([erf_gelu], check=True).run(gm).rewrites
    assert sum(rewrites.values()) == 1, rewrites
    assert any(n.target is aten.gelu.default for n in gm.graph.nodes)
    x = torch.randn(4, 8)
    torch.testing.assert_close(gm(x), torch.nn.functional.gelu(x + 1))


def test_erf_gelu_leaves_other_constants_alone():
    gm = trace(lambda x: x * 0.5 * (1.0 + torch.erf(x / 2.0)), torch.empty(4))
    assert not PassManager([erf_gelu], check=True).run(gm).rewrites


def test_erf_gelu_stays_out_of_reports_of_graphs_without_erf():
    # every mul(add, w) would otherwise be a near miss in the report (the demo's Qwen3 had 20)
    gm = trace(lambda x, w: (x + 1) * w * 0.5, torch.empty(4), torch.empty(4))
    report = PassManager([erf_gelu], check=True).run(gm)
    assert not report.rewrites and not report.skips, report.skips
