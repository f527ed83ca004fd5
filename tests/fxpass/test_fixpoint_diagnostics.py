import pytest
import torch

from fxpass import FixpointError, PassManager, rule
from fxpass.passmanager import _find_cycle
from tests.conftest import trace

aten = torch.ops.aten


def test_cycle_search_follows_every_edge():
    cycle, nodes = _find_cycle({"A": {"C": "n1", "B": "n2"}, "B": {"A": "n3"}})
    assert cycle in (["A", "B", "A"], ["B", "A", "B"]) and len(nodes) == 2


@rule(aten.sin.default)
def sin_to_cos(node, rw):
    rw.retarget(node, aten.cos.default, *node.args)
    return True


@rule(aten.cos.default)
def cos_to_sin(node, rw):
    rw.retarget(node, aten.sin.default, *node.args)
    return True


@pytest.mark.parametrize("ledger", [True, False])
def test_retarget_cycles_are_named(ledger):
    gm = trace(lambda x: x.sin(), torch.randn(3))
    with pytest.raises(FixpointError) as ei:
        PassManager([sin_to_cos, cos_to_sin], check=False, ledger=ledger).run(gm)
    assert {"sin_to_cos", "cos_to_sin"} <= set(ei.value.rules)
    if ledger:
        assert set(ei.value.cycle) == {"sin_to_cos", "cos_to_sin"}
