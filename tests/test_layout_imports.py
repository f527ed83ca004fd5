"""The layout shows the pipeline, and the imports run one way.

``fxpass/partition`` takes a capability and knows no device; ``backends/onnx/lowering`` is
the aten-to-ONNX lowering every ONNX device shares, below the onnxruntime host executor
(``backends/onnx/host``), which is below the JIT and ahead-of-time paths. These checks read
every module's imports (module level and inside functions) and fail naming the file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: directory -> module prefixes nothing under it may import (module level or in a function)
FORBIDDEN = {
    "backends/onnx/lowering": ("fxpass.backends.onnx.host", "fxpass.backends.bpu", "fxpass.jit",
                               "fxpass.aot", "fxpass.hf", "fxpass.tools"),
    "backends/onnx/host": ("fxpass.aot", "fxpass.hf", "fxpass.tools", "fxpass.jit.backend",
                           "fxpass.jit.guarded", "fxpass.jit.shapes", "fxpass.jit.plan"),
    "fxpass/partition": ("fxpass.backends", "fxpass.jit", "fxpass.aot", "fxpass.hf",
                         "fxpass.tools"),
    "fxpass/aot": ("fxpass.tools",),
    "fxpass/hf": ("fxpass.tools",),
}


def _imports(path: Path) -> set[str]:
    """Every ``fxpass...`` module ``path`` imports, as dotted names (``from a import b`` gives
    both ``a`` and ``a.b``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fxpass"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("fxpass"))
    return out


def _hits(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("where", sorted(FORBIDDEN))
def test_imports_run_one_way(where: str) -> None:
    bad = []
    for f in sorted((REPO / where).rglob("*.py")):
        for name in _imports(f):
            if _hits(name, FORBIDDEN[where]):
                bad.append(f"{f.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The reader above must catch an import inside a function too (a lazy one)."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from fxpass.backends.onnx.host.ort import OrtExecutor\n")
    assert _hits("fxpass.backends.onnx.host.ort.OrtExecutor", ("fxpass.backends.onnx.host",))
    assert {n for n in _imports(f) if _hits(n, FORBIDDEN["backends/onnx/lowering"])}


def test_no_module_over_500_lines() -> None:
    """A module a reader can take in one sitting (the product's code, not tests)."""
    long = [f"{f.relative_to(REPO)}: {n} lines"
            for top in ("fxpass", "rules", "backends")
            for f in sorted((REPO / top).rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > 500]
    assert not long, "\n".join(long)


#: modules that import each other lazily or at their end: each must import first, alone
_FIRST = ["fxpass.matching", "fxpass.by_example", "fxpass.pattern", "fxpass.jit.guarded",
          "fxpass.jit.options", "fxpass.backends.bpu.board", "fxpass.backends.onnx.host.build",
          "fxpass.aot.package", "fxpass.jit.backend", "fxpass.backends.bpu.plugin"]


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
