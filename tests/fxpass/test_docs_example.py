"""A new user's walkthrough: every code block of docs/writing-a-rule.md, run as written.

The two rules of the guide become a throwaway distribution (a package, a dist-info whose entry
points come from the guide's TOML block) on ``sys.path``, as ``pip install`` would leave them.
Then: ``fxpass rules`` lists them, the guide's property tests pass, a model compiled with
``backend="fxpass_bpu"`` runs the pattern rule (it joins the ``bpu`` target from a plugin) and
its report prints the rewrite, and ``check_rule`` catches a deliberately wrong fan-out version.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from fxpass import load

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-rule.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The guide's rules installed as distribution ``my-rules`` (entry points from its TOML)."""
    py = _blocks("python")
    fold_src = next(b for b in py if "def fold_muls" in b)
    gelu_src = next(b for b in py if "def gelu_tanh" in b)
    pkg = tmp_path / "my_rules"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "fold_muls.py").write_text(fold_src)
    (pkg / "gelu_tanh.py").write_text(gelu_src)
    (toml,) = _blocks("toml")
    eps = tomllib.loads(toml)["project"]["entry-points"]["fxpass"]
    info = tmp_path / "my_rules-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-rules\nVersion: 0.1\n")
    lines = "".join(f"{k} = {v}\n" for k, v in eps.items())
    (info / "entry_points.txt").write_text(f"[fxpass]\n{lines}")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setenv("FXPASS_CACHE_DIR", str(tmp_path / "cache"))
    importlib.invalidate_caches()
    load(refresh=True)
    torch._dynamo.reset()
    yield eps
    torch._dynamo.reset()
    for m in [m for m in sys.modules if m == "my_rules" or m.startswith("my_rules.")]:
        del sys.modules[m]
    importlib.invalidate_caches()
    load(refresh=True)


@pytest.mark.slow  # the fast tier's 4-minute budget
def test_walkthrough(installed, capsys):
    from fxpass import select_rules
    from fxpass.cli import main

    assert set(installed) == {"my_fold", "my_gelu"}
    reg = load()
    assert reg.rules["fold_muls"].plugin == "my-rules:my_fold"
    assert reg.rules["gelu_tanh"].plugin == "my-rules:my_gelu"
    bpu = {r.name for r in select_rules(reg, target="bpu")}
    assert "fold_muls" in bpu  # joined from a plugin
    assert "fold_muls" not in {r.name for r in select_rules(reg)}  # off by default elsewhere

    assert main(["rules"]) == 0
    out = capsys.readouterr().out
    line, targets = out[out.index("fold_muls  [") :].split("\n")[:2]
    assert "off by default" in line and "pattern rule" in line and "my-rules" in line
    assert "targets: bpu;" in targets and "aten.mul.Tensor" in targets

    # the guide's property tests, as a user would run them
    (tests_src,) = [b for b in _blocks("python") if "def test_fold_muls" in b]
    ns: dict = {}
    exec(compile(tests_src, "test_my_rules.py", "exec"), ns)
    for name in ("test_fold_muls", "test_gelu_tanh", "test_gelu_tanh_leaves_the_exact_gelu_alone"):
        ns[name]()

    # compile a model; the report shows the rewrite
    (compile_src,) = [b for b in _blocks("python") if "compile_reports()" in b]
    scope: dict = {}
    exec(compile(compile_src, "compile.py", "exec"), scope)
    printed = capsys.readouterr().out
    assert "fold_muls x1" in printed
    assert "1 region(s)" in printed


def test_check_rule_catches_a_wrong_fan_out_version(installed):
    from fxpass.pattern import Num, P, Var, pattern_rule
    from fxpass.testing import check_rule

    aten = torch.ops.aten
    shared = P(
        aten.mul.Tensor,
        P(aten.mul.Tensor, Var("x"), Num("a"), name="inner", shared=True),
        Num("b"),
    )

    @pattern_rule(shared)
    def fold_muls_in_place(rw, m):
        """The bug: folds into the inner mul in place, which its other users also read."""
        rw.retarget(m.inner, aten.mul.Tensor, m.x, m.a * m.b)
        rw.replace(m.root, m.inner)
        return True

    with pytest.raises(AssertionError, match="not close|values differ"):
        check_rule(fold_muls_in_place)


def test_every_python_block_is_covered():
    # each block is run by this file, except the capture block (tests/fxpass/test_capture.py)
    # and the by-example rule (tests/rules/test_by_example.py)
    covered = ("def fold_muls", "def gelu_tanh", "def test_fold_muls", "compile_reports()",
               "pattern_from(")
    for b in _blocks("python"):
        assert any(c in b for c in covered) or "fxpass.capture(" in b, b[:80]


@pytest.mark.slow
def test_the_guides_plugin_builds_as_a_wheel(tmp_path):
    """The guide's whole pyproject.toml and modules, built the way pip installs them: the wheel
    holds the package and the entry points fxpass reads."""
    import subprocess
    import zipfile

    root = tmp_path / "my-rules"
    (root / "my_rules").mkdir(parents=True)
    (root / "pyproject.toml").write_text(_blocks("toml")[0])
    (root / "my_rules" / "__init__.py").write_text("")
    py = _blocks("python")
    (root / "my_rules" / "fold_muls.py").write_text(next(b for b in py if "def fold_muls" in b))
    (root / "my_rules" / "gelu_tanh.py").write_text(next(b for b in py if "def gelu_tanh" in b))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "dist"), str(root)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = (tmp_path / "dist").glob("my_rules-0.1.0-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        eps = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "my_rules/fold_muls.py" in names and "my_rules/gelu_tanh.py" in names
    assert "[fxpass]" in eps and "my_fold = my_rules.fold_muls" in eps
