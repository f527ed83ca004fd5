"""What ``export`` tells its caller from Python: each stage (logger ``fxpass.export`` at INFO
and the ``progress=`` callback), a program left without a region (``NoRegionWarning``, naming
``min_compute_macs``), and a missing transformers (an ``ExportError`` naming the extra).

Why: an export takes minutes on a large model, and ``export_for_generate`` printed nothing
from Python though the docs said export prints its stages; a small model whose regions all
fell below the default threshold exported a package that runs wholly in torch, silently
(issue 45, item 9)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from fxpass.aot.export import NoRegionWarning
from fxpass.aot.runtime import ExportError
from fxpass.backends.bpu import export, export_for_generate
from fxpass.tools import zoo
from tests.backends.blockers import block


def _mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 16)).eval()
    return model, torch.randn(4, 64)


def _stages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fxpass.export"]


def test_export_logs_each_stage_and_passes_it_to_progress(caplog, tmp_path):
    model, x = _mlp()
    got: list[str] = []
    with caplog.at_level(logging.INFO, logger="fxpass.export"):
        program = export(model, (x,), options={"min_compute_macs": 0}, progress=got.append)
    logged = _stages(caplog)
    assert logged == got
    assert logged[0] == "torch.export (non-strict)"
    assert any("region compile" in m for m in logged)
    assert logged[-1] == "torch.export of the spliced graph (1 region(s))"
    caplog.clear()
    saved: list[str] = []
    with caplog.at_level(logging.INFO, logger="fxpass.export"):
        program.save(str(tmp_path / "pkg"), progress=saved.append)
    assert _stages(caplog) == saved and "writing main.pt2" in saved


def test_stages_are_quiet_without_logging_configured(capsys):
    """INFO is below logging's default level: a library prints nothing unless asked."""
    model, x = _mlp()
    export(model, (x,), options={"min_compute_macs": 0})
    assert capsys.readouterr() == ("", "")


def test_a_program_without_a_region_warns_naming_the_option():
    model, x = _mlp()  # 4 x 64 x 128 + 4 x 128 x 16 MACs, below the default 500,000
    with pytest.warns(NoRegionWarning) as caught:
        program = export(model, (x,))
    assert not program.regions
    (w,) = caught
    msg = str(w.message)
    assert "the program has no region" in msg
    assert "min_compute_macs=500,000 (the default for the onnxruntime executor)" in msg
    assert "40960 MACs < min_compute_macs=500000" in msg
    assert "options={'min_compute_macs': 0}" in msg
    assert w.filename == __file__  # points at the caller's export() line, not fxpass's
    with pytest.warns(NoRegionWarning, match=r"below min_compute_macs=100,000,000 \(\d+ nodes"):
        export(model, (x * 2,), options={"min_compute_macs": 100_000_000})


def test_no_warning_with_a_region_or_without_any_candidate():
    model, x = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoRegionWarning)
        assert export(model, (x,), options={"min_compute_macs": 0}).regions
        # nothing the BPU computes (no matmul): no threshold would help, nothing to warn of
        assert not export(torch.nn.ReLU(), (x,)).regions


def test_export_for_generate_logs_both_programs_and_warns_per_program(caplog):
    model, _ = zoo.get("qwen3", layers=1, hidden=64, vocab=128)
    got: list[str] = []
    with caplog.at_level(logging.INFO, logger="fxpass.export"), \
            pytest.warns(NoRegionWarning) as caught:
        export_for_generate(model, max_cache_len=16, prefill_length=4, progress=got.append)
    logged = _stages(caplog)
    assert logged == got
    assert "prefill program (4 token(s) x batch 1)" in logged
    assert "decode program (1 token(s) x batch 1)" in logged
    assert sum(m == "torch.export (non-strict)" for m in logged) == 2
    whats = sorted(str(w.message).split(" has no region")[0] for w in caught)
    assert whats == ["export: the decode program", "export: the prefill program"]


def test_export_for_generate_without_transformers_names_the_extra(monkeypatch):
    model, _ = zoo.get("qwen3", layers=1, hidden=64, vocab=128)
    block(monkeypatch, "transformers")
    with pytest.raises(ExportError, match=r'needs transformers .*pip install "fxpass\[demo\]"'):
        export_for_generate(model, max_cache_len=16, prefill_length=4)
