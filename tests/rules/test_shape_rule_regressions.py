"""Cases an independent review found in the shape rules (roll, pad, index, index_put, copy,
group norm) and the recompile warning: each failed before its fix (a wrong value, an output
aliasing an input, a crash, a later view failing on other strides, a misread guard)."""

from __future__ import annotations

import pytest
import torch

from fxpass import PassManager
from fxpass.rules import (
    alias_removal,
    constant_index,
    constant_pad,
    functional_copy,
    group_norm,
    index_put_to_copy,
    kv_cache_update,
    roll_to_cat,
)
from fxpass.testing import trace

aten = torch.ops.aten




def _flat(x):
    return [t for e in x for t in _flat(e)] if isinstance(x, tuple | list) else [x]


def _same_as_eager(fn, rules, *inputs):
    """Rewrite fn's graph with ``rules``; outputs equal eager's, none aliases an input.
    Returns the rewrites made."""
    gm = trace(fn, *inputs)
    report = PassManager(rules, check=True).run(gm)
    expected = _flat(fn(*[i.clone() for i in inputs]))
    got = _flat(gm(*[i.clone() for i in inputs]))
    ins = [i.clone() for i in inputs]
    outs = _flat(gm(*ins))
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    for o in outs:
        for i in ins:
            assert o.untyped_storage().data_ptr() != i.untyped_storage().data_ptr()
    return report.rewrites


def test_a_literal_written_in_place_is_not_read_as_the_constant():
    def fn(x):
        c = torch.tensor([0, 2])
        c[0] = 3
        return x[:, c]

    _same_as_eager(fn, [constant_index], torch.arange(16.0).view(2, 8))


@pytest.mark.parametrize(
    "name, fn, shapes",
    [
        ("a view of the copy returned", lambda d, s: aten.copy.default(d, s).view(-1),
         [(2, 3), (2, 3)]),
        ("a view of an input copied", lambda d, s: aten.copy.default(d, s[0]), [(3,), (2, 3)]),
        ("the copy written through a view",
         lambda d, s: (lambda t: (lambda c: (c[0].add_(1), c, t)[1:])(aten.copy.default(d, t)))(
             s * 2), [(3,), (3,)]),
        ("the source written after the copy",
         lambda d, s: (lambda t: (lambda c: (t[0].add_(1), c, t)[1:])(aten.copy.default(d, t)))(
             s * 2), [(3,), (3,)]),
    ],
)
def test_functional_copy_never_aliases(name, fn, shapes):
    inputs = [torch.randn(s) for s in shapes]
    assert _same_as_eager(fn, [functional_copy, alias_removal], *inputs).get("functional_copy")


def test_a_crop_only_pad_is_a_copy():
    fn = lambda x: aten.constant_pad_nd(x, [-1, 0]).add_(100)  # noqa: E731
    assert _same_as_eager(fn, [constant_pad], torch.randn(2, 4)).get("constant_pad")


def test_index_put_with_an_int32_position_runs():
    fn = lambda x, v: aten.index_put(x, [None, torch.tensor([1], dtype=torch.int32)], v)  # noqa: E731
    rewrites = _same_as_eager(fn, [index_put_to_copy, kv_cache_update], torch.randn(2, 3),
                              torch.randn(2, 1))
    assert rewrites.get("index_put_to_copy")


@pytest.mark.parametrize(
    "rule, fn",
    [
        (functional_copy, lambda x, s: aten.copy.default(x.t(), s * 2).t().reshape(-1)),
        (constant_index, lambda x, s: x.t()[:, torch.tensor([0, 1])].view(-1)),
        (roll_to_cat, lambda x, s: torch.roll(x.t(), 4, 0).view(-1)),
        (roll_to_cat, lambda x, s: torch.roll(x.t(), 1)),  # flattened, non-contiguous input
    ],
)
def test_later_views_keep_working_on_non_contiguous_inputs(rule, fn):
    _same_as_eager(fn, [rule], torch.randn(3, 4), torch.randn(4, 3))


def test_group_norm_leaves_empty_and_mixed_dtype_inputs_alone():
    empty = trace(lambda x: aten.native_group_norm(x, None, None, 0, 4, 3, 2, 1e-5)[0],
                   torch.empty(0, 4, 3))
    assert not PassManager([group_norm], check=True).run(empty).rewrites
    mixed = trace(lambda x, w: aten.native_group_norm(x, w, w, 1, 4, 3, 2, 1e-5),
                   torch.empty(1, 4, 3, dtype=torch.bfloat16), torch.empty(4))
    assert not PassManager([group_norm], check=True).run(mixed).rewrites


@pytest.mark.parametrize(
    "reason, expected",
    [
        ("0/1: kwargs['past_key_values'].layers[0].cumulative_length_int == 8  # is_full",
         ("0", "kwargs['past_key_values'].layers[0].cumulative_length_int")),
        ("3/2: c.n == -1", ("3", "c.n")),
        ("0/0: L['scale'] == 0.5  # a float", None),
        ("0/0: len(L['args']) == 2", None),
        ("0/0: L['x'].size()[0] == 4", None),
        ("tensor 'kwargs['input_ids']' size mismatch at index 1. expected 8, actual 1", None),
    ],
)
def test_recompile_reasons_are_read_as_python_ints_only(monkeypatch, reason, expected):
    import torch._dynamo.utils as du

    from fxpass.hf import generation

    class Metrics:
        _metrics = {"recompile_reason": reason}

        def in_progress(self):
            return True

    monkeypatch.setattr(du, "get_metrics_context", lambda: Metrics())
    assert generation.recompiled_int() == expected


def test_alias_removal_keeps_a_clone_of_a_view_of_an_input():
    # s[0].clone() returned: dropping the clone returned a view of the caller's tensor
    assert not _same_as_eager(lambda s: s[0].clone(), [alias_removal], torch.randn(2, 3))
