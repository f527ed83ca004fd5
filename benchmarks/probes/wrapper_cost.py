"""What ``compile_for_generate``'s forward wrapper costs a decode step, on cold caches.

    python -m benchmarks.probes.wrapper_cost [--model qwen3-4x512] [--rounds 3]

Why this exists: the wrapper around the compiled forward (HF's sliding-window counters traced
symbolic, torch's thread count per step) is fxpass's own per-step code, but the step
breakdown of ``benchmarks.generate`` counts it inside the forward call with Dynamo's and
AOTAutograd's time. This isolates it: the same model compiled three ways, each in turn after
``torch._dynamo.reset()``,

- ``plain``: ``torch.compile(model.forward, backend="fxpass_bpu", dynamic=False)``, no wrapper;
- ``compile_for_generate``: the documented path, as shipped;
- ``config every call``: the same with torch's ``dynamic_sources`` written around every call,
  whatever the cache (``_counts_in_python`` forced true): the wrapper before 2026-12-03 11:10.

and for each, the time per token spent inside the model's forward call with the graph's
outputs replayed (``benchmarks.generate._outside_replayed``), warm and after a weights-sized
stream through the caches where the graph ran. Medians over ``--rounds`` rounds; the wrapper's
cost is each path's figure minus ``plain``'s. Writes ``benchmarks/results/<stem>.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks import harness
from benchmarks.generate import PROMPT, _build, _compile_static, _hf_generate, _outside_replayed

RESULTS = Path(__file__).parent / "results"
PATHS = ("plain", "compile_for_generate", "config every call")


def _one(name: str, path: str, new_tokens: int) -> tuple[float, float]:
    from fxpass.backends.bpu import compile_for_generate

    torch._dynamo.reset()
    model, ids = _build(name)
    max_len = PROMPT + new_tokens + 2
    if path == "plain":
        _compile_static(model, "fxpass_bpu", max_len)
    else:
        compile_for_generate(model, max_cache_len=max_len)
    run = _hf_generate(model, ids)
    run(new_tokens + 1)
    _, _, warm, flushed = _outside_replayed(run, model, new_tokens, 5)
    return warm, flushed


def measure(name: str, new_tokens: int, rounds: int) -> dict[str, Any]:
    import fxpass.hf.generation as gen

    got: dict[str, list[tuple[float, float]]] = {p: [] for p in PATHS}
    for _ in range(rounds):
        for path in PATHS:
            old_path = path == "config every call"
            with (mock.patch.object(gen, "_counts_in_python", lambda cache: True) if old_path
                  else contextlib.nullcontext()):
                got[path].append(_one(name, path, new_tokens))
    med = {p: {"in_forward_warm_ms": statistics.median(w for w, _ in v),
               "in_forward_flushed_ms": statistics.median(f for _, f in v)}
           for p, v in got.items()}
    return {"model": name, "new_tokens": new_tokens, "rounds": rounds, "median": med,
            "samples": {p: [list(x) for x in v] for p, v in got.items()}}


def to_markdown(r: dict[str, Any]) -> str:
    med = r["median"]
    base = med["plain"]
    w, f = "in_forward_warm_ms", "in_forward_flushed_ms"
    rows = [{"path": p, "in forward ms/token warm": f"{m[w]:.3f}", "flushed": f"{m[f]:.3f}",
             "wrapper warm": f"{m[w] - base[w]:+.3f}", "wrapper flushed": f"{m[f] - base[f]:+.3f}"}
            for p, m in med.items()]
    title = (f"{r['model']}, {r['new_tokens']} new tokens, graph outputs replayed, medians of "
             f"{r['rounds']} rounds (each path compiled in turn)")
    return title + "\n\n" + harness.markdown_table(
        rows, ["path", "in forward ms/token warm", "flushed", "wrapper warm", "wrapper flushed"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-4x512")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stem", default="wrapper_cost")
    args = ap.parse_args(argv)
    r = measure(args.model, args.new_tokens, args.rounds)
    harness.publish(RESULTS, args.stem, r, to_markdown)


if __name__ == "__main__":
    main()
