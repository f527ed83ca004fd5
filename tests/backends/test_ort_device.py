"""The ``ort`` device as a product of its own: what it shares with the BPU's host stand-in and
what is its own (no march, every op the ONNX lowering emits, Q/DQ on its MAC ops)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fxpass
from fxpass.backends.onnx.calibration import calibrate


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 64)).eval()


def test_ort_compiles_with_its_own_options_and_report(opts):
    m, x = _mlp(), torch.randn(8, 256)
    with torch.no_grad():
        got = torch.compile(m, backend="fxpass_ort", options={**opts, "threads": 1})(x)
    torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)  # float32
    rep = fxpass.compile_reports()[-1]
    assert rep.device == "ort" and rep.executor == "onnxruntime" and len(rep.regions) == 1
    with pytest.raises(Exception, match="unknown option.*'march'"):
        torch.compile(m, backend="fxpass_ort", options={"march": "nash-p"})(x)


def test_ort_quantizes_its_mac_ops_after_calibration(opts):
    m, xs = _mlp(), [torch.randn(8, 256) for _ in range(4)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = torch.compile(m, backend="fxpass_ort", options={**opts, "quantize": "w8a8"})
        c(xs[0])
        calibrate(c, [(x,) for x in xs])
        got, want = c(xs[0]), m(xs[0])
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos > 0.999, cos  # int8 weights and activations against float32
    assert not torch.equal(got, want)  # it did quantize


def test_ort_promotes_bf16_models_to_float32_regions(opts):
    """onnxruntime has no BF16 GEMM on the CPU: the ort target promotes, as the BPU's does
    (found by benchmarks.models: a bf16 MLP got no region on ort)."""
    m, x = _mlp().to(torch.bfloat16), torch.randn(8, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        got = torch.compile(m, backend="fxpass_ort", options=opts)(x)
        want = m(x)
    assert got.dtype == torch.bfloat16  # the model-visible dtype stays BF16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 tolerances
    rep = fxpass.compile_reports()[-1]
    assert len(rep.regions) == 1 and rep.regions[0].fallback is None, str(rep)
    assert rep.rewrites.get("bf16_promotion", 0) >= 1, rep.rewrites


class _Lookup(torch.nn.Module):
    """A token embedding in front of a linear layer: int64 ids in, as a language model takes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 64)
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids))


def test_ort_takes_the_embedding_into_its_region(opts):
    """The ort device runs a model's token lookup inside its region (int64 ids in), so a
    forward is one onnxruntime call; the board keeps int64 out of its regions."""
    m, ids = _Lookup().eval(), torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        got = torch.compile(m, backend="fxpass_ort", options=opts)(ids)
        want = m(ids)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32
        rep = fxpass.compile_reports()[-1]
        assert len(rep.regions) == 1 and rep.regions[0].fallback is None, str(rep)
        assert rep.offloaded_call_nodes == rep.call_nodes, str(rep)  # the lookup included
        torch._dynamo.reset()
        torch.compile(m, backend="fxpass_bpu", options=opts)(ids)
        bpu = fxpass.compile_reports()[-1]
        assert bpu.offloaded_call_nodes < bpu.call_nodes  # the lookup stays on the CPU
        assert any("embedding" in why for why in bpu.cpu_reasons), bpu.cpu_reasons


@pytest.mark.parametrize("bad", [-1, pytest.param(100, marks=pytest.mark.slow)])
def test_ort_lookup_of_a_bad_id_raises_eagers_error_and_keeps_the_region(opts, bad, monkeypatch):
    """onnxruntime's Gather wraps a negative id around (the table's last row); eager raises.
    A bad id raises eager's IndexError, and the region keeps running on onnxruntime after."""
    from fxpass.jit.runtime import RegionCall

    m, ids = _Lookup().eval(), torch.randint(0, 100, (1, 5))
    with torch.no_grad():
        c = torch.compile(m, backend="fxpass_ort", options=opts)
        c(ids)
        wrong = ids.clone()
        wrong[0, 2] = bad
        with pytest.raises(IndexError), warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning either
            c(wrong)
        eager_runs = []
        real = RegionCall._eager
        monkeypatch.setattr(RegionCall, "_eager", lambda self: eager_runs.append(1) or real(self))
        torch.testing.assert_close(c(ids), m(ids), rtol=1e-5, atol=1e-5)
    assert not eager_runs  # the good call after it ran on onnxruntime, not the eager graph
