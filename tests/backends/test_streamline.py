"""The JIT graph's CPU side streamlined (``fxpass/jit/streamline.py``): cache writes fused,
position ops memoized per value. Every call matches eager (float32: rtol 1e-5, atol 1e-5;
the caches exactly where eager did not write this call), with positions that repeat (memo
hits) and that do not, and a weight changed in place after compile is never met by a stale
memo."""

from __future__ import annotations

import pytest
import torch
from torch.fx import Graph, GraphModule

import fxpass
from fxpass.aot.memo import read_before_written
from fxpass.jit.streamline import streamline

aten = torch.ops.aten


class Step(torch.nn.Module):
    """A decode step in small: position-dependent rotation angles (a frozen buffer times the
    position), a projection, and the new key and value written into two static caches."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 8))
        self.register_buffer("k", torch.zeros(1, 2, 6, 4))
        self.register_buffer("v", torch.zeros(1, 2, 6, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        angle = (pos.float()[:, None] + 1.0) * self.freq  # depends on pos and a weight only
        h = self.proj(x * angle.cos() + angle.sin())
        self.k.index_copy_(2, pos, h[:, :8].reshape(1, 2, 1, 4))
        self.v.index_copy_(2, pos, h[:, 8:].reshape(1, 2, 1, 4))
        return h + self.k.sum() - self.v.mean()


def _check(compiled: Step, eager: Step, positions: list[int]) -> None:
    for p in positions:
        x, pos = torch.randn(1, 8), torch.tensor([p])
        with torch.no_grad():
            want, got = eager(x, pos), compiled(x, pos)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for name in ("k", "v"):
            torch.testing.assert_close(getattr(compiled, name), getattr(eager, name),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["fxpass_ort", "fxpass_bpu"])
def test_memoized_and_fused_step_matches_eager(backend, opts):
    torch.manual_seed(0)
    eager = Step().eval()
    model = Step().eval()
    model.load_state_dict(eager.state_dict())
    before = len(fxpass.compile_reports())
    compiled = torch.compile(model, backend=backend, dynamic=False, options=opts)
    _check(compiled, eager, [0, 3, 0, 5, 3])  # repeats hit the memo
    (report,) = fxpass.compile_reports()[before:]
    assert report.streamlined.get("fused_writes") == 2, str(report)
    assert report.streamlined.get("memoized_ops", 0) >= 3, str(report)
    assert "CPU side streamlined" in str(report)


def test_a_weight_changed_in_place_is_not_met_by_a_stale_memo(opts):
    torch.manual_seed(1)
    eager = Step().eval()
    model = Step().eval()
    model.load_state_dict(eager.state_dict())
    compiled = torch.compile(model, backend="fxpass_ort", dynamic=False, options=opts)
    _check(compiled, eager, [2, 2])
    with torch.no_grad():  # the memoized angles read freq: the guard must rebuild them
        model.freq.mul_(3.0)
        eager.freq.mul_(3.0)
    _check(compiled, eager, [2, 4])  # the stored angles of position 2 were 3x smaller


def _graph(write_first: bool) -> GraphModule:
    g = Graph()
    c = g.placeholder("c")
    if write_first:  # c.add_(1), then a read of c: the read sees the written value
        g.call_function(aten.add_.Tensor, (c, 1))
        out = g.call_function(aten.mul.Tensor, (c, 2))
    else:  # a read of c, then c.copy_(c + 1): the read sees the value the graph started with
        out = g.call_function(aten.mul.Tensor, (c, 2))
        g.call_function(aten.copy_.default, (c, g.call_function(aten.add.Tensor, (c, 1))))
    g.output((out,))
    return GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("write_first", [False, True], ids=["read-then-write", "write-then-read"])
def test_a_written_input_is_a_key_only_if_read_before_its_write(write_first):
    gm = _graph(write_first)
    (c,) = gm.graph.find_nodes(op="placeholder")
    assert read_before_written(c) is not write_first


def _chains() -> GraphModule:
    """Three inputs, each with a chain of three ops of its own (enough to memoize)."""
    g = Graph()
    outs = []
    for name in ("ids", "x", "w"):
        y = g.call_function(aten.add.Tensor, (g.placeholder(name), 1))
        for _ in range(3):
            y = g.call_function(aten.mul.Tensor, (y, 2))
        outs.append(y)
    g.output(tuple(outs))
    return GraphModule(torch.nn.Module(), g)


def test_inputs_that_are_not_keys():
    """A long integer input (a prompt), a float, and a frozen weight are not memo keys; the
    inputs list not matching the graph leaves it untouched. A one-element integer input is a
    key, in the same graph (the control)."""
    long_ids = (torch.zeros(16, dtype=torch.int64), False)
    x, w = (torch.zeros(1), False), (torch.zeros(1, dtype=torch.int64), True)
    assert streamline(_chains(), [long_ids, x, w]) == {}
    assert streamline(_chains(), [long_ids, x]) == {}
    pos = (torch.zeros(1, dtype=torch.int64), False)
    assert streamline(_chains(), [pos, x, w]).get("memoized_ops", 0) >= 3
