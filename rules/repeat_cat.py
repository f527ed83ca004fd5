"""pointwise_before_repeat_cat: ``f(cat([a, a, ...], d))`` -> ``cat([f(a), f(a), ...], d)``.

Before -> after: a pointwise op of one tensor (plus scalars) over a cat of one tensor repeated
along a dim is computed on that tensor once; the cat moves after it.

Why: rotary embeddings are written ``emb = cat((freqs, freqs), -1); cos = emb.cos() * s``
(every HF rotary model). ``cos`` and ``sin`` stay on the CPU (not on the BPU's list), so the
region received ``cos`` as an opaque input and could not tell that its halves are equal, which
is what a fused rotary kernel needs (onnxruntime's ``RotaryEmbedding`` reads the half table,
``backends/onnx/host/rotary.py``). After this rule the repeat is a cat inside the region, visible;
``cos`` and ``sin`` also compute half the elements.

Exact: a pointwise op maps each element on its own, so it commutes with moving elements; the
same op computes the same value from the same input.

Does not fire when: the cat's operands are not all one node (two or more of it), or the op
has a second tensor operand (only scalars may ride along).
"""

from __future__ import annotations

from fxpass import rule
from fxpass.rules._util import CAST, aten

#: pointwise ops of their first argument, every other argument a scalar or an option
_UNARY = (
    aten.cos.default, aten.sin.default, aten.exp.default, aten.neg.default, aten.abs.default,
    aten.sigmoid.default, aten.tanh.default, aten.sqrt.default, aten.rsqrt.default,
    aten.reciprocal.default, aten.relu.default, aten.silu.default, CAST,
    aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor,
    aten.mul.Scalar, aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar,
)


@rule(*_UNARY, name="pointwise_before_repeat_cat")
def pointwise_before_repeat_cat(node, rw) -> bool:
    """f(cat([a] * n, d)) -> cat([f(a)] * n, d), f computed once."""
    cat, *rest = node.args
    if getattr(cat, "target", None) is not aten.cat.default:
        return False
    parts = cat.args[0]
    if len(parts) < 2 or any(p is not parts[0] for p in parts):
        return False
    if any(hasattr(a, "meta") for a in (*rest, *node.kwargs.values())):
        return rw.skip("a second tensor operand (only scalars may ride along)")
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    once = rw.call(node.target, parts[0], *rest, **node.kwargs)
    rw.replace(node, rw.call(aten.cat.default, [once] * len(parts), dim))
    return True
