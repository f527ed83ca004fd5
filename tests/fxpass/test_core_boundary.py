"""The core imports no backend; plugins contribute CLI commands through fxpass_commands."""

import ast
import types
from pathlib import Path

from fxpass.cli import build_parser
from fxpass.plugins import Command, load

CORE = Path(__file__).resolve().parents[2] / "fxpass"


#: The backend imports the core makes: none (the device API is how the core reaches a device).
#: Kept as a ratchet's list so that a crossing, if ever needed, is named and reviewed here.
REMAINING: set[str] = set()


def _backend_imports() -> set[str]:
    found = set()
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            rel = path.relative_to(CORE.parent).as_posix()
            found |= {f"{rel}: {n}" for n in names if "backends" in n and "torch." not in n}
    return found


def test_no_core_module_imports_a_backend():
    found = _backend_imports()
    assert not found - REMAINING, f"new backend imports in the core: {sorted(found - REMAINING)}"
    assert not REMAINING - found, f"gone, delete from REMAINING: {sorted(REMAINING - found)}"


def test_bpu_commands_come_from_its_plugin():
    reg = load()
    assert {"demo", "explain"} <= set(reg.commands)
    assert reg.commands["demo"].plugin.endswith(":bpu")
    help_text = build_parser().format_help()
    assert "demo (fxpass:bpu)" in help_text and "explain (fxpass:bpu)" in help_text


def test_a_third_party_command_registers_with_its_plugin_name():
    ran = []
    mod = types.ModuleType("my_cli_plugin")
    mod.fxpass_commands = lambda: [
        Command("hello", "say hello", lambda p: p.add_argument("--who"), ran.append)
    ]
    reg = load(extra=[mod])
    cmd = reg.commands["hello"]
    assert cmd.plugin == "<extra:my_cli_plugin>"
    cmd.run("args")
    assert ran == ["args"]


def test_unknown_target_error_names_the_plugins_that_failed():
    import pytest

    from fxpass.plugins import Registry, select_rules

    reg = Registry(failures=[("acme:rules", "ImportError: no module named acme")])
    with pytest.raises(ValueError, match="plugins that failed to load: acme:rules"):
        select_rules(reg, target="bpu")
