"""What Dynamo's guards cost a decode step of ``generate()`` through fxpass_bpu.

    python -m benchmarks.probes.guards [--model qwen3-4x512] [--modes default,tags,...]

Why this exists: after the decode region reached its memory floor, the largest single host cost
left in a step is Dynamo checking the decode graph's guards before it may run it (module
attributes, cache layers, every parameter's tensor guard; the tree's size is reported). This
measures that cost directly, per guard policy, so a change to the policy can be judged by a
number instead of by a noisy ``generate()`` timing.

Each mode runs in its own process (Dynamo's config and caches are global): ``default`` (what
every user gets), ``tags`` (``use_recursive_dict_tags_for_guards``, a Dynamo option that is off
by default and not documented unsafe) and torch's three guard filters, all documented *unsafe*
(``skip_guard_on_inbuilt_nn_modules_unsafe``, ``skip_guard_on_all_nn_modules_unsafe``,
``keep_tensor_guards_unsafe``). fxpass sets none of them; they are measured to size the lever.

Per mode: the model generates 4 tokens with a static cache (compiling prefill and decode), the
last decode call's locals are captured, and the decode graph's ``guard_manager.check`` is timed
on them: warm (200 back-to-back calls) and cold (30 calls, each after streaming 256 MB, as a
step's region does to the caches), medians in microseconds. Then, in the same process, the
Dynamo/AOT/HF time per token of whole ``generate()`` calls with the regions replayed
(``benchmarks.generate._outside_replayed``, warm and after a weights-sized stream). Reads
Dynamo's private ``_debug_get_cache_entry_list``; a torch upgrade may move it.

Writes ``benchmarks/results/<stem>.{json,md}`` (``--stem``, default ``guards``).
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

from benchmarks import harness
from benchmarks.generate import _build, _compile_static, _hf_generate, _outside_replayed

MODES = (
    "default",
    "tags",
    "skip_guard_on_inbuilt_nn_modules_unsafe",
    "skip_guard_on_all_nn_modules_unsafe",
    "keep_tensor_guards_unsafe",
)
RESULTS = Path(__file__).parent / "results"


def _tree_size(guard: Any) -> tuple[int, int]:
    """(guard managers, lines) of the tree Dynamo prints for ``guard`` (``TORCH_LOGS=guards``):
    the size of what one check walks. Its printer visits dict key/value managers too, which
    ``get_child_managers`` alone misses."""
    lines = str(guard).splitlines()
    return sum("GuardManager" in ln for ln in lines), len(lines)


def measure(name: str, mode: str, new_tokens: int, rounds: int) -> dict[str, Any]:
    """Compile ``name`` under ``mode``, generate, and time the decode graph's guard check;
    then the Dynamo/AOT/HF time per token of whole ``generate()`` calls under the same mode
    (``benchmarks.generate._outside_replayed``, warm and after a weights-sized stream)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model, ids = _build(name)
    options: dict[str, Any] = {"cache": False}
    if mode == "tags":
        torch._dynamo.config.use_recursive_dict_tags_for_guards = True
    elif mode != "default":
        options["guard_filter_fn"] = getattr(torch.compiler, mode)
    _compile_static(model, "fxpass_bpu", ids.shape[1] + new_tokens + 2, options)
    compiled = model.forward
    calls: list[dict[str, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return compiled(*args, **kwargs)

    model.forward = recording
    run = _hf_generate(model, ids)
    run(4)
    model.forward = compiled
    # The compiled frame is HF's ``wrapper`` around ``forward``; rebuild its locals.
    fn = compiled._torchdynamo_orig_callable.__func__
    code = fn.__code__
    func = fn.__closure__[code.co_freevars.index("func")].cell_contents
    frame_locals = {"self": model, "args": (), "kwargs": calls[-1], "func": func}
    entries = _debug_get_cache_entry_list(code)
    with torch.no_grad():
        passing = [e for e in entries if e.guard_manager.check(frame_locals)]
        if len(passing) != 1:
            raise RuntimeError(f"{len(passing)} graphs accept the decode step's locals; want 1")
        guard = passing[0].guard_manager
        managers, lines = _tree_size(guard)
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
        step_warm, step_cold, _, _ = _outside_replayed(run, model, new_tokens, rounds)
    return {
        "mode": mode,
        "graphs": len(entries),
        "guard_managers": managers,
        "tree_lines": lines,
        "warm_us": statistics.median(warm) * 1e6,
        "cold_us": statistics.median(cold) * 1e6,
        "dynamo_aot_hf_warm_ms": step_warm,
        "dynamo_aot_hf_cold_ms": step_cold,
    }


COLUMNS = (
    "guard policy",
    "managers / tree lines",
    "check warm us",
    "check cold us",
    "Dynamo/AOT/HF ms/token warm",
    "cold",
)


def to_markdown(rows: list[dict[str, Any]], name: str) -> str:
    cells = [
        {
            COLUMNS[0]: f"`{r['mode']}`",
            COLUMNS[1]: f"{r['guard_managers']} / {r['tree_lines']}",
            COLUMNS[2]: f"{r['warm_us']:.1f}",
            COLUMNS[3]: f"{r['cold_us']:.0f}",
            COLUMNS[4]: f"{r['dynamo_aot_hf_warm_ms']:.2f}",
            COLUMNS[5]: f"{r['dynamo_aot_hf_cold_ms']:.2f}",
        }
        for r in rows
    ]
    title = f"Decode-graph guard check, {name}, static cache (medians; cold = after a stream)"
    return title + "\n\n" + harness.markdown_table(cells, COLUMNS)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-4x512")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--stem", default="guards")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.model, args.child, args.new_tokens, args.rounds)))
        return
    rows = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.probes.guards", "--child", mode]
            + ["--model", args.model, "--new-tokens", str(args.new_tokens)]
            + ["--rounds", str(args.rounds)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    harness.write_results(RESULTS, args.stem, rows, to_markdown(rows, args.model))


if __name__ == "__main__":
    main()
