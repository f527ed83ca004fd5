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

from fxpass.pattern import Num, P, Var, pattern_rule
from fxpass.rules._util import aten

_HALF = P(aten.mul.Tensor, Var("x"), Num("half"), commute=True)


def _erf_of(scaled: P) -> P:
    return P(aten.mul.Tensor, _HALF,
             P(aten.add.Tensor, P(aten.erf.default, scaled), Num("one"), commute=True),
             commute=True)


def _constants(k: float):
    def check(m) -> bool | str:
        if m.half != 0.5 or m.one != 1:
            return "not the GELU constants (0.5, 1)"
        if not math.isclose(m.k, k, rel_tol=1e-6):
            return f"not x * {k:.6g} inside the erf"
        return True

    return check


def _has_erf(gm) -> bool:
    """Offer the rules only to graphs with an erf: every other mul would be a near miss in the
    report."""
    return bool(gm.graph.find_nodes(op="call_function", target=aten.erf.default))


def _gelu(rw, m):
    """x * 0.5 * (1 + erf(x / sqrt(2))) -> gelu(x)."""
    return rw.call(aten.gelu.default, m.x)


erf_gelu = pattern_rule(
    _erf_of(P(aten.div.Tensor, Var("x"), Num("k"))), name="erf_gelu",
    check=_constants(math.sqrt(2.0)), applies=_has_erf,
)(_gelu)
erf_gelu_scaled = pattern_rule(
    _erf_of(P(aten.mul.Tensor, Var("x"), Num("k"), commute=True)), name="erf_gelu_scaled",
    check=_constants(math.sqrt(0.5)), applies=_has_erf,
)(_gelu)
