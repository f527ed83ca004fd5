"""constant_index: advanced indexing with literal positions becomes slices and a cat."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from fxpass import PassManager
from fxpass.rules import constant_index
from fxpass.testing import T, check_rule, traced_graphs

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


def _trace(fn, *fakes):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode() as mode:
        return make_fx(fn)(*[mode.from_tensor(f) for f in fakes])


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
        ("more than MAX_RUNS runs", lambda x: x[torch.tensor(list(range(0, 20, 2)))],
         (torch.empty(20),)),
    ],
)
def test_left_alone(why, fn, fakes):
    assert _fired(_trace(fn, *fakes)) == 0, why


def test_single_slice_result_is_a_copy_not_a_view():
    gm = _trace(lambda x: x[torch.tensor([1, 2])], torch.empty(4))
    assert _fired(gm) == 1
    x = torch.arange(4.0)
    out = gm(x)
    assert torch.equal(out, torch.tensor([1.0, 2.0]))
    out.add_(10)
    assert torch.equal(x, torch.arange(4.0))
