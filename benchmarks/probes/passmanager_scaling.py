"""Pass-manager scaling: built-in rules to fixpoint on synthetic graphs of 1k/10k/100k nodes.

Prints microseconds per node (median of repeats, fresh graph each time) and the rewrite
count, so linearity can be read off the table. Bar: <= 5 us per node at 100k nodes.

    python -m benchmarks.probes.passmanager_scaling [--sizes 1000,10000,100000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.synthetic import build
from fxpass import PassManager, select_rules


def measure(n: int, repeats: int, rule_names: list[str] | None = None) -> dict:
    rules = select_rules(target="bpu")
    if rule_names:
        rules = [r for r in rules if r.name in rule_names]
    times, codegen, fixpoint, rewrites, nodes = [], [], [], 0, 0
    for _ in range(repeats):
        gm = build(n)
        nodes = len(gm.graph.nodes)
        t0 = time.perf_counter()
        report = PassManager(rules, check=False, ledger=False).run(gm, recompile=False)
        t1 = time.perf_counter()
        gm.recompile()  # torch.fx's Python codegen, which every FX pass pays once
        codegen.append(time.perf_counter() - t1)
        t2 = time.perf_counter()  # a second run on the fixpoint: matching only, nothing fires
        PassManager(rules, check=False, ledger=False).run(gm, recompile=False)
        fixpoint.append(time.perf_counter() - t2)
        times.append(t1 - t0)
        rewrites = report.total_rewrites
    med = statistics.median(times)
    return {
        "nodes": nodes,
        "median_s": med,
        "us_per_node": med / nodes * 1e6,
        "min_s": min(times),
        "max_s": max(times),
        "rewrites": rewrites,
        "codegen_us_per_node": statistics.median(codegen) / nodes * 1e6,
        "fixpoint_rerun_us_per_node": statistics.median(fixpoint) / nodes * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    rows = [measure(int(s), args.repeats) for s in args.sizes.split(",")]
    print(
        f"{'nodes':>8} {'median ms':>10} {'us/node':>8} {'rewrites':>9} "
        f"{'fx codegen us/node':>19} {'rerun at fixpoint us/node':>26}"
    )
    for r in rows:
        print(
            f"{r['nodes']:>8} {r['median_s'] * 1e3:>10.1f} {r['us_per_node']:>8.2f} "
            f"{r['rewrites']:>9} {r['codegen_us_per_node']:>19.2f} "
            f"{r['fixpoint_rerun_us_per_node']:>26.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
