"""constant_pad, unbind_to_select, group_norm, and constant folding through a tuple: the ops
that split MobileNetV2, Swin, ModernBERT and wav2vec2 into several regions."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from fxpass import PassManager
from fxpass.rules import (
    amax_to_max_pool,
    constant_folding,
    constant_pad,
    group_norm,
    max_dim_values,
    unbind_to_select,
)
from fxpass.testing import T, check_rule, traced_graphs

aten = torch.ops.aten


@st.composite
def _pad_cases(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 5)) for _ in range(rank))
    k = draw(st.integers(1, rank))
    # per padded dim (last first): growths, zero, and crops that keep at least one element
    pad = []
    for i in range(k):
        n = shape[rank - 1 - i]
        lo = draw(st.integers(-(n - 1), 3))
        hi = draw(st.integers(-(n - 1 - max(-lo, 0)), 3))
        pad += [lo, hi]
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.int64]))
    value = draw(st.sampled_from([0, 1.5, -2])) if dtype.is_floating_point else draw(
        st.sampled_from([0, 7]))
    return [T(shape, dtype)], {"pad": pad, "value": value}


def test_constant_pad_property():
    # asymmetric ("SAME") pads, crops, several dims, a fill value
    fired = check_rule(
        constant_pad,
        traced_graphs(lambda x, pad, value: aten.constant_pad_nd(x * 2, pad, value), _pad_cases()),
        max_examples=60,
    )
    assert fired >= 40


@st.composite
def _unbind_cases(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 4)) for _ in range(rank))
    return [T(shape)], {"d": draw(st.integers(-rank, rank - 1))}


def test_unbind_to_select_property():
    fired = check_rule(
        unbind_to_select,
        traced_graphs(lambda x, d: [t * 2 for t in torch.unbind(x + 1, d)], _unbind_cases()),
        max_examples=40,
    )
    assert fired >= 30


@st.composite
def _gn_cases(draw):
    g = draw(st.integers(1, 3))
    c = g * draw(st.integers(1, 3))
    spatial = tuple(draw(st.integers(1, 4)) for _ in range(draw(st.integers(0, 2))))
    n = draw(st.integers(1, 2))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    affine = draw(st.booleans())
    specs = [T((n, c, *spatial), dtype)] + ([T((c,), dtype), T((c,), dtype)] if affine else [])
    return specs, {"g": g}


def _gn(x, *wb, g):
    w, b = wb or (None, None)
    n, c = x.shape[:2]
    hw = x.numel() // (n * c)
    out, mean, rstd = aten.native_group_norm(x, w, b, n, c, hw, g, 1e-5)
    return out, mean, rstd


def test_group_norm_property():
    # the op's three outputs (normalized, mean, rstd), with and without the affine, bf16 too
    fired = check_rule(group_norm, traced_graphs(_gn, _gn_cases()), max_examples=40,
                       special_values=False)  # a NaN spreads over a group either way
    assert fired >= 30


def test_weight_norm_of_frozen_weights_folds_through_its_tuple():
    # wav2vec2's positional conv: weight = g * v / ||v||, computed from frozen parameters
    import fxpass

    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 4, 3, padding=1), dim=2)
    x = torch.randn(1, 4, 8)
    (gm,) = fxpass.capture(conv.eval(), x)
    before = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten._weight_norm_interface.default in before
    assert PassManager([constant_folding], check=True).run(gm).rewrites.get("constant_folding")
    after = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten._weight_norm_interface.default not in after
    with torch.no_grad():
        (out,) = gm(*gm.meta["fxpass_example_inputs"])
        torch.testing.assert_close(out, conv(x))


@st.composite
def _restride_cases(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.sampled_from([1, 1, 2, 3])) for _ in range(rank))
    # strides that differ from the contiguous ones only where the size is 1
    contiguous = torch.empty(shape).stride()
    stride = [draw(st.integers(1, 40)) if n == 1 else s
              for n, s in zip(shape, contiguous, strict=True)]
    return [T(shape)], {"stride": stride}


def test_as_strided_view_property():
    from fxpass.rules import as_strided_view

    fired = check_rule(
        as_strided_view,
        traced_graphs(lambda x, stride: torch.as_strided(x * 2, x.shape, stride) + 1,
                      _restride_cases()),
        max_examples=40,
    )
    assert fired >= 30


def test_as_strided_view_leaves_real_restrides_alone():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxpass.rules import as_strided_view

    for fn in (lambda x: torch.as_strided(x, (2, 2), (1, 2)),      # a transpose
               lambda x: torch.as_strided(x, (2,), (1,), 1),        # an offset
               lambda x: torch.as_strided(x, (3,), (1,))):          # a new shape
        with FakeTensorMode() as mode:
            gm = make_fx(fn)(mode.from_tensor(torch.empty(2, 2)))
        assert not PassManager([as_strided_view], check=True).run(gm).rewrites


@st.composite
def _max_dim_cases(draw):
    rank = draw(st.integers(0, 4))
    shape = tuple(draw(st.integers(1, 4)) for _ in range(rank))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.int64]))
    d = draw(st.integers(-max(rank, 1), max(rank, 1) - 1))
    return [T(shape, dtype)], {"d": d, "keep": draw(st.booleans()),
                               "op": draw(st.sampled_from(["max", "min"]))}


def test_max_dim_values_property():
    # values only: both max and min, keepdim both ways, 0-d inputs, NaN/inf/-0 special values
    fired = check_rule(
        max_dim_values,
        traced_graphs(lambda x, d, keep, op: getattr(torch, op)(x * 1, d, keep).values + 0,
                      _max_dim_cases()),
        max_examples=60,
    )
    assert fired >= 40


def test_max_dim_values_leaves_read_indices_alone():
    # the indices are an int64 argmax: the tuple must stay (also when the values are read too)
    fired = check_rule(
        max_dim_values,
        traced_graphs(lambda x, d, keep, op: getattr(torch, op)(x * 1, d, keep),
                      _max_dim_cases()),
        must_fire=False, max_examples=20,
    )
    assert fired == 0


@st.composite
def _amax_cases(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 4)) for _ in range(rank))
    dims = draw(st.lists(st.integers(-rank, rank - 1), min_size=1, max_size=rank,
                         unique_by=lambda d: d % rank))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16]))
    return [T(shape, dtype)], {"dims": dims, "keep": draw(st.booleans()),
                               "op": draw(st.sampled_from(["amax", "amin"]))}


def test_amax_to_max_pool_property():
    # one and several dims (negative too), keepdim both ways, amin, NaN/inf/-0 special values
    fired = check_rule(
        amax_to_max_pool,
        traced_graphs(lambda x, dims, keep, op: getattr(torch, op)(x * 1, dims, keep) + 0,
                      _amax_cases()),
        max_examples=60,
    )
    assert fired >= 50


def test_amax_to_max_pool_skips_integers_and_full_reductions():
    fired = check_rule(
        amax_to_max_pool,
        traced_graphs(lambda x, i: (torch.amax(x * 1) + 0, torch.amax(i + 1, -1) + 0),
                      st.just([T((3, 4)), T((3, 4), torch.int64)]).map(lambda s: (s, {}))),
        must_fire=False, max_examples=5,
    )
    assert fired == 0
