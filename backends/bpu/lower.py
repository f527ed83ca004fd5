"""Compatibility import path: the lowering lives in :mod:`fxpass.backends.bpu.device.lowering`.

``from fxpass.backends.bpu.lower import lower, LoweringError`` keeps working for callers
(backend, compile, tests, benchmarks); new code imports from ``.lowering``.
"""

from fxpass.backends.bpu.device.lowering import (
    LOWERINGS,
    OPS,
    LoweringError,
    Reasons,
    can_lower,
    lower,
)

__all__ = ["LOWERINGS", "OPS", "LoweringError", "Reasons", "can_lower", "lower"]
