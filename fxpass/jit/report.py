"""Per-graph compile reports, readable after compiling via ``fxpass.compile_reports()``."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from fxpass.report import COMPILE_REPORTS as REPORTS  # shared with fxpass.compile_reports()

__all__ = ["REPORTS", "GraphReport", "RegionReport"]

#: what a region still on its first tier says (``RegionReport.first_tier``)
FIRST_TIER = " [first tier: its prepacked session is still being built in the background]"

#: How many distinct rule skip reasons ``str(report)`` shows (all are in ``report.rules``).
SHOW_SKIPS = 10


@dataclass
class RegionReport:
    name: str
    nodes: int
    macs: int
    inputs: int
    outputs: int
    executor: str
    cached: bool
    fallback: str | None = None
    fusions: dict[str, int] = field(default_factory=dict)  # host fusions that fired
    quant: Any = None  # calibration.QuantInfo when the region is quantized (issue 11)
    #: where its artifact came from: "local hit", "remote hit", "compiled", or
    #: "compiled (remote refused: <why>)" (``ArtifactCache.record``); "" without a cache
    source: str = ""
    #: the region's executor, held weakly (read live by ``first_tier``): reports outlive
    #: evicted shape variants, and a strong reference kept their sessions alive (RSS grew
    #: 2.5 -> 4.5 GB over 200 lengths in ``benchmarks.shapes``)
    executor_ref: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.executor_ref is not None and not isinstance(self.executor_ref, weakref.ref):
            try:
                self.executor_ref = weakref.ref(self.executor_ref)
            except TypeError:  # an executor that takes no weak reference: no tier to report
                self.executor_ref = None

    @property
    def first_tier(self) -> bool | None:
        """True while the region still runs on a first-tier session (a tiered host region
        whose faster session is being built in the background); None for an executor that
        has no tiers, or is gone."""
        ex = self.executor_ref() if self.executor_ref is not None else None
        return getattr(ex, "first_tier", None)


@dataclass
class GraphReport:
    graph: int
    march: str
    executor: str
    call_nodes: int = 0
    offloaded_call_nodes: int = 0
    macs: int = 0
    offloaded_macs: int = 0
    regions: list[RegionReport] = field(default_factory=list)
    cpu_reasons: dict[str, int] = field(default_factory=dict)  # reason -> node count
    dropped: list[str] = field(default_factory=list)
    rewrites: dict[str, int] = field(default_factory=dict)
    compile_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    rules: Any = None  # the fxpass Report of the rewrite phase (ledger, skips, times)
    device: str = ""  # the device's name (the report's first word is its backend's)
    #: the CPU side's per-call streamlining (``jit.streamline``): fused_writes, memoized_ops
    streamlined: dict[str, int] = field(default_factory=dict)

    @property
    def node_share(self) -> float:
        return self.offloaded_call_nodes / self.call_nodes if self.call_nodes else 0.0

    @property
    def mac_share(self) -> float:
        return self.offloaded_macs / self.macs if self.macs else 0.0

    def summary(self) -> str:
        return (
            f"fxpass_{self.device} graph {self.graph}: {len(self.regions)} region(s), "
            f"{self.offloaded_call_nodes}/{self.call_nodes} call nodes "
            f"({self.node_share:.0%}), {self.offloaded_macs / 1e6:.1f}/{self.macs / 1e6:.1f} "
            f"MMACs ({self.mac_share:.0%}) offloaded to {self.executor} [{self.march}], "
            f"compiled in {self.compile_seconds:.2f}s"
        )

    def __str__(self) -> str:
        lines = [self.summary()]
        for r in self.regions:
            lines.append(
                f"  {r.name}: {r.nodes} nodes, {r.macs / 1e6:.2f} MMACs, {r.inputs} in /"
                f" {r.outputs} out, {r.executor}"
                f"{f' ({r.source})' if r.source else ' (cached)' if r.cached else ''}"
                f"{' FALLBACK: ' + r.fallback if r.fallback else ''}"
                f"{FIRST_TIER if r.first_tier else ''}"
            )
            if r.fusions:
                fused = ", ".join(f"{k} x{v}" for k, v in sorted(r.fusions.items()))
                lines.append(f"    host fusions: {fused}")
            if r.quant is not None:
                lines.append(f"    {r.quant.line()}")
        if self.rewrites:
            top = sorted(self.rewrites.items(), key=lambda kv: -kv[1])
            lines.append("  rewrites: " + ", ".join(f"{k} x{v}" for k, v in top))
        skips = self.rules.skip_reasons() if self.rules is not None else {}
        for why, k in sorted(skips.items(), key=lambda kv: -kv[1])[:SHOW_SKIPS]:
            lines.append(f"  rule skipped x{k}: {why}")
        if len(skips) > SHOW_SKIPS:
            lines.append(f"  ... {len(skips) - SHOW_SKIPS} more skip reasons in report.rules")
        for why, k in sorted(self.cpu_reasons.items(), key=lambda kv: -kv[1]):
            lines.append(f"  on CPU x{k}: {why}")
        if self.streamlined:
            done = ", ".join(f"{k.replace('_', ' ')} x{v}" for k, v in self.streamlined.items())
            lines.append(f"  CPU side streamlined: {done}")
        for d in self.dropped:
            lines.append(f"  dropped: {d}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)
