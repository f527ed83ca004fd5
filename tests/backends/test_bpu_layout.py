"""The backend's layout shows its roles, and the imports run one way.

``device/`` is the BPU plugin proper; ``host/`` is onnxruntime standing in for the board;
``aot/``, ``hf/`` and ``tools/`` are built over both. A device module that reached into the
host (or anything over it) would make the board path depend on the stand-in; these checks
read every module's imports (module level and inside functions) and fail naming the file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BPU = REPO / "backends" / "bpu"
PKG = "fxpass.backends.bpu"

#: role -> the parts of the backend it must not import
FORBIDDEN = {
    "device": ("host", "hf", "tools", "aot", "backend", "guarded", "shapes", "compile", "plan"),
    "host": ("hf", "tools", "aot", "backend", "guarded", "shapes", "compile", "plan"),
    "aot": ("tools",),
    "hf": ("tools",),
}


def _imports(path: Path) -> set[str]:
    """Every ``fxpass.backends.bpu...`` module ``path`` imports, as dotted names."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PKG):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith(PKG))
    return out


def _part(dotted: str) -> str:
    """``fxpass.backends.bpu.host.ort`` -> ``host``."""
    return dotted[len(PKG) + 1:].split(".")[0] if dotted.startswith(PKG + ".") else ""


@pytest.mark.parametrize("role", sorted(FORBIDDEN))
def test_imports_run_one_way(role: str) -> None:
    bad = []
    for f in sorted((BPU / role).rglob("*.py")):
        for name in _imports(f):
            if _part(name) in FORBIDDEN[role]:
                bad.append(f"{f.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The reader above must catch an import inside a function too (a lazy one)."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from fxpass.backends.bpu.host.ort import OrtExecutor\n")
    assert {_part(n) for n in _imports(f)} == {"host"}


def test_no_module_over_500_lines() -> None:
    """A module a reader can take in one sitting (the product's code, not tests)."""
    long = [f"{f.relative_to(REPO)}: {n} lines"
            for top in ("fxpass", "rules", "backends")
            for f in sorted((REPO / top).rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > 500]
    assert not long, "\n".join(long)


#: modules that import each other lazily or at their end: each must import first, alone
_FIRST = ["fxpass.matching", "fxpass.by_example", "fxpass.pattern", f"{PKG}.guarded",
          f"{PKG}.options", f"{PKG}.device.board", f"{PKG}.host.build", f"{PKG}.aot.package"]


@pytest.mark.slow  # a fresh interpreter per module
@pytest.mark.parametrize("module", _FIRST)
def test_module_imports_first_in_a_fresh_process(module: str) -> None:
    """An import cycle shows only when a module is imported before its partner (fxpass.matching
    alone raised ImportError while every caller imported fxpass.pattern first)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
