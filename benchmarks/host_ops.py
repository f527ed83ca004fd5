"""The CPU part of a decode step: direct bindings and merged write-backs against before.

    python -m benchmarks.host_ops [--model qwen3-4x512] [--rounds 400]

What is timed: the spliced decode graph of ``generate()`` (static cache, fxpass_bpu) with its
device region replaced by a replay of the region's real outputs, so only the nodes left on the
CPU run (embedding, position arithmetic, rotary ``cos``/``sin``, the KV-cache writes). Three
variants: as compiled (``direct``: ``fastcall.inplace_writes`` merged the write-backs,
``fastcall.fast_calls`` switched the CPU nodes it proved equal to direct bindings); the same
graph with every switched node pointed back at its aten overload (``boxed``); and a graph
compiled without ``inplace_writes`` (``direct_without_inplace``, its own model instance with
the same weights). They run back to back, order rotating, and each difference to ``direct``
is reported as a median of paired calls, twice: on warm caches, and right after a
weights-sized stream through the caches (a real decode step reads every weight between two
of these calls, so the host code starts cold). The position counters the graphs advance are
reset before every call, outside the timing.

Writes ``benchmarks/results/host_ops.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from operator import getitem
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.fx import GraphModule

from benchmarks import harness
from benchmarks.generate import MODELS, PROMPT, _build

ROOT = Path(__file__).resolve().parents[1]


class _Replay(torch.nn.Module):
    def __init__(self, outs: tuple) -> None:
        super().__init__()
        self.outs = outs

    def forward(self, *a: Any) -> tuple:
        return self.outs


def _decode_graph(name: str, inplace: bool = True) -> tuple[GraphModule, tuple]:
    """The spliced decode graph of a real ``generate()``, one step's inputs, and its region
    replaced by a replay of that step's outputs (``inplace=False``: compiled without
    ``fastcall.inplace_writes``; the artifact cache is off so the two never share a plan)."""
    import fxpass.backends.bpu.backend as backend
    from fxpass.backends.bpu import settle

    graphs: list[GraphModule] = []
    real_finish = backend._finish

    def keep(out: GraphModule, *a: Any, **k: Any) -> GraphModule:
        graphs.append(out)
        return real_finish(out, *a, **k)

    model, ids = _build(name)
    model.generation_config.cache_implementation = "static"
    model.generation_config.max_cache_len = PROMPT + 16
    model.forward = torch.compile(
        model.forward, backend="fxpass_bpu", dynamic=False, options={"cache": False}
    )
    real_inplace = backend.inplace_writes
    backend._finish = keep
    if not inplace:
        backend.inplace_writes = lambda gm: 0
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    finally:
        backend._finish, backend.inplace_writes = real_finish, real_inplace
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


def _cpu_nodes(gm: GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is not getitem)


def measure(name: str, rounds: int) -> dict[str, Any]:
    fast, args = _decode_graph(name)
    boxed, switched = _boxed(fast)
    two, args2 = _decode_graph(name, inplace=False)
    variants = {"boxed": (boxed, args), "direct": (fast, args),
                "direct_without_inplace": (two, args2)}
    counters = [(t, t.clone()) for a in (args, args2) for t in a
                if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.numel() < 16]
    stream = np.ones(sum(p.numel() for p in _build(name)[0].parameters()) // 2)
    result: dict[str, Any] = {
        "model": name, "cpu_nodes": _cpu_nodes(fast), "switched": switched,
        "cpu_nodes_without_inplace": _cpu_nodes(two),
    }
    with torch.no_grad():
        for kind in ("warm", "after_stream"):
            t: dict[str, list[float]] = {k: [] for k in variants}
            for r in range(rounds):
                order = list(variants.items())
                for k, (m, a) in order[r % 3:] + order[:r % 3]:
                    for c, v in counters:
                        c.copy_(v)
                    if kind == "after_stream":
                        stream.sum()
                    t0 = time.perf_counter()
                    m(*a)
                    t[k].append((time.perf_counter() - t0) * 1e3)
            result[kind] = {f"{k}_ms": statistics.median(v) for k, v in t.items()}
            for k in ("boxed", "direct_without_inplace"):
                result[kind][f"saving_vs_{k}_ms"] = statistics.median(
                    b - d for b, d in zip(t[k], t["direct"], strict=True)
                )
    return result


def to_markdown(r: dict[str, Any]) -> str:
    rows = [{"caches": k, **{c: round(v, 4) for c, v in r[k].items()}}
            for k in ("warm", "after_stream")]
    cols = ["caches", *r["warm"]]
    return (
        f"# Host ops of one decode step ({r['model']})\n\n"
        f"{r['cpu_nodes']} CPU nodes in the spliced decode graph ({r['cpu_nodes_without_inplace']}"
        f" without `inplace_writes`), {r['switched']} switched to direct bindings "
        "(`backends/bpu/fastcall.py`); region replayed. `boxed`: the same graph with every "
        "switched node back on its aten overload; `direct_without_inplace`: compiled without "
        "`inplace_writes`. Medians, ms per step; savings are medians of paired differences "
        "against `direct` (the default).\n\n"
        + harness.markdown_table(rows, cols)
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
