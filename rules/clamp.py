"""clamp_to_hardtanh: ``clamp(x, lo, hi)`` with number bounds -> ``hardtanh(x, lo, hi)``.

Why: ``hardtanh`` is on the BPU's activation list and is exactly a clamp between two numbers;
``clamp``, ``clamp_min`` and ``clamp_max`` are not. ``F.normalize`` clamps the norm from below
(``clamp_min(norm, eps)``), which split Swin v2's attention from its neighbours.

Exact: the same comparisons, NaN passes through both. A missing bound is infinite. Float
tensors only (``hardtanh`` is a float op); tensor-valued bounds are left alone.
"""

from __future__ import annotations

import math

from fxpass import rule
from fxpass.rules._util import aten


def _num(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@rule(aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
      name="clamp_to_hardtanh")
def clamp_to_hardtanh(node, rw) -> bool:
    """clamp / clamp_min / clamp_max with number bounds -> hardtanh."""
    x, rest = node.args[0], list(node.args[1:])
    if node.target is aten.clamp_min.default:
        lo, hi = rest[0], None
    elif node.target is aten.clamp_max.default:
        lo, hi = None, rest[0]
    else:
        lo = rest[0] if rest else node.kwargs.get("min")
        hi = rest[1] if len(rest) > 1 else node.kwargs.get("max")
    if not rw.val(x).dtype.is_floating_point:
        return rw.skip("an integer clamp (hardtanh is a float op)")
    if any(b is not None and not _num(b) for b in (lo, hi)):
        return rw.skip("a tensor-valued bound")
    lo = -math.inf if lo is None else float(lo)
    hi = math.inf if hi is None else float(hi)
    if lo > hi:
        return rw.skip("min above max (clamp returns max everywhere; hardtanh differs)")
    rw.replace(node, rw.call(aten.hardtanh.default, x, lo, hi))
    return True
