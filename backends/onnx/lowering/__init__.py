"""Lower a BPU region (a small aten FX GraphModule) to a validated ONNX model.

Modules, each readable in one sitting:

* :mod:`.table`: ``OPS``, the one table (op -> emitter, family, check, tuple outputs), and
  :class:`.table.Reasons`, the one function that says why a node cannot run in a region; the
  partitioner and the lowering both ask it;
* :mod:`.checks`: value and argument checks the reason function reads;
* :mod:`.builder`: the ONNX builder and the helpers emitters share;
* :mod:`.emitters`, :mod:`.nn`: the emitters;
* :mod:`.driver`: :func:`lower`.
"""

from fxpass.backends.onnx.lowering.builder import LoweringError
from fxpass.backends.onnx.lowering.driver import (
    lower,
    lower_weightless,
    point_external,
    write_weights,
    write_weights_file,
)
from fxpass.backends.onnx.lowering.table import (
    FAMILIES,
    LOWERINGS,
    OPS,
    Op,
    Reasons,
    can_lower,
)

__all__ = [
    "FAMILIES",
    "LOWERINGS",
    "OPS",
    "LoweringError",
    "Op",
    "Reasons",
    "can_lower",
    "lower",
    "lower_weightless",
    "point_external",
    "write_weights",
    "write_weights_file",
]
