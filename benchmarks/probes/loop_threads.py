"""generate() with HF's loop on one torch thread or on the caller's, over a real vocabulary.

    python -m benchmarks.probes.loop_threads [--vocab 151936] [--new-tokens 32] [--repeats 7]

Why this exists: between two decode steps HF's loop works on the logits (a float32 copy,
argmax, the logits processors). Over a real vocabulary (Qwen3's 151,936 words) those ops are
parallel, and torch's OpenMP workers then keep spinning into the next step, on the cores the
step's onnxruntime region needs. ``compile_for_generate(loop_threads=1)`` (the default) runs the
loop on one thread; ``loop_threads=None`` leaves torch's count. The benchmark models use a
32,000-word vocabulary, below torch's parallel grain, so they cannot show it.

Qwen3 4 x 512 with ``--vocab`` words, fp32, a 32-token prompt, static cache; two copies of the
same weights compiled both ways, and eager with the static cache, timed side by side
(``harness.interleave``). Decode ms/token = (t(1 + N) - t(1)) / N from the medians.
Writes ``benchmarks/probes/results/loop_threads.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.generate import PROMPT, _hf_generate, decode_side_by_side

RESULTS = Path(__file__).parent / "results"


def run(vocab: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    from fxpass.backends.bpu import compile_for_generate
    from fxpass.tools import zoo

    model, kw = zoo.get("qwen3", layers=4, hidden=512, heads=8, kv_heads=4, vocab=vocab,
                        tokens=PROMPT)
    ids = kw["input_ids"][:1]
    runners = {"eager-static": _hf_generate(model, ids, cache_implementation="static")}
    for name, threads in (("loop on 1 thread", 1), ("loop on torch's threads", None)):
        m = copy.deepcopy(model)
        compile_for_generate(m, max_cache_len=PROMPT + new_tokens + 2,
                             options={"cache": False}, loop_threads=threads)
        runners[name] = _hf_generate(m, ids)
    reference = runners["eager-static"](new_tokens + 1)
    return {"vocab": vocab, "new_tokens": new_tokens, "torch_threads": torch.get_num_threads(),
            **decode_side_by_side(runners, reference, new_tokens, repeats)}


def to_markdown(r: dict[str, Any]) -> str:
    base = r["decode_ms_per_token"]["eager-static"]
    rows = [{"contender": n, "decode ms/token": f"{ms:.2f}", "vs eager": f"{ms / base:.2f}x",
             "tokens = eager": "yes" if r["tokens_match_eager"][n] else "NO"}
            for n, ms in r["decode_ms_per_token"].items()]
    title = (f"Qwen3 4x512, vocabulary {r['vocab']}, {r['new_tokens']} new tokens, "
             f"torch threads {r['torch_threads']} (medians, interleaved)")
    return title + "\n\n" + harness.markdown_table(
        rows, ["contender", "decode ms/token", "vs eager", "tokens = eager"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    r = run(args.vocab, args.new_tokens, args.repeats)
    harness.publish(RESULTS, "loop_threads", r, to_markdown)


if __name__ == "__main__":
    main()
