"""The core needs no test kit: importing fxpass, its rules and the BPU backend never imports
Hypothesis or pytest, and the core's modules import one another in one direction.

Why: a plain ``pip install fxpass`` has neither (they are the ``test`` extra), and
``rules/rms_norm.py`` builds its pattern by example at import time; when that tracing lived in
``fxpass.testing``, whose ``__init__`` imports Hypothesis, the built-in rules plugin failed to
load and ``torch.compile(..., backend="fxpass_bpu")`` broke on a plain install.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "fxpass"
KIT_ONLY = ("hypothesis", "pytest", "fxpass.testing")


def _module_name(path: Path) -> str:
    """``fxpass/testing/check.py`` -> ``fxpass.testing.check``; a package is its __init__."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module_level_only: bool) -> list[str]:
    """The absolute names of the modules ``path`` imports (relative imports resolved; ``from .
    import x`` names submodule ``x`` where one exists). Function-level imports count unless
    ``module_level_only``: a lazy import that dodges a circle is still a dependency."""
    tree = ast.parse(path.read_text())
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    if module_level_only:  # statements under module-level if/try, but not `if TYPE_CHECKING`
        nodes = []
        todo = list(tree.body)
        while todo:
            n = todo.pop()
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                todo.extend(n.orelse)
            elif isinstance(n, (ast.If, ast.Try)):
                todo.extend(n.body + n.orelse + getattr(n, "finalbody", []))
                todo.extend(s for h in getattr(n, "handlers", []) for s in h.body)
            else:
                nodes.append(n)
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            out.append(base)
            for a in node.names:  # `from . import env`: the submodule env
                sub = ROOT.joinpath(*f"{base}.{a.name}".split("."))
                if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists():
                    out.append(f"{base}.{a.name}")
    return out


def _core_files() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


#: Lazy import circles the machinery brought along when it moved from the BPU backend into
#: the core (issue 44). A ratchet: a new circle fails, and so does a listed one that is gone.
KNOWN_CIRCLES = {
    "fxpass.aot.package -> fxpass.aot.write -> fxpass.aot.package",
    "fxpass.aot.export -> fxpass.aot.package -> fxpass.hf.encoders -> fxpass.aot.export",
    "fxpass.aot.package -> fxpass.hf.encoders -> fxpass.aot.package",
    "fxpass.jit.backend -> fxpass.jit.guarded -> fxpass.jit.backend",
    "fxpass.jit.backend -> fxpass.jit.shapes -> fxpass.jit.backend",
}


def test_the_core_imports_in_one_direction():
    names = {_module_name(p): p for p in _core_files()}
    edges = {
        m: {i for i in _imports(p, module_level_only=False) if i in names and i != m}
        for m, p in names.items()
    }
    for m in edges:  # a package's __init__ is imported before its modules: not an edge back
        edges[m] = {i for i in edges[m] if not m.startswith(i + ".")}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycles.append([*path[path.index(n):], n])
            elif n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    found = {" -> ".join(c) for c in cycles}
    assert not found - KNOWN_CIRCLES, f"import circles in the core: {sorted(found - KNOWN_CIRCLES)}"
    assert not KNOWN_CIRCLES - found, f"gone, delete from KNOWN_CIRCLES: {KNOWN_CIRCLES - found}"


def test_nothing_outside_the_kit_imports_the_kit():
    """Core modules at any level (a lazy import runs too); the rules and backends at module
    level (what ``import`` runs), so a test-only helper function there stays possible."""
    offenders = []
    for path in _core_files():
        if "testing" in path.relative_to(CORE).parts:
            continue
        offenders += [f"{path.relative_to(ROOT)}: {i}" for i in _imports(path, False)
                      if i.startswith(KIT_ONLY)]
    for path in sorted([*(ROOT / "rules").rglob("*.py"), *(ROOT / "backends").rglob("*.py")]):
        offenders += [f"{path.relative_to(ROOT)}: {i}" for i in _imports(path, True)
                      if i.startswith(KIT_ONLY)]
    assert not offenders, offenders


def test_the_kit_re_exports_the_cores_tracer():
    from fxpass.testing import trace as kit_trace
    from fxpass.tracing import trace

    assert kit_trace is trace


FRESH = textwrap.dedent(
    """
    import sys

    sys.modules["hypothesis"] = None  # `import hypothesis` now raises ImportError
    sys.modules["pytest"] = None
    import warnings

    import torch

    import fxpass
    from fxpass.plugins import PluginLoadWarning

    warnings.simplefilter("error", PluginLoadWarning)  # a skipped plugin fails here
    import fxpass.backends.bpu
    import fxpass.rules
    from fxpass.rules import rms_norm

    reg = fxpass.load()
    assert not reg.failures, reg.failures
    assert "rms_norm" in reg.rules and "bpu" in reg.targets
    assert rms_norm.pattern is not None

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.eval()
    x = torch.randn(3, 16)
    compiled = torch.compile(model, backend="fxpass_bpu", options={"min_compute_macs": 0})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    report = fxpass.compile_reports()[-1]
    assert report.regions and not any("plugin" in n for n in report.notes), str(report)
    print("ok")
    """
)


@pytest.mark.slow
def test_a_fresh_interpreter_without_hypothesis_or_pytest_compiles(tmp_path):
    env = {**os.environ, "FXPASS_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
