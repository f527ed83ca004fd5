"""The graph's own torch ops run on one thread when they are light (``runtime.TorchThreads``).

Why: torch's OpenMP workers spin for milliseconds after a parallel op, on the cores the next
host region's onnxruntime workers need. Observed here from inside the graph: the thread count
torch has while a region runs, and the caller's count after the call.
"""

from __future__ import annotations

import os

import pytest
import torch

import fxpass
import fxpass.backends.onnx.host.ort as ort
import fxpass.jit.runtime as rt


class Light(torch.nn.Module):
    """An embedding (CPU: no MACs) feeding a matmul (the region)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(self.emb(ids)))


class Heavy(torch.nn.Module):
    """A small region beside a float64 product the BPU cannot take: most MACs on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.small = torch.nn.Linear(16, 16)
        self.big = torch.nn.Parameter(torch.randn(256, 256, dtype=torch.float64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(self.small(x)), torch.tanh(y @ self.big)


def _threads_seen_by_regions(monkeypatch, fn, *args):
    seen = []
    real = rt.RegionCall.forward

    def spy(self, *tensors):
        seen.append(torch.get_num_threads())
        return real(self, *tensors)

    monkeypatch.setattr(rt.RegionCall, "forward", spy)
    return fn(*args), seen


def _light(opts: dict, **extra):
    """``Light``, token ids for it, and the model compiled with ``opts`` and ``extra``."""
    m = Light().eval()
    c = torch.compile(m, backend="fxpass_bpu", dynamic=False, options={**opts, **extra})
    return m, torch.randint(0, 50, (4, 64)), c


@pytest.fixture
def two_threads():
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(prev)


def test_light_cpu_ops_run_on_one_thread_and_the_callers_count_is_restored(
        opts, monkeypatch, two_threads):
    m, ids, c = _light(opts)
    with torch.no_grad():
        got, seen = _threads_seen_by_regions(monkeypatch, c, ids)
        torch.testing.assert_close(got, m(ids), rtol=1e-5, atol=1e-5)
    assert seen and set(seen) == {1}, seen
    assert torch.get_num_threads() == 2
    (report,) = fxpass.compile_reports()
    assert any("run on 1 thread" in n for n in report.notes), report.notes


def test_cpu_threads_option_sets_the_count(opts, monkeypatch, two_threads):
    n = min(2, os.cpu_count() or 1)
    m, ids, c = _light(opts, cpu_threads=n)
    torch.set_num_threads(1)  # the option, not the caller's count, decides inside
    with torch.no_grad():
        got, seen = _threads_seen_by_regions(monkeypatch, c, ids)
        torch.testing.assert_close(got, m(ids), rtol=1e-5, atol=1e-5)
    assert seen and set(seen) == {n}, seen
    assert torch.get_num_threads() == 1


def test_heavy_cpu_ops_keep_torchs_thread_count(opts, monkeypatch, two_threads):
    m = Heavy().eval()
    x, y = torch.randn(8, 16), torch.randn(64, 256, dtype=torch.float64)
    with torch.no_grad():
        c = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)
        got, seen = _threads_seen_by_regions(monkeypatch, c, x, y)
        want = m(x, y)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
    (report,) = fxpass.compile_reports()
    assert report.regions and report.macs - report.offloaded_macs > report.offloaded_macs
    assert seen and set(seen) == {2}, seen


def test_cpu_threads_option_is_validated(opts):
    from fxpass.jit.options import from_options as validate_options

    with pytest.raises(TypeError, match="cpu_threads.*between 1 and"):
        validate_options({**opts, "cpu_threads": 0}, "bpu")


def test_a_region_that_failed_runs_its_eager_graph_on_the_callers_threads(
        opts, monkeypatch, two_threads):
    """From the review: the failed region's eager graph (the heavy work) stayed on one thread."""
    m, ids, c = _light(opts)
    with torch.no_grad():
        c(ids)

        def broken(self, *tensors):
            raise RuntimeError("injected executor failure")

        for cls in (ort.OrtExecutor, ort.TieredExecutor):
            monkeypatch.setattr(cls, "__call__", broken)
        with pytest.warns(rt.RegionFallbackWarning, match="injected"):
            c(ids)  # fails inside the one-thread call, falls back
        seen = []
        real = rt.RegionCall._eager

        def eager(self):
            g = real(self)
            return lambda *a: (seen.append(torch.get_num_threads()), g(*a))[1]

        monkeypatch.setattr(rt.RegionCall, "_eager", eager)
        got = c(ids)
    torch.testing.assert_close(got, m(ids), rtol=1e-5, atol=1e-5)
    assert seen == [2], seen
