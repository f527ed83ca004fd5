"""The complete example of docs/writing-a-rule.md, run as a test so the doc stays true."""

import re
import sys
import types
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-rule.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_doc_rule_registers_and_passes_check_rule(monkeypatch):
    rule_src, test_src = _blocks()[0], _blocks()[1]
    mod = types.ModuleType("my_rules.gelu_tanh")
    exec(compile(rule_src, "gelu_tanh.py", "exec"), mod.__dict__)
    pkg = types.ModuleType("my_rules")
    pkg.gelu_tanh = mod
    monkeypatch.setitem(sys.modules, "my_rules", pkg)
    monkeypatch.setitem(sys.modules, "my_rules.gelu_tanh", mod)
    (rule,) = mod.fxpass_rules()
    assert rule.name == "gelu_tanh" and "torch._decomp" in rule.description
    ns: dict = {}
    exec(compile(test_src, "test_gelu_tanh.py", "exec"), ns)
    ns["test_gelu_tanh"]()  # runs check_rule: must fire and keep semantics
    from fxpass import PassManager
    from tests.conftest import trace

    x = torch.randn(4, 5)
    gm = trace(lambda t: torch.nn.functional.gelu(t, approximate="tanh"), x)
    assert PassManager([rule]).run(gm).rewrites == {"gelu_tanh": 1}
    torch.testing.assert_close(gm(x), torch.nn.functional.gelu(x, approximate="tanh"))
