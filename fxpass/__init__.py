"""fxpass: idempotent aten FX graph rewrites run to fixpoint, plus backend plumbing.

Pipeline: graph in -> rules (PassManager) -> partition -> lower -> run.
"""

from __future__ import annotations

from typing import Any

from ._capture import capture, capture_graphs
from .graph import propagate_meta
from .passmanager import ContractError, FixpointError, PassManager
from .plugins import Target, load, select_rules
from .report import Report
from .rewriter import Rewriter, RuleError
from .rule import Rule, graph_rule, rule

__version__ = "0.1.0"

__all__ = [
    "ContractError",
    "FixpointError",
    "PassManager",
    "Report",
    "Rewriter",
    "Rule",
    "RuleError",
    "Target",
    "__version__",
    "capture",
    "capture_graphs",
    "compile_reports",
    "graph_rule",
    "load",
    "precompile",
    "propagate_meta",
    "rule",
    "select_rules",
]


def compile_reports() -> list[Any]:
    """Per-graph reports of every graph a fxpass backend compiled in this process, oldest first."""
    from .report import COMPILE_REPORTS

    return list(COMPILE_REPORTS)


def precompile(model: Any, device: str = "bpu", options: dict | None = None) -> Any:
    """``model`` compiled for ``device`` so that the next process loads its trace instead of
    tracing again (:func:`fxpass.jit.precompile.precompile`)."""
    from .jit.precompile import precompile as _precompile

    return _precompile(model, device, options)
