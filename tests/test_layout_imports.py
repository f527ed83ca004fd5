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


_HEAVY = ("onnx", "onnxruntime", "onnxscript")
#: what names a device, in product code outside that device's own plugin
_DEVICE_NAMES = ('"fxpass_bpu"', 'target="bpu"', '"hbdnn"')


def _product_files(*tops: str) -> list[Path]:
    return [f for top in tops for f in sorted((REPO / top).rglob("*.py"))]


def test_the_core_imports_no_backend_and_no_onnx() -> None:
    """The core depends on torch, pluggy and numpy: every device arrives through the device
    API, and ONNX is one kind of device's business (``backends/onnx``)."""
    bad = []
    for f in _product_files("fxpass"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{f.relative_to(REPO)} imports {n}" for n in names
                    if n.split(".")[0] in _HEAVY or n.startswith("fxpass.backends")]
    assert not bad, "\n".join(bad)


def test_no_device_is_named_outside_its_plugin() -> None:
    bad = [f"{f.relative_to(REPO)}: {name}"
           for f in _product_files("fxpass", "rules", "backends")
           if "backends/bpu" not in f.relative_to(REPO).as_posix()
           for name in _DEVICE_NAMES if name in f.read_text()]
    assert not bad, "\n".join(bad)


def test_backends_import_only_public_fxpass_modules() -> None:
    """A device plugin builds on what the core publishes; a private module or name
    (``_name``) may change under it. (Within ``backends/`` a package's own modules are its
    business; the shared rule helpers ``fxpass.rules._util`` are the rule set's, which the
    lowering reads for the casts the rules insert.)"""
    bad = []
    for f in _product_files("backends"):
        for name in _imports(f):
            parts = name.split(".")
            private = [p for p in parts[1:] if p.startswith("_") and not p.startswith("__")]
            if (private and not name.startswith(("fxpass.backends.", "fxpass.rules._util"))):
                bad.append(f"{f.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_bpu_plugin_is_thin() -> None:
    n = sum(len(f.read_text().splitlines()) for f in _product_files("backends/bpu"))
    assert n <= 1500, f"backends/bpu is {n} lines of product code"
