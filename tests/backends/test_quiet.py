"""A clean compile and calibrate() print nothing; onnxruntime's log level is the user's choice."""

from __future__ import annotations

import pytest
import torch

from fxpass.backends.bpu import calibrate
from fxpass.backends.onnx.host.ort import ort_log_level
from fxpass.tools import zoo


def test_compile_and_calibrate_print_nothing(capfd, opts):
    torch._dynamo.reset()
    model, kw = zoo.get("qwen3")
    c = torch.compile(model, backend="fxpass_bpu",
                      options={**opts, "quantize": "w8a8", "min_compute_macs": 0})
    capfd.readouterr()
    with torch.no_grad():
        c(**kw)
        calibrate(c, [kw])
        c(**kw)
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)


def test_ort_log_level_from_the_environment(monkeypatch):
    assert ort_log_level() == 3
    monkeypatch.setenv("FXPASS_ORT_LOG_LEVEL", "2")
    assert ort_log_level() == 2
    monkeypatch.setenv("FXPASS_ORT_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="FXPASS_ORT_LOG_LEVEL='loud': use 0"):
        ort_log_level()
