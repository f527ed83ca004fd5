"""Region boundaries keep eager's exact shapes; odd options and weights get clear handling."""

from __future__ import annotations

import pytest
import torch

import fxpass
import fxpass.jit.backend as backend
import fxpass.jit.options as options_mod


class ZeroDim(torch.nn.Module):
    """0-dim results of a region (mean / sum / all over a 1-D tensor) and a 0-dim input."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x, s):
        y = (x @ self.w)[0] * s  # s is a 0-dim tensor input into the region
        return y.mean(), y.sum(-1), (y > -1e9).all(-1), y.select(0, 3)


def test_zero_dim_inputs_and_outputs_keep_eager_shapes(opts):
    m = ZeroDim().eval()
    x, s = torch.randn(2, 16), torch.tensor(0.5)
    with torch.no_grad(), _no_fallback():
        expected = m(x, s)
        got = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)(x, s)
    r = fxpass.compile_reports()[-1]
    assert len(r.regions) == 1 and r.regions[0].fallback is None, str(r)
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, e.shape)
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


class _no_fallback:
    """Fail on a RegionFallbackWarning (a shape mismatch used to make the region eager)."""

    def __enter__(self):
        import warnings

        from fxpass.jit.runtime import RegionFallbackWarning

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error", RegionFallbackWarning)

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


@pytest.mark.parametrize("threads", [0, -1, 10**6])
def test_threads_is_bounded_by_the_cpu_count(threads):
    with pytest.raises(TypeError, match="threads"):
        options_mod.from_options({"threads": threads}, "bpu")
    assert options_mod.from_options({"threads": 1}, "bpu").threads == 1


def test_inference_mode_weights_compile_and_warn_once(opts):
    with torch.inference_mode():
        m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())
    x = torch.randn(4, 32)
    backend._WARNED.discard("inference")
    with torch.inference_mode(), pytest.warns(UserWarning, match="inference_mode"):
        got = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)(x)
        torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)


def test_compile_reports_are_bounded(opts, monkeypatch):
    monkeypatch.setattr(backend, "MAX_REPORTS", 2)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with torch.no_grad():
        for n in (1, 2, 3, 4):
            torch._dynamo.reset()
            torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)(torch.randn(n, 8))
    assert len(fxpass.compile_reports()) <= 2


@pytest.mark.parametrize("bad", [0, 1], ids=["first-output", "second-output"])
def test_an_output_of_another_size_falls_back_wherever_it_is(bad):
    """RegionCall views unreshaped outputs back (``host.output_view.output_views``); an output whose
    element count differs from the compiled shape is an executor fault, wherever it sits
    among the outputs: eager's answer with a warning, never a crash in the view."""
    from torch.fx import symbolic_trace

    from fxpass.jit.runtime import RegionCall, RegionFallbackWarning

    def fn(x):
        return x.view(2, 3) * 2, x.view(3, 2) + 1

    gm = symbolic_trace(fn)
    x = torch.randn(6)

    def executor(t):  # the first output unreshaped (a view is fine), one output too short
        outs = [(t * 2).clone(), (t + 1).clone()]
        outs[bad] = outs[bad][:5]
        return tuple(outs)

    call = RegionCall("r", executor, gm, [x], out_shapes=[torch.Size([2, 3]), torch.Size([3, 2])])
    with pytest.warns(RegionFallbackWarning, match="is not the compiled"):
        got = call(x)
    for g, e in zip(got, fn(x), strict=True):
        torch.testing.assert_close(g, e)
    good = RegionCall("r", lambda t: ((t * 2).clone(), (t + 1).clone()), gm, [x],
                      out_shapes=[torch.Size([2, 3]), torch.Size([3, 2])])
    with _no_fallback():
        got = good(x)
    assert [tuple(g.shape) for g in got] == [(2, 3), (3, 2)]
    for g, e in zip(got, fn(x), strict=True):
        torch.testing.assert_close(g, e)
