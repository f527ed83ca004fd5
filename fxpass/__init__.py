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
    "propagate_meta",
    "rule",
    "select_rules",
]


def compile_reports() -> list[Any]:
    """Per-graph reports of every graph a fxpass backend compiled in this process, oldest first."""
    from .report import COMPILE_REPORTS

    return list(COMPILE_REPORTS)
