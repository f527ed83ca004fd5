"""Capability and lowering cannot drift: one table, and whatever the capability accepts lowers.

The sweep compiles real models through ``torch.compile(backend="fxpass_bpu")`` with
``strict=True`` and ``min_compute_macs=0``: a node the capability admits but the lowering
cannot emit makes the region fail to compile, which strict mode raises. Every result is
compared with eager.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpass
from fxpass.backends.bpu.capability import DEVICE_FAMILIES, MARCHES, Capability, march
from fxpass.backends.onnx.lowering import FAMILIES, LOWERINGS, OPS
from tests.conftest import trace

aten = torch.ops.aten
STRICT = {"min_compute_macs": 0, "strict": True, "cache": False}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


# ---- one table -------------------------------------------------------------------------------
def test_every_accepted_op_has_an_emitter_and_every_emitter_a_family() -> None:
    for m in MARCHES.values():
        assert m.ops <= set(LOWERINGS), (m.name, m.ops - set(LOWERINGS))
        assert m.families <= set(FAMILIES)
    device_ops = {t for m in MARCHES.values() for t in m.ops}
    listed = {t for f in DEVICE_FAMILIES for t in FAMILIES[f]}
    assert device_ops == listed
    # vice versa: every emitter is either offloaded by a march or explicitly "unlisted"
    assert set(LOWERINGS) == device_ops | set(FAMILIES["unlisted"])
    assert all(LOWERINGS[t] is op.emit for t, op in OPS.items())


def test_capability_and_lowering_give_the_same_reason() -> None:
    """The lowering's precondition is the capability without the march limits."""
    from fxpass.backends.onnx.lowering import can_lower

    x = torch.randn(2, 3, 9, 9)
    gm = trace(lambda x: F.max_pool2d(x, 3, 2, ceil_mode=True, return_indices=True), x)
    pool = next(n for n in gm.graph.nodes if n.target == aten.max_pool2d_with_indices.default)
    cap = Capability(march("nash-p"))(pool)
    assert cap is not None and cap == can_lower(pool)
    assert "output 1" in cap and "max_pool2d_with_indices" in cap


# ---- issue 9: kept on the CPU with a reason instead of failing to lower ----------------------
class _Front(nn.Module):
    """A linear in front (so there is compute to offload), then ``fn``."""

    def __init__(self, fn: Callable, channels: int) -> None:
        super().__init__()
        self.lin = nn.Linear(channels, channels)
        self.fn = fn

    def forward(self, x: torch.Tensor):
        return self.fn(self.lin(x))


