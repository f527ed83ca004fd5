"""generate() over prompts of many lengths, as a chat sends them: compile stalls and steady state.

    python -m benchmarks.prompt_lengths [--prompts 12] [--new-tokens 16] [--repeats 3]

Why this exists: shapes are static, so each new prompt length used to compile a new prefill
graph (3-4 s each on Qwen3 4 x 512), and past Dynamo's recompile limit every new length ran its
prefill eagerly. ``compile_for_generate`` now compiles one prompt length and runs the others
through HF's chunked prefill (``fxpass/hf/prefill.py``). This measures both
policies on the same prompts:

- ``chunks``: the default (the first prompt's length is the compiled chunk);
- ``exact lengths``: ``prefill_chunk_size=None`` per call, one graph per prompt length (the
  behaviour before);
- ``eager``: HF's static cache, not compiled.

Qwen3 4 x 512, fp32, greedy, ``--prompts`` lengths from 8 to 120 (the first one 32), a fresh
``torch._dynamo.reset()`` per compiled contender (Dynamo's recompile limit counts per code
object, and both contenders compile HF's same forward). Per contender: the first pass over the
prompts (compiles included), then ``--repeats`` warm passes, each prompt timed right next to
eager's (round robin), medians. Every output is checked against eager's tokens. Writes
``benchmarks/results/prompt_lengths.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness

RESULTS = Path(__file__).parent / "results"
CONTENDERS = {"chunks": {}, "exact lengths": {"prefill_chunk_size": None}}


def _lengths(n: int) -> list[int]:
    """32 first (the benchmarks' prompt), then lengths spread over 8..120, none repeated."""
    g = torch.Generator().manual_seed(0)
    rest = (torch.randperm(113, generator=g) + 8).tolist()
    return [32] + [x for x in rest if x != 32][: n - 1]


def _generate(model: Any, ids: torch.Tensor, new: int, **kw: Any) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)
        return time.perf_counter() - t, out


def run(prompts: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    import fxpass
    from fxpass.backends.bpu import compile_for_generate, settle
    from fxpass.tools import zoo

    model, _ = zoo.get("qwen3", layers=4, hidden=512, heads=8, kv_heads=4, vocab=32000,
                       tokens=32)
    lengths = _lengths(prompts)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 32000, (1, n), generator=g) for n in lengths]
    eager = copy.deepcopy(model)
    expected = [_generate(eager, x, new_tokens, cache_implementation="static")[1] for x in ids]
    out: dict[str, Any] = {"lengths": lengths, "new_tokens": new_tokens, "contenders": {}}
    for name, kw in CONTENDERS.items():
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        compile_for_generate(m, max_cache_len=max(lengths) + new_tokens + 2,
                             options={"cache": False})
        before = len(fxpass.compile_reports())
        first, match = [], True
        for x, e in zip(ids, expected, strict=True):
            dt, got = _generate(m, x, new_tokens, **kw)
            first.append(dt)
            match &= bool(torch.equal(got, e))
        graphs = len(fxpass.compile_reports()) - before
        settle()
        warm: dict[str, list[list[float]]] = {name: [], "eager": []}
        for x in ids:
            ours, theirs = [], []
            for _ in range(repeats):
                ours.append(_generate(m, x, new_tokens, **kw)[0])
                theirs.append(_generate(eager, x, new_tokens, cache_implementation="static")[0])
            warm[name].append(ours)
            warm["eager"].append(theirs)
        med = {k: [statistics.median(v) for v in vs] for k, vs in warm.items()}
        out["contenders"][name] = {
            "first_pass_s": first, "graphs": graphs, "tokens_match_eager": match,
            "warm_median_s": med[name], "eager_warm_median_s": med["eager"],
        }
    return out


def to_markdown(r: dict[str, Any]) -> str:
    rows = []
    for name, c in r["contenders"].items():
        warm, eager = sum(c["warm_median_s"]), sum(c["eager_warm_median_s"])
        rows.append({
            "contender": name,
            "first pass s (compiles included)": f"{sum(c['first_pass_s']):.1f}",
            "slowest first call s": f"{max(c['first_pass_s']):.2f}",
            "graphs": c["graphs"],
            "warm pass s": f"{warm:.2f}",
            "eager warm pass s (interleaved)": f"{eager:.2f}",
            "warm vs eager": f"{warm / eager:.2f}x",
            "tokens = eager": "yes" if c["tokens_match_eager"] else "NO",
        })
    title = (f"Qwen3 4x512, {len(r['lengths'])} prompts of lengths {r['lengths']}, "
             f"{r['new_tokens']} new tokens each (medians)")
    return title + "\n\n" + harness.markdown_table(rows, list(rows[0]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stem", default="prompt_lengths")
    args = ap.parse_args(argv)
    r = run(args.prompts, args.new_tokens, args.repeats)
    harness.publish(RESULTS, args.stem, r, to_markdown)


if __name__ == "__main__":
    main()
