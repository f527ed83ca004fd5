"""constant_folding leaves a layout/dtype view of one weight alone (issue 12, item 2).

Folding ``t(w)`` or ``w.to(float32)`` copies the weight for the lifetime of the graph; the
backend writes the transposed/cast weight once into its initializer instead. What is still
folded: views read by an indexing op (an embedding table), and real computations on weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxpass import PassManager
from fxpass.graph import FROZEN
from fxpass.rules import constant_folding
from tests.conftest import trace

aten = torch.ops.aten


def _freeze(gm: torch.fx.GraphModule, *weights: torch.Tensor | None) -> None:
    """Mark placeholders (by position; None: a real input) as frozen weights, as the backend
    does with ``freeze_weights``."""
    for p, w in zip(gm.graph.find_nodes(op="placeholder"), weights, strict=True):
        if w is not None:
            p.meta[FROZEN] = w


def _folded(gm: torch.fx.GraphModule) -> list[str]:
    return [n.target for n in gm.graph.nodes if n.op == "get_attr"]


def test_transposed_and_cast_weights_are_left_as_views() -> None:
    x, w = torch.randn(3, 4), torch.randn(5, 4, dtype=torch.bfloat16)

    def f(x, w):
        return x @ w.to(torch.float32).t()

    gm = trace(f, x, w)
    _freeze(gm, None, w)
    report = PassManager([constant_folding]).run(gm)
    assert _folded(gm) == [], "a view of one weight was copied into a constant"
    assert any(n.target == aten.t.default for n in gm.graph.nodes)
    assert any(
        r == "constant_folding" and "view of one weight" in why for r, _, why in report.skips
    )
    torch.testing.assert_close(gm(x, w), f(x, w))


def test_views_read_by_an_indexing_op_and_real_computations_still_fold() -> None:
    ids, table = torch.tensor([[1, 3]]), torch.randn(8, 4, dtype=torch.bfloat16)
    scale = torch.randn(4)

    def f(ids, table, scale):
        return F.embedding(ids, table.to(torch.float32)) * (scale * 2)

    gm = trace(f, ids, table, scale)
    _freeze(gm, None, table, scale)
    PassManager([constant_folding]).run(gm)
    assert len(_folded(gm)) == 2, gm.graph  # the cast table, and scale * 2
    torch.testing.assert_close(gm(ids, table, scale), f(ids, table, scale))


def test_the_lowering_materializes_every_view_the_rule_leaves() -> None:
    from fxpass.backends.onnx.lowering.table import WEIGHT_VIEWS
    from fxpass.rules.constant_folding import WEIGHT_VIEWS as LEFT

    assert LEFT <= WEIGHT_VIEWS
