"""The whole rule set reaches fixpoint on aten graphs of stock transformers models."""

import pytest
import torch

from fxpass import PassManager, select_rules
from fxpass import capture_graphs as capture
from fxpass.rules._util import CAST
from fxpass.rules.bf16_promotion import LOOKUPS
from fxpass.tools import zoo

aten = torch.ops.aten
FORBIDDEN = {aten.alias.default, aten._safe_softmax.default}
MODELS = ["qwen3", "llama", "mistral", "gpt2", "bert", "vit"]


def _is_sdpa(t):
    return "scaled_dot_product" in str(t)


def _flat(out):
    return [
        t
        for t in (out if isinstance(out, (tuple, list)) else [out])
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", MODELS)
def test_rules_reach_fixpoint_on_stock_models(name, dtype):
    # HF wraps every model's forward in one shared decorator function: after Dynamo's
    # recompile limit of captures in one process (other test files capture too), it would
    # graph-break there. Each capture starts from a clean Dynamo.
    torch._dynamo.reset()
    model, kwargs = zoo.get(name, dtype=dtype)
    graphs = capture(model, **kwargs)
    assert len(graphs) == 1, "one Dynamo graph per fixed-shape forward"
    c = graphs[0]
    gm = c.gm
    assert any(_is_sdpa(n.target) for n in gm.graph.nodes), "model should use SDPA"
    expected = _flat(gm(*c.inputs))
    rules = select_rules(target="bpu")  # includes BF16 promotion
    report = PassManager(rules, check=True).run(gm)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not targets & FORBIDDEN
    assert not any(_is_sdpa(t) for t in targets)
    assert report.rewrites.get("sdpa_decomposition", 0) >= 2
    got = _flat(gm(*c.inputs))
    assert len(got) == len(expected)
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        if dtype == torch.float32:
            scale = max(1.0, e.abs().max().item())
            assert (g - e).abs().max().item() <= 1e-5 * scale
        else:
            cos = torch.nn.functional.cosine_similarity(e.float().flatten(), g.float().flatten(), 0)
            assert cos >= 0.999
            assert not any(
                isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype == dtype
                for n in gm.graph.nodes
                if n.op == "call_function" and n.target is not CAST and n.target not in LOOKUPS
            ), "BF16 compute left after promotion (a lookup copies BF16 rows, exactly)"
            # the embedding reads its BF16 table in place: no float32 copy of it is folded
            tables = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
            assert not any(
                getattr(gm, n.target).shape == table.shape
                and getattr(gm, n.target).dtype == torch.float32
                for table in tables
                for n in gm.graph.nodes
                if n.op == "get_attr"
            ), "a float32 copy of an embedding table"
            assert tables or name == "vit"  # the language models have one
    again = PassManager(rules, check=True).run(gm)
    assert again.total_rewrites == 0
