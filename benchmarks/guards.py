"""What Dynamo's guards cost a decode step of ``generate()`` through fxpass_bpu.

    python -m benchmarks.guards [--model qwen3-4x512] [--modes default,tags,...]

Why this exists: after the decode region reached its memory floor, the largest single host cost
left in a step is Dynamo checking the decode graph's guards before it may run it (the guard tree
of HF's ``forward`` with a static cache holds ~600 guard managers: module attributes, cache
layers, every parameter's tensor guard). This measures that cost directly, per guard policy, so
a change to the policy can be judged by a number instead of by a noisy ``generate()`` timing.

Each mode runs in its own process (Dynamo's config and caches are global):
``default`` (what every user gets), ``tags`` (``use_recursive_dict_tags_for_guards``, a safe
Dynamo option that is off by default) and torch's three guard filters, all documented *unsafe*
(``skip_guard_on_inbuilt_nn_modules_unsafe``, ``skip_guard_on_all_nn_modules_unsafe``,
``keep_tensor_guards_unsafe``). fxpass sets none of them; they are measured to size the lever.

Per mode: the model generates 4 tokens with a static cache (compiling prefill and decode), the
last decode call's locals are captured, and the decode graph's ``guard_manager.check`` is timed
on them: warm (200 back-to-back calls) and cold (30 calls, each after streaming 256 MB, as a
step's region does to the caches). Medians in microseconds. Reads Dynamo's private
``_debug_get_cache_entry_list``; a torch upgrade may move it.

Writes ``benchmarks/results/guards.{json,md}`` (the runs quoted in ``docs/benchmarks.md`` are
kept as ``guards-run1`` and ``guards-run2``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.generate import _build

MODES = (
    "default",
    "tags",
    "skip_guard_on_inbuilt_nn_modules_unsafe",
    "skip_guard_on_all_nn_modules_unsafe",
    "keep_tensor_guards_unsafe",
)
RESULTS = Path(__file__).parent / "results"


def measure(name: str, mode: str) -> dict[str, Any]:
    """Compile ``name`` under ``mode``, generate, and time the decode graph's guard check."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model, ids = _build(name)
    model.generation_config.cache_implementation = "static"
    model.generation_config.max_cache_len = ids.shape[1] + 8
    options: dict[str, Any] = {"cache": False}
    if mode == "tags":
        torch._dynamo.config.use_recursive_dict_tags_for_guards = True
    elif mode != "default":
        options["guard_filter_fn"] = getattr(torch.compiler, mode)
    compiled = torch.compile(model.forward, backend="fxpass_bpu", dynamic=False, options=options)
    calls: list[dict[str, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return compiled(*args, **kwargs)

    model.forward = recording
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    # The compiled frame is HF's ``wrapper`` around ``forward``; rebuild its locals.
    fn = compiled._torchdynamo_orig_callable.__func__
    code = fn.__code__
    func = fn.__closure__[code.co_freevars.index("func")].cell_contents
    frame_locals = {"self": model, "args": (), "kwargs": calls[-1], "func": func}
    entries = _debug_get_cache_entry_list(code)
    torch.set_grad_enabled(False)
    passing = [e for e in entries if e.guard_manager.check(frame_locals)]
    if len(passing) != 1:
        raise RuntimeError(f"{len(passing)} graphs accept the decode step's locals; expected 1")
    guard = passing[0].guard_manager
    big = torch.empty(64 * 1024 * 1024)  # 256 MB: more than any cache level here
    warm, cold = [], []
    for _ in range(200):
        t = time.perf_counter()
        guard.check(frame_locals)
        warm.append(time.perf_counter() - t)
    for _ in range(30):
        big.add_(1.0)
        t = time.perf_counter()
        guard.check(frame_locals)
        cold.append(time.perf_counter() - t)
    return {
        "mode": mode,
        "graphs": len(entries),
        "warm_us": statistics.median(warm) * 1e6,
        "cold_us": statistics.median(cold) * 1e6,
    }


def to_markdown(rows: list[dict[str, Any]], name: str) -> str:
    lines = [
        f"Decode-graph guard check, {name}, static cache (medians, microseconds)",
        "",
        "| guard policy | warm | cold (after 256 MB streamed) |",
        "|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['warm_us']:.1f} | {r['cold_us']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-4x512")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.model, args.child)))
        return
    rows = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.guards", "--model", args.model, "--child", mode],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "guards.json").write_text(json.dumps(rows, indent=2))
    md = to_markdown(rows, args.model)
    (RESULTS / "guards.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
