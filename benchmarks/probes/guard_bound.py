"""What checking fewer guards buys a decode step: every guard, fxpass's step guards, none.

    python -m benchmarks.probes.guard_bound [--model qwen3-4x512] [--new-tokens 32] [--repeats 9]

Why this exists: ``benchmarks.probes.guards`` times the decode graph's guard check alone
(0.5-0.65 ms on cold caches); this measures what it is worth per token of a whole
``generate()``, in one process, on one compiled model (``compile_for_generate``):

- ``every guard``: every step checks every guard (a parked Python thread that fxpass does not
  know keeps ``fxpass.hf.steps`` off, as it would in a threaded server);
- ``step guards``: the default, the same thread vouched for (``steps.ignore_thread``): the
  later steps of each call check only the guards that tell its graphs apart;
- ``guards skipped``: the whole ``generate()`` under torch's ``skip_guard_eval_unsafe``
  stance, prefill included: no policy checks less, so none can gain more.

Eager with the static cache runs beside them for scale.

Timed side by side (``harness.interleave``), decode ms/token = (t(1 + N) - t(1)) / N from the
medians; tokens are checked against eager's. Writes ``benchmarks/results/<stem>.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.generate import PROMPT, _build, _hf_generate, decode_side_by_side

RESULTS = Path(__file__).parent / "results"


def _with_thread(run: Callable[[int], Any], thread: threading.Thread,
                 vouched: bool) -> Callable[[int], Any]:
    from fxpass.hf import steps

    def call(n: int) -> Any:
        if vouched:
            steps.ignore_thread(thread)
        else:
            steps._IGNORED_THREADS.discard(thread)
        return run(n)

    return call


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
    stop = threading.Event()
    parked = threading.Thread(target=stop.wait, name="parked")
    parked.start()
    try:
        runners = {"eager-static": eager,
                   "every guard": _with_thread(guarded, parked, vouched=False),
                   "step guards": _with_thread(guarded, parked, vouched=True),
                   "guards skipped": _unguarded(guarded)}
        return {"model": name, "new_tokens": new_tokens,
                **decode_side_by_side(runners, eager(new_tokens + 1), new_tokens, repeats)}
    finally:
        stop.set()
        parked.join()


def to_markdown(r: dict[str, Any]) -> str:
    d = r["decode_ms_per_token"]
    base, full = d["eager-static"], d["every guard"]
    rows = [{"contender": n, "decode ms/token": f"{ms:.2f}", "vs eager": f"{ms / base:.2f}x",
             "vs every guard": f"{ms / full:.3f}x",
             "tokens = eager": "yes" if r["tokens_match_eager"][n] else "NO"}
            for n, ms in d.items()]
    title = (f"{r['model']}, {r['new_tokens']} new tokens (medians, interleaved): step guards "
             f"save {full - d['step guards']:.2f} ms/token, skipping every guard "
             f"{full - d['guards skipped']:.2f}")
    return title + "\n\n" + harness.markdown_table(
        rows, ["contender", "decode ms/token", "vs eager", "vs every guard", "tokens = eager"])


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
