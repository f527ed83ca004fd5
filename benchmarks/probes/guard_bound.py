"""The most any guard policy can buy a decode step: Dynamo's guards checked, or not at all.

    python -m benchmarks.probes.guard_bound [--model qwen3-4x512] [--new-tokens 32] [--repeats 9]

Why this exists: ``benchmarks.probes.guards`` times the decode graph's guard check alone
(0.5-0.65 ms on cold caches) but could not resolve what that is worth per token of a whole
``generate()``, because each guard policy needs its own process. This bounds it from above in one
process: the same compiled model (``compile_for_generate``), called plainly and under
``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``, which runs only the guards that
tell its compiled graphs apart (prefill from decode) and no other. No guard policy can check
less, so no policy can gain more than the gap measured here. It is torch's *unsafe* mode
(a changed module attribute or config flag is not noticed); fxpass does not use it, and the
benchmark only measures it. Eager with the static cache runs beside them for scale.

Timed side by side (``harness.interleave``), decode ms/token = (t(1 + N) - t(1)) / N from the
medians; tokens are checked against eager's. Writes ``benchmarks/results/<stem>.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.generate import PROMPT, _build, _hf_generate, decode_side_by_side

RESULTS = Path(__file__).parent / "results"


def _unguarded(run: Callable[[int], Any]) -> Callable[[int], Any]:
    def call(n: int) -> Any:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return run(n)

    return call


def measure(name: str, new_tokens: int, repeats: int) -> dict[str, Any]:
    from fxpass.backends.bpu import compile_for_generate

    model, ids = _build(name)
    eager = _hf_generate(model, ids, cache_implementation="static")
    compiled = copy.deepcopy(model)
    compile_for_generate(compiled, max_cache_len=PROMPT + new_tokens + 2)
    guarded = _hf_generate(compiled, ids)
    guarded(new_tokens + 1)  # both graphs compiled with every guard before any is skipped
    runners = {"eager-static": eager, "fxpass_bpu": guarded,
               "fxpass_bpu, guards skipped": _unguarded(guarded)}
    return {"model": name, "new_tokens": new_tokens,
            **decode_side_by_side(runners, eager(new_tokens + 1), new_tokens, repeats)}


def to_markdown(r: dict[str, Any]) -> str:
    d = r["decode_ms_per_token"]
    base, full = d["eager-static"], d["fxpass_bpu"]
    rows = [{"contender": n, "decode ms/token": f"{ms:.2f}", "vs eager": f"{ms / base:.2f}x",
             "vs fxpass_bpu": f"{ms / full:.3f}x",
             "tokens = eager": "yes" if r["tokens_match_eager"][n] else "NO"}
            for n, ms in d.items()]
    gap = full - d["fxpass_bpu, guards skipped"]
    title = (f"{r['model']}, {r['new_tokens']} new tokens (medians, interleaved): skipping "
             f"every guard saves {gap:.2f} ms/token ({gap / full:.1%})")
    return title + "\n\n" + harness.markdown_table(
        rows, ["contender", "decode ms/token", "vs eager", "vs fxpass_bpu", "tokens = eager"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-4x512")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--stem", default="guard_bound")
    args = ap.parse_args(argv)
    r = measure(args.model, args.new_tokens, args.repeats)
    harness.publish(RESULTS, args.stem, r, to_markdown)


if __name__ == "__main__":
    main()
