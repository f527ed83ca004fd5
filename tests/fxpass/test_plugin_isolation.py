"""A broken third-party plugin is reported and skipped; plugins can be switched off."""

import importlib
import sys
import warnings

import pytest

from fxpass import load
from fxpass.plugins import PluginLoadWarning

GOOD = '''
import torch
from fxpass import rule


@rule(torch.ops.aten.sigmoid.default)
def {name}(node, rw):
    """A third party's rule."""
    return False


def fxpass_rules():
    return [{name}]
'''


def make_dist(root, dist, module, body):
    """A minimal installed distribution with an ``fxpass`` entry point named ``module``."""
    where = root / dist
    where.mkdir()
    (where / f"{module}.py").write_text(body)
    info = where / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[fxpass]\n{module} = {module}\n")
    sys.path.insert(0, str(where))
    importlib.invalidate_caches()


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("FXPASS_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("FXPASS_BLOCK_PLUGINS", raising=False)
    yield tmp_path
    for m in [m for m in sys.modules if m.startswith("tp_")]:
        del sys.modules[m]
    importlib.invalidate_caches()


@pytest.fixture(autouse=True)
def _fresh_registry():
    yield
    load(refresh=True)


def _load(**kw):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        reg = load(refresh=True, **kw)
    return reg, [str(x.message) for x in w if issubclass(x.category, PluginLoadWarning)]


def _builtins_intact(reg):
    assert "cse" in reg.rules and "bpu" in reg.targets


BROKEN_HOOKS = {
    "raises": ("def fxpass_rules():\n    raise RuntimeError('kaput')\n", "kaput"),
    "none": ("def fxpass_rules():\n    return None\n", "None"),
    "string": ("def fxpass_rules():\n    return 'cse'\n", "str"),
    "not_a_rule": ("def fxpass_rules():\n    return [42]\n", "42"),
    "not_a_target": ("def fxpass_targets():\n    return ['bpu2']\n", "bpu2"),
    "exits": ("def fxpass_rules():\n    raise SystemExit(2)\n", "SystemExit"),
    "bad_signature": ("def fxpass_rules(config):\n    return []\n", "config"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_HOOKS))
def test_broken_hook_is_reported_with_its_plugin_and_skipped(case, site):
    body, detail = BROKEN_HOOKS[case]
    make_dist(site, "tp-bad", "tp_bad", body)
    make_dist(site, "tp-good", "tp_good", GOOD.format(name="tp_good_rule"))
    reg, msgs = _load()
    _builtins_intact(reg)
    assert "tp_good_rule" in reg.rules
    assert any("tp_bad" in m and "tp-bad" in m and detail in m for m in msgs), msgs
    assert [s for s, _ in reg.failures] == ["tp-bad:tp_bad"]


def test_a_plugin_with_one_bad_hook_contributes_nothing(site):
    body = GOOD.format(name="tp_half_rule") + "\ndef fxpass_targets():\n    raise ValueError('x')\n"
    make_dist(site, "tp-half", "tp_half", body)
    reg, msgs = _load()
    assert "tp_half_rule" not in reg.rules and any("tp_half" in m for m in msgs)
    _builtins_intact(reg)


def test_sys_exit_at_import_is_reported_and_skipped(site):
    make_dist(site, "tp-exit", "tp_exit", "import sys\nsys.exit('bye')\n")
    reg, msgs = _load()
    _builtins_intact(reg)
    assert any("tp_exit" in m and "tp-exit" in m and "SystemExit" in m for m in msgs), msgs


def test_keyboard_interrupt_at_import_is_not_swallowed(site):
    make_dist(site, "tp-ctrlc", "tp_ctrlc", "raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        load(refresh=True)


def test_misspelled_hook_is_an_error_naming_the_plugin(site):
    make_dist(
        site,
        "tp-typo",
        "tp_typo",
        GOOD.format(name="tp_typo_rule").replace("def fxpass_rules", "def fxpass_rule"),
    )
    reg, msgs = _load()
    _builtins_intact(reg)
    assert "tp_typo_rule" not in reg.rules
    assert any("tp-typo" in m and "tp_typo" in m and "fxpass_rule" in m for m in msgs), msgs


def test_disable_plugin_autoload_keeps_only_the_builtins(site, monkeypatch):
    make_dist(site, "tp-auto", "tp_auto", GOOD.format(name="tp_auto_rule"))
    assert "tp_auto_rule" in load(refresh=True).rules
    monkeypatch.setenv("FXPASS_DISABLE_PLUGIN_AUTOLOAD", "1")
    reg = load(refresh=True)
    assert "tp_auto_rule" not in reg.rules
    _builtins_intact(reg)
    assert {r.plugin for r in reg.rules.values()} == {"fxpass:builtin_rules"}
    monkeypatch.setenv("FXPASS_DISABLE_PLUGIN_AUTOLOAD", "2")
    with pytest.raises(ValueError, match="FXPASS_DISABLE_PLUGIN_AUTOLOAD"):
        load(refresh=True)


def test_block_plugins_by_entry_point_name(site, monkeypatch):
    make_dist(site, "tp-blk", "tp_blk", GOOD.format(name="tp_blk_rule"))
    reg, msgs = _load(block=("tp_blk",))
    assert "tp_blk_rule" not in reg.rules and not msgs
    _builtins_intact(reg)
    assert "tp_blk_rule" in load().rules  # the cache is per configuration
    assert "bpu" not in load(block=["bpu"]).targets
    monkeypatch.setenv("FXPASS_BLOCK_PLUGINS", "tp_blk, bpu")
    reg = load(refresh=True)
    assert "tp_blk_rule" not in reg.rules and "bpu" not in reg.targets and "cse" in reg.rules


def test_unknown_blocked_name_warns_listing_known_ones(site, monkeypatch):
    make_dist(site, "tp-blk2", "tp_blk2", GOOD.format(name="tp_blk2_rule"))
    reg, msgs = _load(block=("tp_nope",))
    assert "tp_blk2_rule" in reg.rules
    assert any("tp_nope" in m and "builtin_rules" in m and "tp_blk2" in m for m in msgs), msgs
    monkeypatch.setenv("FXPASS_BLOCK_PLUGINS", "also_nope")
    reg, msgs = _load()
    assert any("also_nope" in m and "FXPASS_BLOCK_PLUGINS" in m for m in msgs), msgs


def test_a_half_registered_plugin_does_not_poison_the_next_one(site):
    # pluggy registers hooks in name order and stops at the bad signature, leaving the
    # misspelled hook behind unless the plugin is unregistered: check_pending would then
    # blame every plugin loaded after it
    body = "def fxpass_rule():\n    return []\n\ndef fxpass_rules(config):\n    return []\n"
    make_dist(site, "tp-a-bad", "tp_a_bad", body)
    make_dist(site, "tp-b-good", "tp_b_good", GOOD.format(name="tp_b_rule"))
    reg, msgs = _load()
    assert "tp_b_rule" in reg.rules
    assert [s for s, _ in reg.failures] == ["tp-a-bad:tp_a_bad"]
