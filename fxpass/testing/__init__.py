"""Property-testing kit for rule authors: strategies for aten graphs and ``check_rule``."""

from .check import (
    DEFAULT_EXAMPLES,
    SPECIAL_VALUES,
    TOLERANCE,
    assert_outputs_close,
    check_meta,
    check_rule,
    random_inputs,
)
from .strategies import (
    DEFAULT_OPS,
    VOCAB,
    Op,
    T,
    aten_graphs,
    pattern_graphs,
    trace,
    traced_graphs,
)

__all__ = [
    "DEFAULT_EXAMPLES",
    "DEFAULT_OPS",
    "SPECIAL_VALUES",
    "TOLERANCE",
    "VOCAB",
    "Op",
    "T",
    "assert_outputs_close",
    "aten_graphs",
    "check_meta",
    "check_rule",
    "pattern_graphs",
    "random_inputs",
    "trace",
    "traced_graphs",
]
