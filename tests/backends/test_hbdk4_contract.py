"""The hbdk4 / board-runtime path, against the contract fake (tests/backends/fake_hbdk4.py).

The board path quantizes: regions run float on the host until ``calibrate()``, and only the
calibrated QDQ model reaches export -> convert -> compile. The fake's ``convert`` fails on a
MAC op without Q/DQ on its inputs (the real one would place it on the CPU).
"""

import json
import sys
import warnings

import pytest
import torch

import fxpass
from fxpass import PassManager, capture, select_rules
from fxpass.backends.bpu import calibrate
from fxpass.backends.bpu.capability import Capability, march
from fxpass.backends.onnx import quantize as Q
from fxpass.backends.onnx.lowering import lower
from fxpass.partition.partition import partition
from fxpass.partition.region import extract
from tests.backends import fake_hbdk4
from tests.backends.test_backend import SideBranch

#: w8a16 on SideBranch, a held-out batch vs eager float: int8 per-channel weights give ~0.5%
#: of the output magnitude (~1), measured max error 5e-3..1e-2; a held-out value beyond the
#: calibrated range clips, so the bound on any single element is looser than the cosine.
ATOL_W8A16 = 5e-2
COS_W8A16 = 0.999


def _close(got, want, cos=COS_W8A16, atol=ATOL_W8A16):
    c = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert c >= cos, f"cosine {c:.6f} < {cos}"
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def _model():
    torch.manual_seed(0)
    return SideBranch().eval()


def _batches(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 16, generator=g) for _ in range(n)]


def _board(m, opts, **extra):
    o = {**opts, "executor": "hbdnn", "march": "nash-m", **extra}
    return torch.compile(m, backend="fxpass_bpu", dynamic=False, options=o)


def test_board_runs_float_until_calibrated_then_hbdk4_gets_the_qdq_model(opts, monkeypatch):
    rec = fake_hbdk4.install(monkeypatch)
    m = _model()
    x = _batches(1, seed=9)[0]
    fn = _board(m, opts)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="not calibrated yet"):
            torch.testing.assert_close(fn(x), m(x), rtol=1e-5, atol=1e-5)
        assert rec.calls == []  # nothing float reaches hbdk4
        infos = calibrate(fn, _batches())
        got = fn(x)
    _close(got, m(x))
    r = fxpass.compile_reports()[-1]
    n = len(r.regions)
    assert n >= 2 and r.executor == "hbdnn" and len(infos) == n
    kinds = [c[0] for c in rec.calls]
    # per region: export -> convert -> compile, then the runtime loads the .hbm, then runs
    assert [k for k in kinds if k != "run"] == ["export", "convert", "compile", "runtime"] * n
    assert all(c[1] == "nash-m" for c in rec.calls if c[0] == "convert")
    assert all(
        c[1].endswith(".hbm") and c[2] == "nash-m" and c[3] == 2
        for c in rec.calls
        if c[0] == "compile"
    )
    assert kinds.count("run") >= n  # accuracy measured on the board artifact, then the call
    for reg in r.regions:
        q = reg.quant
        assert q.state == "calibrated" and q.target == "hbdnn" and q.config == "w8a16"
        assert q.cosine > 0.999 and q.summary["float_mac"] == []
        assert q.summary["q_nodes"] == {"int16": q.summary["q_nodes"]["int16"]}
        assert "cosine" in str(r)
    assert all(p["place"] == "bpu" for p in rec.placement)


def test_calibrated_board_artifact_round_trips_through_the_cache(opts, monkeypatch):
    rec = fake_hbdk4.install(monkeypatch)
    m = _model()
    x = _batches(1, seed=4)[0]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not calibrated yet"
        first = calibrate(_board(m, opts), _batches())
        torch._dynamo.reset()
        rec.calls.clear()
        fn = _board(m, opts)
        again = calibrate(fn, _batches())
        assert [c[0] for c in rec.calls if c[0] in ("export", "convert", "compile")] == []
        assert [i.key for i in again] == [i.key for i in first] and all(i.cached for i in again)
        torch._dynamo.reset()
        rec.calls.clear()
        other = calibrate(_board(m, opts), _batches(seed=1))  # new ranges: new .hbm
        assert {i.key for i in other}.isdisjoint(i.key for i in first)
        assert [c[0] for c in rec.calls].count("compile") == len(other)
        _close(fn(x), m(x))


