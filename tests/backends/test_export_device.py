"""Packages record their device: a package exported for the ``ort`` device saves, loads and runs
as eager; its manifest names the device, its plugin and identity (tool versions, source
digest); a process without that device refuses the package, naming the device and its plugin.

Tolerances: float32 against eager at rtol = atol = 1e-4 (onnxruntime's kernels reassociate
sums, as in test_export)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxpass.aot.export import export
from fxpass.aot.package import MANIFEST, PackageError, load, sign

TOL = {"rtol": 1e-4, "atol": 1e-4}
ROOT = Path(__file__).resolve().parents[2]


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 16)).eval()


@pytest.fixture(scope="module")
def ort_package(tmp_path_factory):
    model, x = _mlp(), torch.randn(4, 32)
    program = export(model, (x,), options={"min_compute_macs": 0}, device="ort")
    assert program.regions, program.report.summary()
    path = Path(program.save(tmp_path_factory.mktemp("pkg") / "mlp"))
    return model, x, path


def test_an_ort_package_saves_loads_and_runs_as_eager(ort_package):
    model, x, path = ort_package
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["device"] == "ort" and manifest["device_plugin"] == "fxpass:ort"
    ident = manifest["device_identity"]
    assert ident["device"] == "ort" and ident["source"] and "onnxruntime" in ident
    assert all(r["executor"] == "onnxruntime" for r in manifest["programs"]["main"]["regions"])
    loaded = load(path)
    other = torch.randn(4, 32)
    with torch.no_grad():
        for inp in (x, other):
            torch.testing.assert_close(loaded(inp), model(inp), **TOL)


def test_a_package_of_a_device_not_installed_is_refused_naming_it(ort_package, tmp_path):
    import shutil

    path = Path(shutil.copytree(ort_package[2], tmp_path / "p"))
    m = json.loads((path / MANIFEST).read_text())
    m.update(device="nosuch", device_plugin="acme-bpu:nosuch")
    (path / MANIFEST).write_text(json.dumps(sign(m)))
    with pytest.raises(PackageError) as e:
        load(path)
    msg = str(e.value)
    assert "'nosuch'" in msg and "acme-bpu:nosuch" in msg and "install its plugin" in msg
    assert "\n" not in msg


@pytest.mark.slow
def test_a_process_without_the_device_plugin_refuses_the_package(ort_package):
    """The ``ort`` plugin blocked in a fresh process: the package is refused by name, and the
    CLI-style one-line error names the plugin to install."""
    code = ("import sys\nfrom fxpass.aot.package import PackageError, load\n"
            "try:\n    load(sys.argv[1])\nexcept PackageError as e:\n    print(e)\n"
            "    sys.exit(3)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FXPASS_BLOCK_PLUGINS": "ort"}
    r = subprocess.run([sys.executable, "-c", code, str(ort_package[2])], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "fxpass device 'ort', which is not installed here" in r.stdout
    assert "install its plugin (fxpass:ort" in r.stdout
