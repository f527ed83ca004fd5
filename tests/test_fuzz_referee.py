"""The fuzz benchmark's referees accept only what eager itself cannot decide.

``benchmarks.fuzz.referee`` sets differences apart when eager's answer depends on summation
order (an overflowing sum) or moves with a one-ULP change of the inputs. Each test pairs a
case the referee must accept with the nearest case it must refuse: a wrong answer on a huge
value that sums nothing, or a wrong ``cos`` of a well-conditioned argument.
"""

from __future__ import annotations

import torch

from benchmarks.fuzz.check import equals_either, flat
from benchmarks.fuzz.programs import Program, Step, run
from benchmarks.fuzz.referee import (
    explain,
    graph_overflowing_outputs,
    overflowing_outputs,
    unstable_elements,
)


def _prog(dtype: torch.dtype, shape: tuple, steps: list[Step], outputs: list[int],
          weights: list | None = None) -> Program:
    return Program(shape, [(dtype, shape)], weights or [], steps, outputs, [("normal", 0)])


def test_overflowing_matmul_sum_is_order_dependent() -> None:
    # 3e38 - 3e38 + 3e38: the exact result is 3e38, but the positive terms alone add up past
    # float32's maximum, so a kernel that sums them first returns inf.
    x = torch.tensor([[3e38, -3e38, 3e38]])
    w = torch.tensor([[1.0], [1.0], [1.0]])
    prog = _prog(torch.float32, (1, 3), [Step("mm", (0,), 0)], [1], [(torch.float32, (3, 1))])
    assert overflowing_outputs(prog, [x], [w]) == {0}
    expected = run(prog, [x], [w])
    assert torch.isfinite(expected[0]).all()
    wrong = (torch.full_like(expected[0], torch.inf),)
    assert explain(prog, [x], [w], expected, wrong, None) == "overflow_order"


def test_same_matmul_in_range_is_not_excused() -> None:
    x = torch.tensor([[3e37, -3e37, 3e37]])  # the positive terms sum to 6e37: no order overflows
    w = torch.tensor([[1.0], [1.0], [1.0]])
    prog = _prog(torch.float32, (1, 3), [Step("mm", (0,), 0)], [1], [(torch.float32, (3, 1))])
    assert overflowing_outputs(prog, [x], [w]) == set()
    expected = run(prog, [x], [w])
    assert explain(prog, [x], [w], expected, (torch.full_like(expected[0], torch.inf),),
                   None) is None


def test_wrong_elementwise_op_on_huge_value_is_not_excused() -> None:
    # eager hardswish(3e38) is inf; a backend returning 3e38 is wrong, and nothing here sums
    x = torch.tensor([3e38, 1.0])
    prog = _prog(torch.float32, (2,), [Step("hardswish", (0,))], [1])
    expected = run(prog, [x], [])
    got = (torch.tensor([3e38, float(torch.nn.functional.hardswish(torch.tensor(1.0)))]),)
    assert overflowing_outputs(prog, [x], []) == set()
    assert explain(prog, [x], [], expected, got, None) is None


def test_cos_of_huge_bf16_argument_is_ill_conditioned() -> None:
    x = torch.tensor([1e10, 1.0], dtype=torch.bfloat16)
    prog = _prog(torch.bfloat16, (2,), [Step("cos", (0,))], [1])
    expected = run(prog, [x], [])
    moved = unstable_elements(prog, [x], [], expected)
    assert moved is not None and moved[0].tolist() == [True, False]
    wrong_big = (torch.stack([-expected[0][0], expected[0][1]]),)
    assert explain(prog, [x], [], expected, wrong_big, None) == "ill_conditioned"
    wrong_small = (torch.stack([expected[0][0], -expected[0][1]]),)  # cos(1.0) is well defined
    assert explain(prog, [x], [], expected, wrong_small, None) is None


def test_sdpa_control_is_element_wise() -> None:
    # a NaN score: PyTorch's CPU flash kernel zeroes the row, its math kernel returns NaN
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 4, generator=g) for n in (2, 3, 3))
    q[0, 0, 0, 0] = torch.inf
    k[0, 0, :, 0] = 0.0  # inf * 0: every score of query row 0 is NaN
    flash = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    math_ = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, 0.0, False)[0]
    assert flash[0, 0, 0].eq(0).all() and math_[0, 0, 0].isnan().all()
    mixed = flash.clone()
    mixed[0, 0, 0] = math_[0, 0, 0]  # row 0 as math, row 1 as both
    assert equals_either((flash,), (math_,), (mixed,))
    wrong = mixed.clone()
    wrong[0, 0, 1, 0] += 1.0  # a row both kernels agree on, answered wrongly
    assert not equals_either((flash,), (math_,), (wrong,))


def _sdpa_graph() -> torch.fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        args = [torch.empty(1, 2, 3, 4) for _ in range(3)]
        return make_fx(torch.nn.functional.scaled_dot_product_attention)(*args)


def test_attention_scores_summing_past_the_range_are_order_dependent() -> None:
    gm = _sdpa_graph()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(3))
    # scores of query 0, head 0: (3e38 + 3e38 - 3e38 + 3e38) * 0.5, whose positive terms
    # alone pass float32's maximum
    q[0, 0, 0] = torch.tensor([3e38, 3e38, -3e38, 3e38])
    k[0, 0] = 1.0
    (expected,) = flat(gm(q, k, v))
    assert graph_overflowing_outputs(gm, [q, k, v]) == {0}
    wrong = expected.clone()
    wrong[0, 0, 0] = 0.0 if expected[0, 0, 0].isnan().all() else torch.nan
    assert explain(gm, [q, k, v], [], (expected,), (wrong,), None) == "overflow_order"


def test_wrong_attention_on_ordinary_inputs_is_not_excused() -> None:
    gm = _sdpa_graph()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(3))
    (expected,) = flat(gm(q, k, v))
    assert graph_overflowing_outputs(gm, [q, k, v]) == set()
    assert explain(gm, [q, k, v], [], (expected,), (expected + 0.5,), None) is None
