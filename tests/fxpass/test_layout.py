"""Installed layout: nothing importable under a generic name, so a user's files shadow nothing.

The repository keeps ``rules/`` and ``backends/`` at the top, but they install as
``fxpass.rules`` and ``fxpass.backends``. A folder holding an unrelated ``rules.py``,
``backends/`` or ``fxpass_bpu.py`` must change nothing, and the wheel must carry only ``fxpass``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_HOSTILE = "raise ImportError('user file imported instead of fxpass: {}')\n"

_PROBE = textwrap.dedent(
    """
    import warnings
    warnings.simplefilter("error")   # a skipped plugin would warn: fail loudly instead
    import torch
    from fxpass import load, select_rules
    reg = load()
    builtin = {"alias_removal", "safe_softmax", "sdpa_decomposition", "scalar_overloads",
               "constant_folding", "bf16_promotion", "bf16_cast_cancel"}
    assert builtin <= set(reg.rules), sorted(reg.rules)
    assert "bpu" in reg.targets and not reg.failures, reg.failures
    assert {r.plugin.split(":")[0] for r in reg.rules.values()} == {"fxpass"}
    select_rules(target="bpu")
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).eval()
    x = torch.randn(4, 64)
    with torch.no_grad():
        got = torch.compile(m, backend="fxpass_bpu", options={"min_compute_macs": 0})(x)
        torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)
    import fxpass.rules, fxpass.jit.backend as b
    print("OK", fxpass.rules.__name__, b.__name__)
    """
)


@pytest.mark.slow  # a subprocess round trip
def test_user_files_named_rules_or_backends_shadow_nothing(tmp_path: Path) -> None:
    (tmp_path / "rules.py").write_text(_HOSTILE.format("rules.py"))
    (tmp_path / "fxpass_bpu.py").write_text(_HOSTILE.format("fxpass_bpu.py"))
    (tmp_path / "backends").mkdir()
    (tmp_path / "backends" / "__init__.py").write_text(_HOSTILE.format("backends/"))
    (tmp_path / "backends" / "bpu.py").write_text(_HOSTILE.format("backends/bpu.py"))
    # `python -c` puts the working directory first on sys.path, as a user's script would.
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK fxpass.rules fxpass.jit.backend" in out.stdout


def test_wheel_installs_only_the_fxpass_package(tmp_path: Path) -> None:
    src = tmp_path / "src"  # build from a copy: the build must not litter the checkout
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for part in ("fxpass", "rules", "backends"):
        shutil.copytree(REPO / part, src / part, ignore=ignore)
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / part, src / part)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(src),
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("fxpass-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"fxpass", next(t for t in top if t.endswith(".dist-info"))}, top
    assert "fxpass/rules/sdpa.py" in names and "fxpass/jit/backend.py" in names
    eps = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(eps).decode()
    assert "fxpass.rules" in text and "fxpass.backends.bpu.backend:fxpass_bpu" in text
    assert "fxpass.backends.ort.backend:fxpass_ort" in text
