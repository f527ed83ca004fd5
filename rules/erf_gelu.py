"""erf_gelu: the erf formula of GELU written out -> ``gelu(x)``.

Before -> after: ``x * 0.5 * (1 + erf(x / sqrt(2)))`` (also ``x * 0.7071...`` inside the erf)
-> ``gelu(x)`` (the exact, erf-based GELU).

Why: models written before ``F.gelu`` existed spell it out (ESM, and many research codes). The
BPU has ``gelu`` on its activation list but no ``erf``, so the spelled-out form split the
region at every MLP.

Exact up to rounding for finite ``|x| <= FLT_MAX / 2``: ``gelu`` evaluates the same formula
(``x * 0.5 * (1 + erf(x * M_SQRT1_2))``). At the edge of float32 aten's gelu kernel (which the
lowering follows, host by host) differs from the spelled-out form: NaN at ``+inf`` where that
kernel gives NaN (the formula gives inf), and inf above ``FLT_MAX / 2`` in float32, where it
multiplies before halving (``docs/failure-model.md``).
"""

from __future__ import annotations

import math

from fxpass.pattern import Num, Or, P, Var, pattern_rule
from fxpass.rules._util import aten

_HALF = P(aten.mul.Tensor, Var("x"), Num("half"), commute=True)


def _erf_of(scaled: P) -> P:
    return P(aten.mul.Tensor, _HALF,
             P(aten.add.Tensor, P(aten.erf.default, scaled), Num("one"), commute=True),
             commute=True)


def _constants(m) -> bool | str:
    if m.half != 0.5 or m.one != 1:
        return "not the GELU constants (0.5, 1)"
    if "div_k" in m.bindings:
        if not math.isclose(m.div_k, math.sqrt(2.0), rel_tol=1e-6):
            return f"not x / {math.sqrt(2.0):.6g} inside the erf"
    elif not math.isclose(m.mul_k, math.sqrt(0.5), rel_tol=1e-6):
        return f"not x * {math.sqrt(0.5):.6g} inside the erf"
    return True


def _has_erf(gm) -> bool:
    """Offer the rule only to graphs with an erf: every other mul would be a near miss in the
    report."""
    return bool(gm.graph.find_nodes(op="call_function", target=aten.erf.default))


#: both spellings of the scaled input: x / sqrt(2), or x * sqrt(0.5)
_SCALED = Or(P(aten.div.Tensor, Var("x"), Num("div_k")),
             P(aten.mul.Tensor, Var("x"), Num("mul_k"), commute=True))


@pattern_rule(_erf_of(_SCALED), name="erf_gelu", check=_constants, applies=_has_erf)
def erf_gelu(rw, m):
    """x * 0.5 * (1 + erf(x / sqrt(2))) -> gelu(x)."""
    return rw.call(aten.gelu.default, m.x)
