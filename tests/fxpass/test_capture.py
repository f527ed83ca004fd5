"""fxpass.capture: the public way to get aten graphs for PassManager.run (and its doc block)."""

import re
from pathlib import Path

import torch

import fxpass
from fxpass.graph import FROZEN

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-rule.md"


def test_capture_returns_runnable_aten_graphs_with_meta_and_frozen_weights():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(3, 8)
    (gm,) = fxpass.capture(model, x)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    assert all(isinstance(n.meta.get("val"), torch.Tensor) for n in nodes)
    modes = {n.meta["val"].fake_mode for n in nodes}
    assert len(modes) == 1, "one shared fake mode"
    assert sum(FROZEN in p.meta for p in gm.graph.find_nodes(op="placeholder")) == 2
    assert all(str(n.target).startswith("aten.") for n in nodes if n.op == "call_function")
    (out,) = gm(*gm.meta["fxpass_example_inputs"])
    torch.testing.assert_close(out, model(x))


def test_capture_doc_block_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    (block,) = [b for b in blocks if "fxpass.capture(" in b]
    exec(compile(block, str(DOC), "exec"), {})


def test_mixed_fake_modes_are_named_with_the_fix():
    import pytest
    from torch.fx.experimental.proxy_tensor import make_fx

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    gm = make_fx(model)(torch.randn(2, 8))  # real inputs: each node gets its own fake mode
    modes = {id(n.meta["val"].fake_mode) for n in gm.graph.nodes if "val" in n.meta}
    assert len(modes) >= 2, "premise: make_fx on real inputs mixes fake modes"
    with pytest.raises(ValueError, match="fxpass.capture"):
        fxpass.PassManager(fxpass.select_rules()).run(gm)
