import importlib
import sys
import textwrap
import warnings

import pytest
import torch

from fxpass import PassManager, load, select_rules
from fxpass.plugins import PluginLoadWarning
from tests.conftest import trace

PLUGIN = '''
import torch
from fxpass import rule

aten = torch.ops.aten


@rule(aten.sigmoid.default)
def {name}(node, rw):
    """sigmoid(x) -> 1 / (1 + exp(-x)), written by a third party."""
    x = node.args[0]
    e = rw.call(aten.exp.default, rw.call(aten.neg.default, x))
    rw.replace(node, rw.call(aten.reciprocal.default, rw.call(aten.add.Tensor, e, 1.0)))
    return True


def fxpass_rules():
    return [{name}]
'''


def make_dist(root, dist, module, body):
    """A minimal installed distribution with an ``fxpass`` entry point, on its own sys.path
    entry (as pip would install it), visible to importlib.metadata."""
    where = root / dist
    where.mkdir()
    (where / f"{module}.py").write_text(body)
    info = where / f"{dist.replace('-', '_')}-0.1.dist-info"  # wheel naming
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[fxpass]\n{module} = {module}\n")
    sys.path.insert(0, str(where))
    importlib.invalidate_caches()


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for m in [m for m in sys.modules if m.startswith("tp_")]:
        del sys.modules[m]
    importlib.invalidate_caches()


@pytest.fixture(autouse=True)
def _fresh_registry():
    yield
    load(refresh=True)


def test_builtin_rules_and_bpu_target_come_through_entry_points():
    reg = load(refresh=True)
    assert "bpu" in reg.targets and reg.targets["bpu"].plugin.startswith("fxpass:")
    assert reg.rules and all(r.plugin == "fxpass:builtin_rules" for r in reg.rules.values())


def test_third_party_plugin_is_discovered_and_applied(site):
    make_dist(site, "tp-sigmoid", "tp_sigmoid", PLUGIN.format(name="tp_expand_sigmoid"))
    reg = load(refresh=True)
    r = reg.rules["tp_expand_sigmoid"]
    assert r.plugin == "tp-sigmoid:tp_sigmoid"
    assert "third party" in r.description
    assert r in select_rules(reg)
    x = torch.randn(4, 4)
    gm = trace(torch.sigmoid, x)
    report = PassManager([r]).run(gm)
    assert report.rewrites == {"tp_expand_sigmoid": 1}
    assert torch.ops.aten.sigmoid.default not in [n.target for n in gm.graph.nodes]
    torch.testing.assert_close(gm(x), torch.sigmoid(x))


def test_failing_plugin_is_reported_and_skipped(site):
    make_dist(site, "tp-broken", "tp_broken", "raise ImportError('no such thing')\n")
    make_dist(site, "tp-good", "tp_good", PLUGIN.format(name="tp_good_rule"))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        reg = load(refresh=True)
    msgs = [str(x.message) for x in w if issubclass(x.category, PluginLoadWarning)]
    assert any("tp_broken" in m and "no such thing" in m for m in msgs)
    assert "tp_good_rule" in reg.rules
    assert reg.failures and reg.failures[0][0] == "tp-broken:tp_broken"


def test_duplicate_rule_names_name_both_sources(site):
    make_dist(site, "tp-one", "tp_one", PLUGIN.format(name="tp_same"))
    make_dist(site, "tp-two", "tp_two", PLUGIN.format(name="tp_same"))
    with pytest.raises(ValueError) as ei:
        load(refresh=True)
    assert "tp-one:tp_one" in str(ei.value) and "tp-two:tp_two" in str(ei.value)


def test_select_rules_enable_disable_env_and_unknown(monkeypatch):
    reg = load(refresh=True)
    names = {r.name for r in select_rules(reg)}
    some = sorted(names)[0]
    assert some not in {r.name for r in select_rules(reg, disable=[some])}
    monkeypatch.setenv("FXPASS_DISABLE", some)
    assert some not in {r.name for r in select_rules(reg)}
    monkeypatch.setenv("FXPASS_DISABLE", "")
    with pytest.raises(ValueError, match="known rules") as ei:
        select_rules(reg, enable=["no_such_rule"])
    assert some in str(ei.value)
    with pytest.raises(ValueError, match="unknown fxpass target"):
        select_rules(reg, target="nope")


def test_cli_lists_rules_and_version(capsys):
    from fxpass.cli import main

    assert main(["rules"]) == 0
    out = capsys.readouterr().out
    reg = load()
    for name, r in reg.rules.items():
        assert name in out and r.description.split()[0] in out
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0
    assert "fxpass 0.1.0" in capsys.readouterr().out


def test_plain_module_without_decorators_is_a_plugin(site):
    body = textwrap.dedent(
        """
        from fxpass import Target
        def fxpass_targets():
            return [Target(name="tp-target", enable=(), disable=())]
        """
    )
    make_dist(site, "tp-target", "tp_target", body)
    reg = load(refresh=True)
    assert reg.targets["tp-target"].plugin == "tp-target:tp_target"


JOINING = '''
import torch
from fxpass import Target, rule

aten = torch.ops.aten


@rule(aten.sigmoid.default, default=False, targets=["bpu"])
def tp_joins_bpu(node, rw):
    """Off by default; joins the bpu target, which another plugin owns."""
    return False


@rule(aten.tanh.default, default=False, tags=["tp-exp"])
def tp_tagged(node, rw):
    """Off by default; selected by a target that enables the tag."""
    return False


@rule(aten.relu.default, default=False, priority=7)
def tp_plain(node, rw):
    """Off by default and joins nothing."""
    return False


def fxpass_rules():
    return [tp_joins_bpu, tp_tagged, tp_plain]


def fxpass_targets():
    return [Target("tp_exp", "runs every rule tagged tp-exp", enable_tags=("tp-exp",))]
'''


def test_a_plugin_rule_joins_a_target_and_targets_select_by_tag(site, capsys):
    make_dist(site, "tp-join", "tp_join", JOINING)
    reg = load(refresh=True)
    bpu = {r.name for r in select_rules(reg, target="bpu")}
    assert "tp_joins_bpu" in bpu and "bf16_promotion" in bpu
    assert "tp_tagged" not in bpu and "tp_plain" not in bpu
    assert "tp_joins_bpu" not in {r.name for r in select_rules(reg)}  # no target: default off
    tagged = {r.name for r in select_rules(reg, target="tp_exp")}
    assert "tp_tagged" in tagged and "tp_joins_bpu" not in tagged
    from fxpass.cli import main

    assert main(["rules"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("tp_plain") :].split("\n")
    assert "priority=7" in block[0] and "targets: -" in block[1]
    joins = out[out.index("tp_joins_bpu") :].split("\n")
    assert "targets: bpu;" in joins[1]
    assert "rules tagged ['tp-exp']" in out


def test_only_runs_exactly_the_named_rules(monkeypatch):
    reg = load(refresh=True)
    assert [r.name for r in select_rules(reg, target="bpu", only=["cse"])] == ["cse"]
    both = {r.name for r in select_rules(reg, only="cse,alias_removal", disable=["cse"])}
    assert both == {"alias_removal"}
    with pytest.raises(ValueError, match=r"only= and enable="):
        select_rules(reg, only=["cse"], enable=["bf16_promotion"])
    with pytest.raises(ValueError, match=r"unknown rule name\(s\) \['nope'\] in only="):
        select_rules(reg, only=["nope"])
    monkeypatch.setenv("FXPASS_DISABLE", "cse")
    assert select_rules(reg, only=["cse"]) == []
