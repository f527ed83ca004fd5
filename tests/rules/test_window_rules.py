"""stack_to_cat, roll_to_cat, index_put_to_copy, functional_copy: property tests and the
cases each must leave alone (a sliding-window cache and interleaved rotary need all four)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from fxpass import PassManager
from fxpass.rules import (
    functional_copy,
    index_put_to_copy,
    kv_cache_update,
    roll_to_cat,
    stack_to_cat,
)
from fxpass.testing import T, check_rule, trace, traced_graphs

aten = torch.ops.aten
DTYPES = [torch.float32, torch.float16, torch.int64]


@st.composite
def _shapes(draw, min_rank=1):
    rank = draw(st.integers(min_rank, 4))
    return tuple(draw(st.integers(1, 5)) for _ in range(rank))


@st.composite
def _stack_cases(draw):
    shape, dtype = draw(_shapes(0)), draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 3))
    dim = draw(st.integers(-len(shape) - 1, len(shape)))
    return [T(shape, dtype)] * n, {"dim": dim}


def test_stack_to_cat_property():
    fired = check_rule(
        stack_to_cat,
        traced_graphs(lambda *xs, dim: torch.stack([x * 2 for x in xs], dim), _stack_cases()),
        max_examples=40,
    )
    assert fired >= 20


@st.composite
def _roll_cases(draw):
    shape, dtype = draw(_shapes(0)), draw(st.sampled_from(DTYPES))
    if not shape or draw(st.booleans()):
        return [T(shape, dtype)], {"shifts": draw(st.integers(-7, 7)), "dims": None}
    dims = draw(st.lists(st.integers(-len(shape), len(shape) - 1), min_size=1, max_size=2,
                         unique_by=lambda d: d % len(shape)))
    shifts = [draw(st.integers(-7, 7)) for _ in dims]
    return [T(shape, dtype)], {"shifts": shifts, "dims": dims}


def _roll(x, shifts, dims):
    return torch.roll(x + 1, shifts) if dims is None else torch.roll(x + 1, shifts, dims)


def test_roll_to_cat_property():
    # negative, zero and multiple-of-size shifts; flattened rolls; several dims
    fired = check_rule(roll_to_cat, traced_graphs(_roll, _roll_cases()), max_examples=60)
    assert fired >= 30


def test_roll_by_a_whole_turn_is_a_copy_not_an_alias():
    gm = trace(lambda x: torch.roll(x, 4, 0), torch.empty(4, 2))
    PassManager([roll_to_cat], check=True).run(gm)
    x = torch.randn(4, 2)
    out = gm(x)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


@st.composite
def _put_cases(draw):
    shape = draw(_shapes(1))
    dtype = draw(st.sampled_from(DTYPES))
    d = draw(st.integers(0, len(shape) - 1))
    n = shape[d]
    k = 1
    # one position (the rule's scope), counted from the end or not: start, end, anywhere
    pos = [draw(st.sampled_from([0, n - 1, draw(st.integers(0, n - 1))]))]
    pos = [p - n if draw(st.booleans()) else p for p in pos]
    vshape = list(shape)
    vshape[d] = k
    if draw(st.booleans()):  # broadcast values: a size-1 dim, or fewer leading dims
        vshape = vshape[draw(st.integers(0, d)):]
    return [T(shape, dtype), T(tuple(vshape), dtype)], {"d": d, "pos": pos}


def _put(x, v, d, pos):
    # the functional form AOTAutograd hands over for ``y[:, tensor(pos)] = v``
    return aten.index_put.default(x + 1, [None] * d + [torch.tensor(pos)], v)


def test_index_put_to_copy_property():
    # kv_cache_update turns the index_copy into device ops: both checked together
    fired = check_rule(
        index_put_to_copy, traced_graphs(_put, _put_cases()), with_rules=[kv_cache_update],
        max_examples=60,
    )
    assert fired >= 30




def _fired(gm, rule) -> int:
    return PassManager([rule], check=True).run(gm).rewrites.get(rule.name, 0)


@pytest.mark.parametrize(
    "why, fn, fakes",
    [
        ("accumulate", lambda x, v, i: x.index_put((i,), v, accumulate=True),
         (torch.empty(4), torch.empty(2), torch.empty(2, dtype=torch.long))),
        ("several positions", lambda x, v, i: x.index_put((i,), v),
         (torch.empty(4), torch.empty(2), torch.empty(2, dtype=torch.long))),
        ("two indexed dims", lambda x, v, i: x.index_put((i, i), v),
         (torch.empty(4, 4), torch.empty(2), torch.empty(2, dtype=torch.long))),
        ("a boolean mask", lambda x, v, i: x.index_put((i > 0,), v),
         (torch.empty(4), torch.empty(()), torch.empty(4, dtype=torch.long))),
    ],
)
def test_index_put_left_alone(why, fn, fakes):
    gm = trace(fn, *fakes)
    assert _fired(gm, index_put_to_copy) == 0, why


def test_index_put_out_of_range_still_raises():
    gm = trace(lambda x, v: x.index_put((torch.tensor([-5]),), v),
                torch.empty(4), torch.empty(1))
    assert _fired(gm, index_put_to_copy) == 1
    PassManager([kv_cache_update], check=True).run(gm)
    with pytest.raises((IndexError, RuntimeError)):
        gm(torch.zeros(4), torch.ones(1))


@st.composite
def _copy_cases(draw):
    shape = draw(_shapes(0))
    dtype, sdtype = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(DTYPES))
    sshape = shape[draw(st.integers(0, len(shape))):] if shape else shape
    return [T(shape, dtype), T(sshape, sdtype)], {}


def _copy(dst, src):
    return aten.copy.default(dst, src * 2) + 1


def test_functional_copy_property():
    # same shape, broadcast, and dtype-changing copies
    fired = check_rule(functional_copy, traced_graphs(_copy, _copy_cases()), max_examples=50)
    assert fired >= 25


def test_functional_copy_of_an_input_returned_stays_a_copy():
    # the copy becomes a clone; alias_removal keeps it, since dropping it would return the
    # caller's own tensor
    from fxpass.rules import alias_removal

    gm = trace(lambda d, s: aten.copy.default(d, s), torch.empty(3), torch.empty(3))
    rewrites = PassManager([functional_copy, alias_removal], check=True).run(gm).rewrites
    assert rewrites.get("functional_copy") == 1
    d, s = torch.zeros(3), torch.ones(3)
    out = gm(d, s)
    assert torch.equal(out, s) and out.data_ptr() != s.data_ptr()


def test_functional_copy_of_a_source_written_in_place_keeps_the_old_value():
    from fxpass.rules import alias_removal

    def fn(d, s):
        t = s * 2
        c = aten.copy.default(d, t)
        t.add_(1)  # c must keep the value from before the write
        return c, t

    gm = trace(fn, torch.empty(3), torch.empty(3))
    assert PassManager([functional_copy, alias_removal], check=True).run(gm).rewrites
    c, t = gm(torch.zeros(3), torch.ones(3))
    assert torch.equal(c, torch.full((3,), 2.0)) and torch.equal(t, torch.full((3,), 3.0))
