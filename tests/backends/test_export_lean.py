"""A deployed process imports what running a package needs and nothing else: after
``import torch``, importing ``fxpass.backends.bpu``, ``load(path)`` and the first call (or the
first generated token) import none of Dynamo, torch.export, transformers, onnx, onnxscript,
Hypothesis or the rule set, unless the package needs them (a package whose outputs are
transformers' ``ModelOutput`` types imports that module, and only it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxpass.backends.bpu import export, export_for_generate
from fxpass.tools import zoo

ROOT = Path(__file__).resolve().parents[2]
#: what a deployed process must not import (unless the package names it). torch 2.13's own
#: ``import torch`` imports torch.export: listed for the releases whose import does not.
HEAVY = ("torch._dynamo", "torch.export", "torch._inductor", "transformers", "onnx",
         "onnxscript", "hypothesis", "pytest", "sympy", "fxpass.rules",
         "fxpass.backends.onnx.lowering", "fxpass.aot.export",
         "fxpass.jit.options")

_CHILD = """
import json, sys
import torch
before = set(sys.modules)
import fxpass.backends.bpu as bpu
lazy = sorted(set(sys.modules) - before)
program = bpu.load(sys.argv[1])
with torch.no_grad():
    if sys.argv[2] == "generate":
        program.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=1)
    elif sys.argv[2] == "encoder":
        ids = torch.ones(1, 5, dtype=torch.long)
        program(input_ids=ids, attention_mask=ids)
    else:
        program(torch.ones(2, 16))
print(json.dumps({"lazy": lazy, "run": sorted(set(sys.modules) - before)}))
"""


def _modules(path: Path, mode: str) -> dict[str, list[str]]:
    r = subprocess.run([sys.executable, "-c", _CHILD, str(path), mode], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _heavy(mods: list[str]) -> list[str]:
    return sorted(m for m in mods if any(m == h or m.startswith(h + ".") for h in HEAVY))


@pytest.mark.slow
def test_loading_and_generating_imports_nothing_heavy(tmp_path):
    model, _ = zoo.get("qwen3")
    path = export_for_generate(model, max_cache_len=16, prefill_length=4,
                               options={"min_compute_macs": 0}).save(tmp_path / "gen")
    got = _modules(Path(path), "generate")
    assert _heavy(got["run"]) == [], got["run"]
    # importing the package itself imports none of its members
    assert not [m for m in got["lazy"] if m.startswith("fxpass.backends.bpu.")], got["lazy"]


@pytest.mark.slow
def test_a_plain_package_imports_nothing_heavy(tmp_path):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()).eval()
    path = export(mlp, (torch.ones(2, 16),), options={"min_compute_macs": 0}).save(
        tmp_path / "mlp")
    got = _modules(Path(path), "call")
    assert _heavy(got["run"]) == [], got["run"]


@pytest.mark.slow
def test_a_package_of_the_ort_device_imports_nothing_heavy(tmp_path):
    """The package's device comes from its own plugin alone: not the rule set, not options."""
    from fxpass.aot.export import export as export_on

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()).eval()
    path = export_on(mlp, (torch.ones(2, 16),), options={"min_compute_macs": 0},
                     device="ort").save(tmp_path / "mlp")
    got = _modules(Path(path), "call")
    assert _heavy(got["run"]) == [], got["run"]
    assert "fxpass.backends.ort" in got["run"], got["run"]


@pytest.mark.slow
def test_a_bucket_package_imports_transformers_for_its_outputs_and_nothing_else(tmp_path):
    """BERT's outputs are transformers' ``ModelOutput`` types: their module is imported (the
    package needs it to rebuild its output), the rest of the heavy list is not."""
    from fxpass.backends.bpu import export_for_encoder

    model, _ = zoo.get("bert")
    path = export_for_encoder(model, buckets={"seq": [8], "batch": [1]}).save(tmp_path / "enc")
    got = _modules(Path(path), "encoder")
    assert "transformers.modeling_outputs" in got["run"]
    assert [m for m in _heavy(got["run"]) if not m.startswith("transformers")] == [], got["run"]