def test_fake_convert_rejects_a_float_mac_op_and_accepts_its_qdq_form(tmp_path, monkeypatch):
    fake_hbdk4.install(monkeypatch)
    proto = _lowered_linear()
    hb = sys.modules["hbdk4.compiler"]
    module = hb.onnx.export(proto, name="r")
    advice = tmp_path / "advice.json"
    with pytest.raises(fake_hbdk4.FloatMacError, match="MatMul.*no Q/DQ"):
        hb.convert(module, "nash-p", advice=True, advice_path=str(advice))
    assert any(p["place"] == "external_cpu" for p in json.loads(advice.read_text()))
    cfg = Q.CONFIGS["w8a8"]
    feeds = [{proto.graph.input[0].name: b.numpy()} for b in _batches()]
    qdq = Q.quantize_model(proto, Q.calibrate_ranges(proto, feeds, cfg, "nash-p"), cfg, "nash-p")
    hb.convert(hb.onnx.export(qdq, name="r"), "nash-p", advice=True, advice_path=str(advice))
    places = json.loads(advice.read_text())
    assert places and all(p["place"] == "bpu" for p in places)


def _lowered_linear():
    """The float ONNX model the backend would lower for a Linear (weights as initializers)."""
    (gm,) = capture(torch.nn.Linear(16, 8).eval(), torch.randn(4, 16))
    PassManager(select_rules(target="bpu")).run(gm)
    (region,) = partition(gm, Capability(march("nash-p")), min_compute_macs=0).regions
    return lower(extract(gm, region).gm, name="r")


def test_board_path_refuses_a_mac_op_quantization_left_float(opts, monkeypatch):
    """If the integer-input table missed an op, our own check stops it before hbdk4."""
    rec = fake_hbdk4.install(monkeypatch)
    monkeypatch.setitem(Q.INTEGER_INPUT_OPS, "nash-m", ("Conv",))  # MatMul forgotten
    m = _model()
    fn = _board(m, opts)
    with torch.no_grad(), pytest.warns(UserWarning):
        fn(_batches(1)[0])
    with torch.no_grad(), pytest.warns(UserWarning, match="float inputs after quantization"):
        infos = calibrate(fn, _batches())
    assert all(i.state.startswith("failed") for i in infos)
    assert not any(c[0] == "convert" for c in rec.calls)
    x = _batches(1, seed=3)[0]
    with torch.no_grad():
        torch.testing.assert_close(fn(x), m(x), rtol=1e-5, atol=1e-5)  # still float, correct


def test_auto_picks_the_board_only_when_hbdk4_and_runtime_exist(opts, monkeypatch):
    from fxpass.backends.bpu.device import resolve_executor

    assert resolve_executor("auto") == "onnxruntime"
    fake_hbdk4.install(monkeypatch)
    assert resolve_executor("auto") == "hbdnn"


def test_failing_hbdk4_compile_keeps_float_or_raises_when_strict(opts, monkeypatch):
    rec = fake_hbdk4.install(monkeypatch)
    rec.fail_compile = True
    m = _model()
    x = _batches(1, seed=5)[0]
    fn = _board(m, opts)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="not calibrated"):
            fn(x)
        with pytest.warns(UserWarning, match="injected failure"):
            calibrate(fn, _batches())
        torch.testing.assert_close(fn(x), m(x), rtol=1e-5, atol=1e-5)
        assert all(
            reg.quant.state.startswith("failed") for reg in fxpass.compile_reports()[-1].regions
        )
        with pytest.raises(RuntimeError, match="injected failure"):
            calibrate(fn, _batches(), strict=True)


def test_hbdnn_without_hbdk4_says_how_to_install(opts, monkeypatch):
    monkeypatch.setitem(sys.modules, "hbdk4", None)  # not importable
    m = _model()
    with torch.no_grad(), pytest.raises(Exception, match="OpenExplorer"):
        torch.compile(m, backend="fxpass_bpu", options={**opts, "executor": "hbdnn"})(
            torch.randn(2, 16)
        )
