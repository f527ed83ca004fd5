"""What a PassManager run did: rewrites and time per rule, rounds, skips, and a ledger."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

#: Per-graph reports appended by backends when they compile (read via fxpass.compile_reports()).
#: Kept in the core so the core never imports a backend.
COMPILE_REPORTS: list[Any] = []


@dataclass
class LedgerEntry:
    rule: str
    anchor: str
    erased: list[str]
    created: list[str]


@dataclass
class Report:
    rewrites: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    rounds: int = 0
    nodes_before: int = 0
    nodes_after: int = 0
    total_seconds: float = 0.0
    stopped_at_limit: bool = False  # rewrite_limit reached (bisection), not a fixpoint
    ledger: list[LedgerEntry] = field(default_factory=list)
    skips: list[tuple[str, str, str]] = field(default_factory=list)  # (rule, node, reason)

    @property
    def total_rewrites(self) -> int:
        return sum(self.rewrites.values())

    def skip_reasons(self, rule: str | None = None) -> dict[str, int]:
        """Distinct reasons rules gave for not firing, with counts."""
        out: dict[str, int] = {}
        for r, _, why in self.skips:
            if rule is None or r == rule:
                key = f"{r}: {why}"
                out[key] = out.get(key, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_rewrites"] = self.total_rewrites
        return d

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        lines = [
            f"fxpass: {self.total_rewrites} rewrites in {self.rounds} round(s), "
            f"{self.nodes_before} -> {self.nodes_after} nodes, {self.total_seconds * 1e3:.1f} ms"
        ]
        if self.stopped_at_limit and self.ledger:
            last = self.ledger[-1]
            lines.append(
                f"  stopped at the rewrite limit; last rewrite: {last.rule} at {last.anchor}"
            )
        elif self.stopped_at_limit:
            lines.append("  stopped at the rewrite limit before the first rewrite (partial)")
        for name in sorted(self.rewrites, key=lambda k: -self.rewrites[k]):
            lines.append(
                f"  {name:<28} {self.rewrites[name]:>6} rewrites "
                f"{self.seconds.get(name, 0.0) * 1e3:>9.2f} ms"
            )
        for why, count in sorted(self.skip_reasons().items()):
            lines.append(f"  skipped x{count}: {why}")
        return "\n".join(lines)
