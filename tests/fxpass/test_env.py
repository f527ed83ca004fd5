"""FXPASS_* environment variables are validated in one place, with errors that name them."""

import importlib
import warnings

import pytest
import torch

from fxpass import PassManager, RuleError, load, rule, select_rules
from tests.conftest import trace

aten = torch.ops.aten


@rule(aten.neg.default)
def neg_to_mul(node, rw):
    rw.replace(node, rw.call(aten.mul.Tensor, node.args[0], -1.0))
    return True


def _negs(x):
    return x.neg().neg().neg()


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


# -- FXPASS_REWRITE_LIMIT -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["env", "arg"])
def test_rewrite_limit_zero_means_zero_rewrites(how, monkeypatch):
    gm = trace(_negs, torch.randn(4))
    before = str(gm.graph)
    if how == "env":
        monkeypatch.setenv("FXPASS_REWRITE_LIMIT", "0")
        pm = PassManager([neg_to_mul])
    else:
        pm = PassManager([neg_to_mul], rewrite_limit=0)
    with pytest.warns(UserWarning, match="partial"):
        report = pm.run(gm)
    assert report.total_rewrites == 0 and report.stopped_at_limit
    assert str(gm.graph) == before


@pytest.mark.parametrize("bad", ["abc", "-1", "1.5", "1e3"])
def test_bad_rewrite_limit_names_the_variable(bad, monkeypatch):
    monkeypatch.setenv("FXPASS_REWRITE_LIMIT", bad)
    with pytest.raises(ValueError, match="FXPASS_REWRITE_LIMIT") as ei:
        PassManager([neg_to_mul])
    assert "integer >= 0" in str(ei.value)


def test_negative_rewrite_limit_argument_is_refused():
    with pytest.raises(ValueError, match="rewrite_limit"):
        PassManager([neg_to_mul], rewrite_limit=-1)


def test_stopping_at_the_limit_warns_that_the_result_is_partial(monkeypatch):
    monkeypatch.setenv("FXPASS_REWRITE_LIMIT", "1")
    gm = trace(_negs, torch.randn(4))
    with pytest.warns(UserWarning, match="partial") as w:
        report = PassManager([neg_to_mul]).run(gm)
    assert report.total_rewrites == 1 and report.stopped_at_limit
    assert "1" in str(w[0].message) and "FXPASS_REWRITE_LIMIT" in str(w[0].message)
    assert _targets(gm).count(aten.neg.default) == 2


def test_a_limit_that_is_not_reached_is_a_fixpoint(monkeypatch):
    monkeypatch.setenv("FXPASS_REWRITE_LIMIT", "3")  # exactly the rewrites needed
    gm = trace(_negs, torch.randn(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = PassManager([neg_to_mul], check=True).run(gm)
    assert report.total_rewrites == 3 and not report.stopped_at_limit
    monkeypatch.setenv("FXPASS_REWRITE_LIMIT", "")  # empty: no limit
    assert PassManager([neg_to_mul]).rewrite_limit is None


# -- FXPASS_CHECK ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, on",
    [("1", True), ("true", True), ("TRUE", True), ("0", False), ("false", False), ("", False)],
)
def test_check_flag_values(value, on, monkeypatch):
    monkeypatch.setenv("FXPASS_CHECK", value)
    assert PassManager([neg_to_mul]).check is on


@pytest.mark.parametrize("bad", ["2", "yes please", "on1"])
def test_bad_check_flag_names_the_variable_and_the_valid_values(bad, monkeypatch):
    monkeypatch.setenv("FXPASS_CHECK", bad)
    with pytest.raises(ValueError, match="FXPASS_CHECK") as ei:
        PassManager([neg_to_mul])
    assert "0, 1, true, false" in str(ei.value)


# -- FXPASS_ENABLE / FXPASS_DISABLE -----------------------------------------------------------


@pytest.mark.parametrize("var", ["FXPASS_ENABLE", "FXPASS_DISABLE"])
def test_rule_lists_name_the_variable(var, monkeypatch):
    reg = load()
    monkeypatch.setenv(var, "no_such_rule")
    with pytest.raises(ValueError, match=var) as ei:
        select_rules(reg)
    assert "known rules" in str(ei.value)
    monkeypatch.setenv(var, "cse constant_folding")  # a space, not a comma
    with pytest.raises(ValueError, match=var):
        select_rules(reg)
    monkeypatch.setenv(var, " cse , ")  # whitespace and a trailing comma are fine
    select_rules(reg)


# -- constant folding: read at run time, validated ------------------------------------------


@pytest.fixture
def cf_module(monkeypatch):
    # the package re-exports the rule under the module's name: fetch the module itself
    cf = importlib.import_module("fxpass.rules.constant_folding")
    yield cf
    monkeypatch.delenv("FXPASS_FOLD_MAX_GROWTH", raising=False)
    monkeypatch.delenv("FXPASS_FOLD_MIN_BYTES", raising=False)
    importlib.reload(cf)


def _foldable_graph():
    def f(x):
        big = torch.ones(1, 1).expand(64, 64)  # 4 bytes in, 16 KiB out
        return x + big

    return trace(f, torch.randn(64, 64))


@pytest.mark.parametrize(
    "var, bad",
    [
        ("FXPASS_FOLD_MAX_GROWTH", "abc"),
        ("FXPASS_FOLD_MAX_GROWTH", "nan"),
        ("FXPASS_FOLD_MAX_GROWTH", "-1"),
        ("FXPASS_FOLD_MIN_BYTES", "abc"),
        ("FXPASS_FOLD_MIN_BYTES", "1e6"),
        ("FXPASS_FOLD_MIN_BYTES", "-5"),
    ],
)
def test_bad_fold_settings_fail_at_run_time_naming_the_variable(var, bad, cf_module, monkeypatch):
    monkeypatch.setenv(var, bad)
    cf = importlib.reload(cf_module)  # importing the built-in rules must not fail
    with pytest.raises(RuleError, match=var) as ei:
        PassManager([cf.constant_folding]).run(_foldable_graph())
    assert ei.value.rule == "constant_folding"


def test_fold_settings_are_read_when_the_rule_runs(cf_module, monkeypatch):
    gm = _foldable_graph()
    monkeypatch.setenv("FXPASS_FOLD_MIN_BYTES", "0")  # set after import: still honoured
    monkeypatch.setenv("FXPASS_FOLD_MAX_GROWTH", "2")
    report = PassManager([cf_module.constant_folding]).run(gm)
    assert aten.expand.default in _targets(gm)
    assert any("refused to fold" in why for _, _, why in report.skips)
    monkeypatch.setenv("FXPASS_FOLD_MAX_GROWTH", "inf")  # inf: no growth limit
    gm = _foldable_graph()
    PassManager([cf_module.constant_folding]).run(gm)
    assert aten.expand.default not in _targets(gm)


def test_every_variable_is_documented_and_validated(monkeypatch):
    from fxpass import env

    for name in env.VARIABLES:
        assert name.startswith("FXPASS_") and name in env.__doc__
        monkeypatch.setenv(name, "\x01bogus,, ,")
        with pytest.raises(ValueError, match=name):
            env.get(name)
        monkeypatch.delenv(name)
        env.get(name)  # the default is valid
