"""square: ``x * x`` and ``x ** 2.0`` -> ``x ** 2`` (``pow.Tensor_Scalar(x, 2)``), one spelling.

Why: models square three ways (``x.pow(2)``, ``x ** 2.0``, ``x * x``), and a pattern written
for one (an RMSNorm, a variance) missed the others. With one canonical spelling, one pattern
(``fxpass.pattern.pattern_from`` normalizes its example the same way) matches all three.

Exact: ATen computes ``pow(x, 2)`` as ``x * x`` (its scalar-exponent kernel special-cases 2),
and ``2.0`` and ``2`` are the same exponent. Floating tensors only (an integer ``x * x`` keeps
its integer semantics); ``x * y`` with two different values is left alone.
"""

from __future__ import annotations

import torch

from fxpass import rule
from fxpass.rules._util import aten


@rule(aten.mul.Tensor, aten.pow.Tensor_Scalar, name="square")
def square(node, rw) -> bool:
    """x * x and x ** 2.0 -> x ** 2."""
    if node.target is aten.pow.Tensor_Scalar:
        if len(node.args) != 2 or node.kwargs or not (
                isinstance(node.args[1], float) and node.args[1] == 2.0):
            return False
        x = node.args[0]
    else:
        if len(node.args) != 2 or node.kwargs or node.args[0] is not node.args[1]:
            return False
        x = node.args[0]
    val = rw.val(x)
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
        return rw.skip("not a floating tensor")
    rw.replace(node, rw.call(aten.pow.Tensor_Scalar, x, 2))
    return True
