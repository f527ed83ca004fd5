"""constant_pad, unbind_to_select, group_norm, and constant folding through a tuple: the ops
that split MobileNetV2, Swin, ModernBERT and wav2vec2 into several regions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from fxpass import PassManager
from fxpass.rules import (
    amax_to_max_pool,
    constant_folding,
    constant_pad,
    group_norm,
    im2col_to_slices,
    max_dim_values,
    new_full,
    slice_scatter_to_cat,
    unbind_to_select,
)
from fxpass.testing import T, check_rule, trace, traced_graphs

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


@pytest.mark.parametrize("rule, fn, cases, least", [
    # values only: max and min, keepdim both ways, 0-d inputs
    (max_dim_values, lambda x, d, keep, op: getattr(torch, op)(x * 1, d, keep).values + 0,
     _max_dim_cases, 40),
    # one and several dims (negative too), keepdim both ways, amin
    (amax_to_max_pool, lambda x, dims, keep, op: getattr(torch, op)(x * 1, dims, keep) + 0,
     _amax_cases, 50),
], ids=["max_dim_values", "amax_to_max_pool"])
def test_max_reduction_rule_property(rule, fn, cases, least):
    # NaN/inf special values included; a -0.0/0.0 tie may differ in sign (equal numbers), as
    # the rules' docstrings say, which the value comparison accepts
    assert check_rule(rule, traced_graphs(fn, cases()), max_examples=60) >= least


def test_amax_to_max_pool_skips_integers_and_full_reductions():
    fired = check_rule(
        amax_to_max_pool,
        traced_graphs(lambda x, i: (torch.amax(x * 1) + 0, torch.amax(i + 1, -1) + 0),
                      st.just([T((3, 4)), T((3, 4), torch.int64)]).map(lambda s: (s, {}))),
        must_fire=False, max_examples=5,
    )
    assert fired == 0


@st.composite
def _slice_scatter_cases(draw):
    rank = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 5)) for _ in range(rank)]
    d = draw(st.integers(-rank, rank - 1))
    n = shape[d]
    start = draw(st.one_of(st.none(), st.integers(-n - 1, n + 1)))
    end = draw(st.one_of(st.none(), st.integers(-n - 1, n + 1), st.just(2**63 - 1)))
    a = 0 if start is None else min(max(start + n if start < 0 else start, 0), n)
    b = n if end is None else min(max(end + n if end < 0 else end, 0), n)
    src = list(shape)
    src[d] = max(b - a, 0)
    layout = draw(st.sampled_from(["contiguous", "transposed", "gapped"]))
    dtype = draw(st.sampled_from([torch.float32, torch.int64]))
    base = list(shape)
    if layout == "gapped":  # base is a slice of a wider tensor: its layout has gaps
        base[-1] += 2
    return [T(tuple(base), dtype), T(tuple(src), dtype)], {
        "d": d, "start": start, "end": end, "layout": layout, "n_last": shape[-1]}


def _slice_scatter(x, y, d, start, end, layout, n_last):
    base = x * 1
    if layout == "transposed":  # dense but permuted: the rewrite must keep these strides
        base = base.transpose(0, -1).contiguous().transpose(0, -1)
    elif layout == "gapped":
        base = base[..., :n_last]
    return torch.slice_scatter(base, y * 1, d, start, end) * 2


def test_slice_scatter_to_cat_property():
    # negative, None and out-of-range bounds, empty writes, whole-dim writes, three layouts
    fired = check_rule(
        slice_scatter_to_cat,
        traced_graphs(_slice_scatter, _slice_scatter_cases()),
        max_examples=80,
    )
    assert fired >= 50


def test_slice_scatter_keeps_strides_it_cannot_give_a_reader():
    # a gapped result returned as a graph output keeps eager's strides: left alone
    fired = check_rule(
        slice_scatter_to_cat,
        traced_graphs(
            lambda x, y: torch.slice_scatter((x * 1)[:, :3], y * 1, 1, 0, 1),
            st.just(([T((2, 5)), T((2, 1))], {})),
        ),
        must_fire=False, max_examples=3,
    )
    assert fired == 0
    gm = trace(lambda x, y: torch.slice_scatter((x * 1).t(), y * 1, 0, 1, 2),
               torch.empty(2, 3), torch.empty(1, 2))
    PassManager([slice_scatter_to_cat]).run(gm)
    x, y = torch.randn(2, 3), torch.randn(1, 2)
    want = torch.slice_scatter(x.t() * 1, y, 0, 1, 2)
    got = gm(x, y)
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert torch.equal(got, want) and got.stride() == want.stride()


def test_new_full_property():
    fired = check_rule(
        new_full,
        traced_graphs(
            lambda x, kind: {"ones": x.new_ones((2, 3)), "zeros": x.new_zeros((4,)),
                             "full": x.new_full((3, 1), 2.5),
                             "dtype": x.new_ones((2,), dtype=torch.int32)}[kind] + x.sum(),
            st.tuples(st.sampled_from([torch.float32, torch.float16, torch.int64]),
                      st.sampled_from(["ones", "zeros", "full", "dtype"]))
            .map(lambda c: ([T((2, 2), c[0])], {"kind": c[1]})),
        ),
        max_examples=20,
    )
    assert fired >= 10


@st.composite
def _unfold_cases(draw):
    k = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dil = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    pad = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    st_ = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    # big enough for at least one output position
    h = draw(st.integers(max(1, dil[0] * (k[0] - 1) + 1 - 2 * pad[0]), 7))
    w = draw(st.integers(max(1, dil[1] * (k[1] - 1) + 1 - 2 * pad[1]), 7))
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), h, w)
    return [T(shape, dtype)], {"k": k, "dil": dil, "pad": pad, "st": st_}


@pytest.mark.slow  # 3.1 s: the fast tier's budget
def test_im2col_to_slices_property():
    # kernels, dilations, paddings and strides; every output position and channel order
    fired = check_rule(
        im2col_to_slices,
        traced_graphs(lambda x, k, dil, pad, st: torch.nn.functional.unfold(
            x * 1, k, dilation=dil, padding=pad, stride=st) * 2, _unfold_cases()),
        with_rules=[constant_pad],
        max_examples=60,
    )
    assert fired >= 50


_GAPPED = (torch.randn(2, 3, 4), torch.randn(3, 1, 2))


@pytest.mark.parametrize("fn, inputs, rewrites", [
    # a whole-dim write into a transposed base: rewritten, with the base's strides
    (lambda x, y: torch.slice_scatter((x * 1).t(), y * 1, 0).t().reshape(-1) * 1,
     (torch.randn(3, 4), torch.randn(4, 3)), True),
    # gapped results whose strides a later permute + view, or a mul, carries on: left alone
    (lambda x, y: torch.slice_scatter(
        (x * 1).permute(2, 1, 0)[:3], y * 1, 1, 0, 1).permute(2, 1, 0).view(6, 3) + 0,
     _GAPPED, False),
    (lambda x, y: (torch.slice_scatter(
        (x * 1).permute(2, 1, 0)[:3], y * 1, 1, 0, 1) * 2).permute(2, 1, 0).view(6, 3),
     _GAPPED, False),
    # a chain of writes into a gapped base that an as_strided reads: left alone
    (lambda x, y: torch.as_strided(torch.slice_scatter(
        torch.slice_scatter((x * 1)[:, :3], y * 1, 1, 0, 1), y * 2, 1, 2, 3),
        (2, 2), (5, 1), 1) + 0, (torch.randn(2, 5), torch.randn(2, 1)), False),
], ids=["whole-dim permuted", "gapped permuted", "gapped then mul", "chained, as_strided"])
def test_slice_scatter_keeps_layouts_later_ops_read(fn, inputs, rewrites):
    # found by review: each of these raised (view / as_strided) or changed strides
    gm = trace(fn, *(torch.empty_like(t) for t in inputs))
    fired = PassManager([slice_scatter_to_cat], check=True).run(gm).rewrites
    assert ("slice_scatter_to_cat" in fired) == rewrites
    want, got = fn(*inputs), gm(*inputs)
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert torch.equal(want, got) and want.stride() == got.stride()


def test_folded_values_the_graph_returns_are_fresh_each_call():
    # found by review: x.new_zeros(4) returned, folded to a module constant: the caller's
    # in-place += then showed up in every later call's result
    gm = trace(lambda x: (x.new_zeros(4), torch.zeros(3), x * 2), torch.empty(4))
    PassManager([new_full, constant_folding], check=True).run(gm)
    x = torch.randn(4)
    a, z, _ = gm(x)
    a += 1
    z += 1
    b, w, _ = gm(x)
    assert torch.equal(b, torch.zeros(4)) and torch.equal(w, torch.zeros(3))
    assert a.data_ptr() != b.data_ptr()


def test_im2col_left_to_raise_on_integers():
    gm = trace(lambda x: torch.nn.functional.unfold(x, 2) * 1,
               torch.empty(1, 1, 3, 3, dtype=torch.int64))
    assert "im2col_to_slices" not in PassManager([im2col_to_slices]).run(gm).rewrites
