"""Graph-size scaling: our pass manager and partitioner next to torch.fx's own tools.

On synthetic transformer-shaped aten graphs (``benchmarks.synthetic``) of 1k/10k/100k nodes,
microseconds per node (median over repeats, a fresh copy of the graph for every measurement):

- ``pass_manager``: all built-in rules for the bpu target to fixpoint (``recompile=False``);
- ``fx_codegen``: ``gm.recompile()`` of the rewritten graph (torch.fx's Python codegen, paid
  once by any FX pass, ours included);
- ``partition``: our convex partitioner with the nash-p capability;
- peers: ``CapabilityBasedPartitioner.propose_partitions`` with an OperatorSupport that accepts
  exactly what our capability accepts, and ``subgraph_rewriter.replace_pattern`` with one
  pattern (it recompiles the module at the end, so compare it with pass_manager + fx_codegen).

Partitioners run on the graph the backend hands them (after the rules) and on the raw graph
(many small regions: the hard case for bitsets). A measurement whose smaller size took longer
than the cap, whose predicted time exceeds 5x the cap, or that runs past 2x the cap (interrupted)
is recorded as capped.

    python -m benchmarks.scaling [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from benchmarks import harness
from benchmarks.synthetic import build

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[1]
SIZES = (1_000, 10_000, 100_000)


def fresh(gm: GraphModule) -> GraphModule:
    """A new GraphModule with copied nodes (meta dicts copied, fake values shared)."""
    g = Graph()
    g.output(g.graph_copy(gm.graph, {}))
    return GraphModule(gm, g)


def _rules() -> list[Any]:
    from fxpass import select_rules

    return select_rules(target="bpu")


def _reject() -> Callable[[Node], str | None]:
    """A fresh per-graph Capability, as the backend uses it (verdicts cached per value)."""
    from fxpass.backends.bpu.capability import Capability, march

    return Capability(march("nash-p"))


def run_pass_manager(gm: GraphModule) -> tuple[float, dict[str, Any]]:
    from fxpass import PassManager

    rules = _rules()
    t0 = time.perf_counter()
    report = PassManager(rules, check=False, ledger=False).run(gm, recompile=False)
    return time.perf_counter() - t0, {"rewrites": report.total_rewrites}


def run_codegen(gm: GraphModule) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    gm.recompile()
    return time.perf_counter() - t0, {}


def run_partition(gm: GraphModule) -> tuple[float, dict[str, Any]]:
    from fxpass.partition.partition import partition

    reject = _reject()
    t0 = time.perf_counter()
    p = partition(gm, reject)
    return time.perf_counter() - t0, {"regions": len(p.regions)}


def run_fx_partitioner(gm: GraphModule) -> tuple[float, dict[str, Any]]:
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    reject = _reject()

    class Same(OperatorSupportBase):
        """Says yes to exactly the nodes our capability accepts."""

        def is_node_supported(self, submodules: Any, node: Node) -> bool:
            return node.op == "call_function" and reject(node) is None

    t0 = time.perf_counter()
    parts = CapabilityBasedPartitioner(
        gm, Same(), allows_single_node_partition=True
    ).propose_partitions()
    return time.perf_counter() - t0, {"regions": len(parts)}


def _pattern(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return aten.mm.default(x, aten.t.default(w))


def _replacement(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return aten.linear.default(x, w)


def run_replace_pattern(gm: GraphModule) -> tuple[float, dict[str, Any]]:
    from torch.fx.subgraph_rewriter import replace_pattern

    t0 = time.perf_counter()
    matches = replace_pattern(gm, _pattern, _replacement)
    return time.perf_counter() - t0, {"matches": len(matches)}


@dataclass(frozen=True)
class Measurement:
    name: str  # key in the JSON rows
    graph: str  # "raw" (as built) or "rewritten" (after the bpu rules, as the backend sees it)
    fn: Callable[[GraphModule], tuple[float, dict[str, Any]]]
    label: str  # for the table


MEASUREMENTS = (
    Measurement("pass_manager", "raw", run_pass_manager, "fxpass PassManager (all bpu rules)"),
    Measurement("fx_codegen", "rewritten", run_codegen, "torch.fx codegen gm.recompile()"),
    Measurement("partition", "rewritten", run_partition, "fxpass partition"),
    Measurement("partition", "raw", run_partition, "fxpass partition"),
    Measurement(
        "fx_capability_partitioner",
        "rewritten",
        run_fx_partitioner,
        "torch.fx CapabilityBasedPartitioner",
    ),
    Measurement(
        "fx_capability_partitioner",
        "raw",
        run_fx_partitioner,
        "torch.fx CapabilityBasedPartitioner",
    ),
    Measurement(
        "fx_replace_pattern",
        "raw",
        run_replace_pattern,
        "torch.fx replace_pattern (1 pattern, incl. recompile)",
    ),
)


def _predict(prev: list[dict[str, Any]], n: int) -> float | None:
    """Time at ``n`` nodes extrapolated from the smaller sizes, at least linearly."""
    done = [r for r in prev if r["status"] == "ok"]
    if not done:
        return None
    last = done[-1]
    slope = 1.0
    if len(done) >= 2:
        a, b = done[-2], done[-1]
        slope = max(
            1.0, _log_ratio(b["median_s"], a["median_s"]) / _log_ratio(b["nodes"], a["nodes"])
        )
    return last["median_s"] * (n / last["nodes"]) ** slope


def _log_ratio(a: float, b: float) -> float:
    return math.log(max(a, 1e-12) / max(b, 1e-12))


def measure(
    m: Measurement, graphs: dict[str, GraphModule], size: int, repeats: int, limit_s: float
) -> dict[str, Any]:
    """Median over ``repeats`` fresh copies; one repeat if a single run takes over 10 s.
    Raises ``harness.TimeLimit`` if one run takes longer than ``limit_s``."""
    times, info = [], {}
    for _ in range(repeats):
        gm = fresh(graphs[m.graph])
        gc.collect()  # garbage from the previous measurement is not this one's cost
        with harness.time_limit(limit_s):
            t, info = m.fn(gm)
        times.append(t)
        if t > 10:
            break
    nodes = len(graphs[m.graph].graph.nodes)
    med = statistics.median(times)
    return {
        "measurement": m.name,
        "graph": m.graph,
        "size": size,
        "nodes": nodes,
        "status": "ok",
        "repeats": len(times),
        "median_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "us_per_node": med / nodes * 1e6,
        "info": info,
    }


def _status(m: Measurement, size: int, status: str) -> dict[str, Any]:
    return {"measurement": m.name, "graph": m.graph, "size": size, "status": status}


def run(
    quick: bool = False,
    sizes: tuple[int, ...] = SIZES,
    cap_s: float | None = None,
    partial: Path | None = None,
) -> dict[str, Any]:
    """All measurements at all sizes; returns the JSON-able record (also written to
    ``partial`` after every size)."""
    repeats = 1 if quick else 3
    cap_s = cap_s if cap_s is not None else (10.0 if quick else 60.0)
    rows: list[dict[str, Any]] = []
    busy = harness.wait_for_quiet(max_wait_s=10 if quick else 120)
    record = {
        "env": harness.environment(),
        "mode": "quick" if quick else "full",
        "repeats": repeats,
        "cap_s": cap_s,
        "background_busy_before": busy,
        "sizes": list(sizes),
    }
    for size in sizes:
        t0 = time.perf_counter()
        raw = build(size)
        rewritten = fresh(raw)
        run_pass_manager(rewritten)
        graphs = {"raw": raw, "rewritten": rewritten}
        print(f"[scaling] built {size} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        for m in MEASUREMENTS:
            prev = [r for r in rows if (r["measurement"], r["graph"]) == (m.name, m.graph)]
            slow = [r for r in prev if r["status"] == "ok" and r["median_s"] > cap_s]
            pred = _predict(prev, len(graphs[m.graph].graph.nodes))
            failed = [r for r in prev if r["status"] != "ok"]
            if failed or slow or (pred and pred > 5 * cap_s):
                why = (
                    f"capped ({failed[-1]['size'] // 1000}k was not measured)"
                    if failed
                    else f"capped ({slow[-1]['size'] // 1000}k took > {cap_s:.0f} s)"
                    if slow
                    else f"capped (predicted ~{pred:.0f} s)"
                )
                rows.append(_status(m, size, why))
                continue
            try:
                with harness.OtherLoad() as load:
                    row = measure(m, graphs, size, repeats, limit_s=2 * cap_s)
                rows.append({**row, "other_load": load.share})
            except harness.TimeLimit as e:
                rows.append(_status(m, size, f"capped ({e})"))
            except Exception as e:  # noqa: BLE001 - a failing peer is a result
                rows.append(_status(m, size, f"error: {type(e).__name__}: {str(e)[:200]}"))
        print(f"[scaling] {size} done in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        if partial:
            harness.write_json(partial, {**record, "rows": rows})
    return {**record, "rows": rows}


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    extra = ", ".join(f"{k} {v}" for k, v in r["info"].items())
    return f"{r['us_per_node']:.1f} ({r['median_s']:.2f} s{', ' + extra if extra else ''})"


def to_markdown(data: dict[str, Any]) -> str:
    """One row per measurement: us per node (total seconds, info) at each size."""
    sizes = data["sizes"]
    cols = ["measurement", "graph", *[f"{s // 1000}k nodes: us/node" for s in sizes], "growth"]
    rows = []
    for m in MEASUREMENTS:
        mine = {
            r["size"]: r
            for r in data["rows"]
            if (r["measurement"], r["graph"]) == (m.name, m.graph)
        }
        row = {"measurement": m.label, "graph": m.graph}
        for s in sizes:
            row[f"{s // 1000}k nodes: us/node"] = _cell(mine.get(s))
        ok = [mine[s] for s in sizes if s in mine and mine[s]["status"] == "ok"]
        if len(ok) >= 2:
            g = ok[-1]["us_per_node"] / ok[0]["us_per_node"]
            row["growth"] = f"{g:.2f}x ({ok[0]['size'] // 1000}k->{ok[-1]['size'] // 1000}k)"
        rows.append(row)
    loads = [r["other_load"] for r in data["rows"] if r.get("other_load") is not None]
    note = (
        "us/node = median seconds / nodes in the graph measured (cell: us/node (median total "
        "seconds, info)); growth = us/node at the largest measured size over the smallest "
        f"(1.0x is linear). Repeats: {data['repeats']}; cap {data['cap_s']:.0f} s."
        + (
            f" Other processes used {min(loads):.0%}-{max(loads):.0%} of the CPUs during the"
            " measurements."
            if loads
            else ""
        )
    )
    return harness.markdown_table(rows, cols) + "\n\n" + note


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repeat, 10 s cap")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    data = run(args.quick, tuple(int(s) for s in args.sizes.split(",")), None, out / "scaling.json")
    harness.write_results(out, "scaling", data, to_markdown(data))


if __name__ == "__main__":
    main()
