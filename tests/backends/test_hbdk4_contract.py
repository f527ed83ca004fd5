"""The hbdk4 / board-runtime path, against the contract fake (tests/backends/fake_hbdk4.py)."""

import sys

import pytest
import torch

import fxpass
from tests.backends import fake_hbdk4
from tests.backends.test_backend import SideBranch


def test_hbdnn_executor_calls_hbdk4_in_order_and_runs_on_the_board(opts, monkeypatch):
    rec = fake_hbdk4.install(monkeypatch)
    m = SideBranch().eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        got = torch.compile(
            m,
            backend="fxpass_bpu",
            dynamic=False,
            options={**opts, "executor": "hbdnn", "march": "nash-m"},
        )(x)
    torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)
    r = fxpass.compile_reports()[-1]
    assert r.executor == "hbdnn" and all(reg.executor == "hbdnn" for reg in r.regions)
    kinds = [c[0] for c in rec.calls]
    n = len(r.regions)
    # per region: export -> convert -> compile, then the runtime loads the .hbm and runs it
    assert kinds[: 4 * n] == ["export", "convert", "compile", "runtime"] * n
    assert all(c[1] == "nash-m" for c in rec.calls if c[0] == "convert")
    assert all(
        c[1].endswith(".hbm") and c[2] == "nash-m" and c[3] == 2
        for c in rec.calls
        if c[0] == "compile"
    )
    assert kinds.count("run") == n


def test_auto_picks_the_board_only_when_hbdk4_and_runtime_exist(opts, monkeypatch):
    from fxpass.backends.bpu.compile import resolve_executor

    assert resolve_executor("auto") == "onnxruntime"
    fake_hbdk4.install(monkeypatch)
    assert resolve_executor("auto") == "hbdnn"


def test_failing_hbdk4_compile_falls_back_or_raises_when_strict(opts, monkeypatch):
    rec = fake_hbdk4.install(monkeypatch)
    rec.fail_compile = True
    m = SideBranch().eval()
    x = torch.randn(4, 16)
    o = {**opts, "executor": "hbdnn"}
    with torch.no_grad():
        with pytest.warns(UserWarning, match="injected failure"):
            got = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=o)(x)
        torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)
        assert all(reg.fallback for reg in fxpass.compile_reports()[-1].regions)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="injected failure"):
            torch.compile(m, backend="fxpass_bpu", dynamic=False, options={**o, "strict": True})(x)


def test_hbdnn_without_hbdk4_says_how_to_install(opts, monkeypatch):
    monkeypatch.setitem(sys.modules, "hbdk4", None)  # not importable
    m = SideBranch().eval()
    with torch.no_grad(), pytest.raises(Exception, match="OpenExplorer"):
        torch.compile(m, backend="fxpass_bpu", options={**opts, "executor": "hbdnn"})(
            torch.randn(2, 16)
        )
