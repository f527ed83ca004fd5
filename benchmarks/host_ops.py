"""The CPU part of a decode step: torch's direct bindings against the boxed aten call.

    python -m benchmarks.host_ops [--model qwen3-4x512] [--rounds 400]

What is timed: the spliced decode graph of ``generate()`` (static cache, fxpass_bpu) with its
device region replaced by a replay of the region's real outputs, so only the nodes left on the
CPU run (embedding, position arithmetic, rotary ``cos``/``sin``, the KV-cache writes). Two
copies of that graph: as compiled (``backends/bpu/fastcall.py`` switched the CPU nodes it
proved equal to direct bindings) and with every switched node pointed back at its aten
overload (the boxed call, as before). They run back to back, order alternating, and the
per-call difference is reported as a median (``paired``), twice: on warm caches, and right
after a weights-sized stream through the caches (a real decode step reads every weight
between two of these calls, so the host code starts cold). The position counters the graph
advances are reset before every call, outside the timing.

Writes ``benchmarks/results/host_ops.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.fx import GraphModule

from benchmarks import harness
from benchmarks.generate import MODELS, PROMPT, _build, _compile_static

ROOT = Path(__file__).resolve().parents[1]


class _Replay(torch.nn.Module):
    def __init__(self, outs: tuple) -> None:
        super().__init__()
        self.outs = outs

    def forward(self, *a: Any) -> tuple:
        return self.outs


def _decode_graph(name: str) -> tuple[GraphModule, tuple]:
    """The spliced decode graph of a real ``generate()``, one step's inputs, and its region
    replaced by a replay of that step's outputs."""
    import fxpass.backends.bpu.backend as backend
    from fxpass.backends.bpu import settle

    graphs: list[GraphModule] = []
    real_finish = backend._finish

    def keep(out: GraphModule, *a: Any, **k: Any) -> GraphModule:
        graphs.append(out)
        return real_finish(out, *a, **k)

    model, ids = _build(name)
    _compile_static(model, "fxpass_bpu", PROMPT + 16)
    backend._finish = keep
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    finally:
        backend._finish = real_finish
    settle()
    gm = graphs[-1]
    box: dict[str, Any] = {}
    real = gm.forward

    def capture(*a: Any) -> Any:
        box["args"] = a
        return real(*a)

    # one step's inputs, and that step's region outputs
    region = gm.bpu_region_0
    calls: list[tuple] = []
    region_forward = region.forward

    def record(*a: Any) -> tuple:
        outs = region_forward(*a)
        calls.append(tuple(o.clone() for o in outs))
        return outs

    region.forward = record
    gm.forward = capture
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    finally:
        gm.forward = real
        del region.forward
    gm.bpu_region_0 = _Replay(calls[-1])
    # the inputs are the last step's; the counters it advanced are put back by the caller
    return gm, box["args"]


def _boxed(gm: GraphModule) -> tuple[GraphModule, int]:
    from fxpass.backends.bpu.fastcall import ATEN

    out = GraphModule(gm, copy.deepcopy(gm.graph))
    n = 0
    for node in out.graph.nodes:
        if ATEN in node.meta:
            node.target = node.meta[ATEN]
            n += 1
    out.recompile()
    return out, n


def measure(name: str, rounds: int) -> dict[str, Any]:
    fast, args = _decode_graph(name)
    boxed, switched = _boxed(fast)
    cpu_nodes = sum(1 for n in fast.graph.nodes if n.op == "call_function"
                    and n.target.__name__ != "getitem")
    counters = [(t, t.clone()) for t in args if isinstance(t, torch.Tensor)
                and not t.is_floating_point() and t.numel() < 16]
    stream = np.ones(sum(p.numel() for p in _build(name)[0].parameters()) // 2)
    result: dict[str, Any] = {"model": name, "cpu_nodes": cpu_nodes, "switched": switched}
    with torch.no_grad():
        for kind in ("warm", "after_stream"):
            t: dict[str, list[float]] = {"boxed": [], "direct": []}
            for r in range(rounds):
                order = (("boxed", boxed), ("direct", fast))
                for k, m in order if r % 2 else order[::-1]:
                    for c, v in counters:
                        c.copy_(v)
                    if kind == "after_stream":
                        stream.sum()
                    t0 = time.perf_counter()
                    m(*args)
                    t[k].append((time.perf_counter() - t0) * 1e3)
            result[kind] = {
                "boxed_ms": statistics.median(t["boxed"]),
                "direct_ms": statistics.median(t["direct"]),
                "paired_saving_ms": statistics.median(
                    b - d for b, d in zip(t["boxed"], t["direct"], strict=True)
                ),
            }
    return result


def to_markdown(r: dict[str, Any]) -> str:
    rows = [{"caches": k, **{c: round(v, 4) for c, v in r[k].items()}}
            for k in ("warm", "after_stream")]
    return (
        f"# Host ops of one decode step ({r['model']})\n\n"
        f"{r['cpu_nodes']} CPU nodes in the spliced decode graph, {r['switched']} switched to "
        "direct bindings (`backends/bpu/fastcall.py`); region replayed. Medians, ms per "
        "step.\n\n"
        + harness.markdown_table(rows, ["caches", "boxed_ms", "direct_ms", "paired_saving_ms"])
        + "\n"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-4x512", choices=list(MODELS))
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    print(f"[host_ops] {args.model} ...", file=sys.stderr, flush=True)
    result = {"env": harness.environment(), **measure(args.model, args.rounds)}
    harness.write_results(args.out, "host_ops", result, to_markdown(result))
    print(to_markdown(result))


if __name__ == "__main__":
    main()