def _compile_matches_eager(fn: Callable, shape: tuple[int, ...], dtype=torch.float32):
    torch.manual_seed(0)
    model = _Front(fn, shape[-1]).to(dtype).eval()
    x = torch.randn(*shape, dtype=dtype)
    with torch.no_grad():
        expected = model(x)
        torch._dynamo.reset()
        got = torch.compile(model, backend="fxpass_bpu", options=STRICT, dynamic=False)(x)
    exp = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    for e, g in zip(exp, got, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        if e.is_floating_point():
            torch.testing.assert_close(g, e, rtol=TOL[dtype], atol=TOL[dtype], equal_nan=True)
        else:
            assert torch.equal(g, e)
    return fxpass.compile_reports()[-1]


_STATS = [torch.rand(4) + 0.5, torch.randn(4), torch.randn(4), torch.rand(4) + 0.5]


def _bn(x: torch.Tensor):
    w, b, mean, var = _STATS
    return torch.native_batch_norm(x, w, b, mean, var, False, 0.1, 1e-5)


@pytest.mark.parametrize(
    ("fn", "shape", "reason"),
    [
        (
            lambda x: F.max_pool1d(x, 3, 2, ceil_mode=True, return_indices=True),
            (2, 4, 8),
            "output 1",
        ),
        (
            lambda x: F.max_pool2d(x, 3, 2, ceil_mode=True, return_indices=True),
            (2, 3, 9, 8),
            "output 1",
        ),
        (_bn, (2, 4, 8), "output 1 of aten._native_batch_norm_legit_no_training"),
    ],
    ids=["max_pool1d_ceil_indices", "max_pool2d_ceil_indices", "native_batch_norm_all_outputs"],
)
def test_unlowerable_tuple_outputs_stay_on_cpu_with_a_reason(fn, shape, reason) -> None:
    report = _compile_matches_eager(fn, shape)
    assert any(reason in why for why in report.cpu_reasons), report.cpu_reasons
    assert report.regions and all(r.executor != "eager" for r in report.regions)


# ---- the sweep: accepted => lowers (and matches eager) ---------------------------------------
def _pool_variants():
    for ceil in (False, True):
        for pad in (0, 1):
            for dil in (1, 2):
                yield (
                    f"max_pool2d-ceil{ceil}-pad{pad}-dil{dil}",
                    lambda x, c=ceil, p=pad, d=dil: F.max_pool2d(x, 3, 2, p, d, ceil_mode=c),
                    (1, 2, 9, 8),
                )
            yield (
                f"max_pool1d-ceil{ceil}-pad{pad}",
                lambda x, c=ceil, p=pad: F.max_pool1d(x, 3, 2, p, ceil_mode=c),
                (2, 3, 8),
            )
            for cip in (False, True):
                for div in (None, 3):
                    yield (
                        f"avg_pool2d-ceil{ceil}-pad{pad}-cip{cip}-div{div}",
                        lambda x, c=ceil, p=pad, i=cip, v=div: F.avg_pool2d(
                            x, 3, 2, p, ceil_mode=c, count_include_pad=i, divisor_override=v
                        ),
                        (1, 2, 9, 8),
                    )
            yield (
                f"avg_pool1d-ceil{ceil}-pad{pad}",
                lambda x, c=ceil, p=pad: F.avg_pool1d(x, 3, 2, p, ceil_mode=c),
                (2, 3, 8),
            )
    for out in ((1, 1), (2, 2), (3, 3)):
        yield (
            f"adaptive_avg_pool2d-{out}",
            lambda x, o=out: F.adaptive_avg_pool2d(x, o),
            (1, 2, 6, 8),
        )
    yield "max_pool2d-indices", lambda x: F.max_pool2d(x, 2, return_indices=True), (1, 2, 8, 8)


def _other_variants():
    w, wg, wt = torch.randn(4, 2, 3, 3), torch.randn(4, 1, 3, 3), torch.randn(2, 3, 3, 3)
    yield "conv-dil2-pad1", lambda x: F.conv2d(x, w, padding=1, dilation=2), (1, 2, 9, 8)
    yield "conv-groups", lambda x: F.conv2d(x, wg, groups=2), (1, 2, 9, 8)
    yield "conv_transpose", lambda x: F.conv_transpose2d(x, wt), (1, 2, 5, 8)
    yield "batch_norm-eval", lambda x: F.batch_norm(x, torch.zeros(3), torch.ones(3)), (2, 3, 8)
    yield (
        "batch_norm-train",
        lambda x: F.batch_norm(x, torch.zeros(3), torch.ones(3), training=True),
        (2, 3, 8),
    )
    yield (
        "native_layer_norm-stats",
        lambda x: torch.native_layer_norm(x, [8], None, None, 1e-5),
        (2, 3, 8),
    )
    yield "div-floor", lambda x: torch.div(x, 0.7, rounding_mode="floor"), (2, 8)
    yield "div-trunc", lambda x: torch.div(x, x.flip(-1), rounding_mode="trunc"), (2, 8)
    yield "gelu-tanh", lambda x: F.gelu(x, approximate="tanh"), (2, 8)
    yield "hardtanh", lambda x: F.hardtanh(x, -0.5, 0.5), (2, 8)
    yield "log_softmax", lambda x: F.log_softmax(x, -1), (2, 8)
    yield "max-dim", lambda x: x.max(dim=-1), (2, 8)
    yield "topk", lambda x: torch.topk(x, 2), (2, 8)
    yield "split", lambda x: x.split([3, 5], dim=-1), (2, 8)


VARIANTS = [*_pool_variants(), *_other_variants()]


@pytest.mark.parametrize(("fn", "shape"), [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_whatever_the_capability_accepts_lowers(fn, shape) -> None:
    _compile_matches_eager(fn, shape)


@pytest.mark.parametrize(
    "name", ["max_pool2d-ceilTrue-pad1-dil1", "avg_pool2d-ceilTrue-pad1-cipFalse-divNone"]
)
def test_float16_variants_lower(name) -> None:
    fn, shape = next(v[1:] for v in VARIANTS if v[0] == name)
    _compile_matches_eager(fn, shape, torch.float16)


def test_dead_tuple_elements_do_not_block_offload() -> None:
    x = torch.randn(1, 2, 8, 8)
    gm = trace(lambda x: F.max_pool2d(x, 2), x)
    cap = Capability(march("nash-p"))
    assert all(cap(n) is None for n in gm.graph.nodes if n.op == "call_function")
    assert any(n.target is operator.getitem for n in gm.graph.nodes)
