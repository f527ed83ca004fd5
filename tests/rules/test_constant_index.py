"""constant_index: advanced indexing with literal positions becomes slices and a cat."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from fxpass import PassManager
from fxpass.rules import constant_index
from fxpass.testing import T, check_rule, trace, traced_graphs

aten = torch.ops.aten


@st.composite
def _cases(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(rank))
    d = draw(st.integers(0, rank - 1))
    n = shape[d]
    # runs, repeats, reversed order, negative positions (Falcon's qkv[..., [-2]])
    pos = draw(st.lists(st.integers(-n, n - 1), min_size=1, max_size=6))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    return [T(shape, dtype)], {"d": d, "pos": pos}


def _index(x, d, pos):
    return (x * 2)[(slice(None),) * d + (torch.tensor(pos),)]


def test_constant_index_property():
    fired = check_rule(constant_index, traced_graphs(_index, _cases()), max_examples=60)
    assert fired >= 40


@st.composite
def _select_cases(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(rank))
    d = draw(st.integers(-rank, rank - 1))
    n = shape[d]
    # runs (XLNet's arange), strides, repeats, any order; index_select has no negative positions
    pos = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=6))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    return [T(shape, dtype)], {"d": d, "pos": pos}


def test_constant_index_select_property():
    fired = check_rule(
        constant_index,
        traced_graphs(lambda x, d, pos: torch.index_select(x * 2, d, torch.tensor(pos)),
                      _select_cases()),
        max_examples=60,
    )
    assert fired >= 40


def test_index_select_with_a_negative_position_is_left_to_raise():
    gm = trace(lambda x: torch.index_select(x, 0, torch.tensor([0, -1])), torch.empty(4))
    report = PassManager([constant_index], check=True).run(gm)
    assert "constant_index" not in report.rewrites
    # skipped for the range, not because the positions were not seen as constants
    assert any("out of range" in why for _, _, why in report.skips), report.skips




def _fired(gm) -> int:
    return PassManager([constant_index], check=True).run(gm).rewrites.get("constant_index", 0)


@pytest.mark.parametrize(
    "why, fn, fakes",
    [
        ("run-time positions", lambda x, i: x[i],
         (torch.empty(4), torch.empty(2, dtype=torch.long))),
        ("2-D positions", lambda x: x[torch.tensor([[0, 1]])], (torch.empty(4),)),
        ("two indexed dims", lambda x: x[torch.tensor([0, 1]), torch.tensor([1, 0])],
         (torch.empty(3, 3),)),
        ("more than MAX_RUNS runs, no stride, no repeat",
         lambda x: x[torch.tensor([0, 2, 5, 7, 9, 12, 14, 16, 18, 1])], (torch.empty(20),)),
    ],
)
def test_left_alone(why, fn, fakes):
    assert _fired(trace(fn, *fakes)) == 0, why


def test_single_slice_result_is_a_copy_not_a_view():
    gm = trace(lambda x: x[torch.tensor([1, 2])], torch.empty(4))
    assert _fired(gm) == 1
    x = torch.arange(4.0)
    out = gm(x)
    assert torch.equal(out, torch.tensor([1.0, 2.0]))
    out.add_(10)
    assert torch.equal(x, torch.arange(4.0))


@st.composite
def _grid_cases(draw):
    """x[:, :, rows[:, None], cols]: nearest up/downsampling and other outer-product gathers."""
    h, w = draw(st.integers(1, 5)), draw(st.integers(1, 5))

    def positions(n):
        kind = draw(st.sampled_from(["repeat", "stride", "any", "run"]))
        if kind == "repeat":
            return [i // 2 for i in range(2 * n)]  # nearest x2 upsampling
        if kind == "stride":
            return list(range(0, n, 2))  # nearest /2 downsampling
        if kind == "run":
            a = draw(st.integers(0, n - 1))
            return list(range(a, n))
        return draw(st.lists(st.integers(-n, n - 1), min_size=1, max_size=6))

    dtype = draw(st.sampled_from([torch.float32, torch.int64]))
    return [T((1, 2, h, w), dtype)], {"rows": positions(h), "cols": positions(w),
                                     "unsafe": draw(st.booleans())}


def _grid(x, rows, cols, unsafe):
    op = aten._unsafe_index.Tensor if unsafe else aten.index.Tensor
    return op(x * 2, [None, None, torch.tensor(rows)[:, None], torch.tensor(cols)])


def test_outer_product_gathers_property():
    fired = check_rule(constant_index, traced_graphs(_grid, _grid_cases()), max_examples=60)
    assert fired >= 30


def test_an_index_that_is_not_an_outer_product_is_left_alone():
    # rows and cols both vary along the same axis: a diagonal, not a grid
    gm = trace(lambda x: x[:, torch.tensor([0, 1]), torch.tensor([1, 0])],
                torch.empty(1, 2, 2))
    assert _fired(gm) == 0


def test_nearest_upsampling_between_convs_is_one_region():
    import fxpass

    class Neck(torch.nn.Module):  # an FPN / YOLO neck step
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.b = torch.nn.Conv2d(8, 8, 3, padding=1)
            self.up = torch.nn.Upsample(scale_factor=2, mode="nearest")

        def forward(self, x):
            return self.b(self.up(torch.relu(self.a(x))))

    model, x = Neck().eval(), torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        expected = model(x)
        got = torch.compile(model, backend="fxpass_bpu", options={"min_compute_macs": 0})(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    report = fxpass.compile_reports()[-1]
    assert len(report.regions) == 1, str(report)


@pytest.mark.parametrize("case", ["one position repeated", "runs of a channels-last input"])
def test_result_is_a_new_tensor_laid_out_as_eager(case):
    # found by review: [2, 2, 2] became a stride-0 view of x (aliasing it; a later view
    # raised), and a cat of a channels-last input kept channels-last where eager's is contiguous
    if case == "one position repeated":
        fn, x = (lambda x: torch.index_select(x * 1, 0, torch.tensor([2, 2, 2]))), torch.randn(4, 5)
    else:
        fn = lambda x: torch.index_select(  # noqa: E731
            x.contiguous(memory_format=torch.channels_last) * 1, 1, torch.tensor([0, 1, 4, 5]))
        x = torch.randn(2, 6, 3, 3)
    gm = trace(lambda x: fn(x).view(-1) * 1, torch.empty_like(x))
    assert _fired(gm) == 1
    got = gm(x)
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert torch.equal(got, fn(x).reshape(-1) * 1)
    gm2 = trace(fn, torch.empty_like(x))
    PassManager([constant_index]).run(gm2)
    out = gm2(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert out.stride() == fn(x).stride() and out.untyped_storage().data_ptr() != \
        x.untyped_storage().data_ptr()
