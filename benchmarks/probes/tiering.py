"""What onnxruntime's weight prepacking buys a host region at run time, by rows per GEMM.

    python -m benchmarks.probes.tiering [--tokens 1,8,32,128] [--model qwen3]

Why: a host region that prepacks pays for it when its session opens (a copy of every GEMM
weight in the kernels' layout: 0.3 s for a Qwen3 4 x 1024 region), which is why a region is
tiered (``host.ort.TieredExecutor``: an in-place-weights session answers while the prepacked one
builds) instead of simply not prepacking. This benchmark is the evidence for keeping both tiers:
the same region, 4 x 1024, fp32, side by side (``harness.interleave``, medians):

- ``prepacked``: the second tier alone (``tiered=False``), weights written and prepacked, at
  every row count (one row too: ``host.PREPACK_MAX_ROWS`` 0, the default since 2026-12-02);
- ``in place``: the first tier's form (weights read in place, prepacking off), forced for
  every row count by ``host.PREPACK_MAX_ROWS``;
- ``eager``: the model in torch.

Writes ``benchmarks/probes/results/tiering.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

OUT = Path(__file__).resolve().parent / "results"


def one(model_name: str, tokens: int) -> dict[str, Any]:
    from benchmarks.harness import interleave
    from fxpass.backends.onnx.host import prepare as host
    from fxpass.tools import zoo

    model, kw = zoo.get(model_name, layers=4, hidden=1024, heads=16, kv_heads=8, vocab=32000,
                        tokens=tokens, dtype=torch.float32)
    fns: dict[str, Any] = {}
    row: dict[str, Any] = {"tokens": tokens}
    default_rows = host.PREPACK_MAX_ROWS
    with torch.no_grad():
        ref = model(**kw)[0]
        # prepacked: every Gemm prepacks, one row included (PREPACK_MAX_ROWS=0, the default),
        # so the 1-token row measures what prepack_one_row=False gives up
        for name, rows in (("prepacked", 0), ("in place", 10**9)):
            host.PREPACK_MAX_ROWS = rows
            try:
                m = copy.deepcopy(model)
                c = torch.compile(m, backend="fxpass_bpu", dynamic=False, options={
                    "executor": "onnxruntime", "cache_dir": tempfile.mkdtemp(), "tiered": False})
                t = time.perf_counter()
                out = c(**kw)[0]
                row[f"{name} first call s"] = time.perf_counter() - t
            finally:
                host.PREPACK_MAX_ROWS = default_rows
            err = (out - ref).abs().max().item()
            row[f"{name} max abs err"] = err
            assert err <= 1e-4 * max(1.0, ref.abs().max().item()), (name, err)  # float32
            fns[name] = lambda c=c: c(**kw)
        fns["eager"] = lambda: model(**kw)
        stats = interleave(fns, repeats=15, budget_s=30)
    for name, st in stats.items():
        row[f"{name} ms"] = st.median * 1e3
    row["in place / prepacked"] = row["in place ms"] / row["prepacked ms"]
    print(json.dumps(row), flush=True)
    return row


def markdown(rows: list[dict[str, Any]], model: str) -> str:
    lines = [f"{model} 4 x 1024 fp32, forward ms (median, interleaved)", "",
             "| tokens | prepacked ms | in place ms | eager ms | in place / prepacked |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['prepacked ms']:.2f} | {r['in place ms']:.2f} | "
                     f"{r['eager ms']:.2f} | {r['in place / prepacked']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8,32,128")
    ap.add_argument("--model", default="qwen3")
    a = ap.parse_args(argv)
    rows = [one(a.model, int(t)) for t in a.tokens.split(",")]
    OUT.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    (OUT / "tiering.json").write_text(json.dumps({"when": stamp, "model": a.model,
                                                  "rows": rows}, indent=1) + "\n")
    md = markdown(rows, a.model)
    (OUT / "tiering.md").write_text(f"Run {stamp}\n\n{md}")
    print(md)


if __name__ == "__main__":
    main()
