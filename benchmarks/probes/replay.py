"""Replayed decode steps (``fxpass.hf.replay``) against trusted ones, beside the package, A/B
in one process.

    python -m benchmarks.probes.replay [--models qwen3-4x512,llama-4x512] [--repeats 9]

Why this exists: a trusted decode step still enters Dynamo's frame (its parameter fetches,
the differentiating guards, AOTAutograd's wrapper, the output object); a replayed one calls
the step's compiled graph alone, as a package's runner does. Per model: the
model under ``compile_for_generate`` (fxpass_bpu), called as shipped and with its plans never
learned (``replay.Plan.learn`` returning None: every later step trusted), and the
``ort`` package of the same weights; decode ms/token over ``--new-tokens`` greedy tokens,
interleaved (``benchmarks.generate.decode_side_by_side``), every contender's tokens checked
against eager's. Issue 47's bar: the JIT at most 1.2x the package. Writes
``benchmarks/probes/results/replay.{json,md}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks import harness
from benchmarks.generate import PROMPT, _build, _compile_for, _hf_generate, _package

RESULTS = Path(__file__).parent / "results"


def measure(name: str, new_tokens: int, repeats: int) -> dict[str, Any]:
    from benchmarks.generate import decode_side_by_side
    from fxpass.hf import replay, steps

    torch._dynamo.reset()
    max_len = PROMPT + new_tokens + 2
    model, ids = _build(name)
    with torch.no_grad():
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=new_tokens + 1, eos_token_id=None)
    _compile_for(model, "fxpass_bpu", max_len)
    jit = _hf_generate(model, ids)
    runs = {"replayed": jit, "trusted": jit, "package": _package(name, max_len)}
    learn = replay.Plan.learn

    def trusted_only(*a: Any, **k: Any) -> Any:
        return None

    def gated(label: str) -> Any:
        run = runs[label]
        if label != "trusted":
            return run

        def off(n: int) -> Any:
            with mock.patch.object(replay.Plan, "learn", trusted_only):
                return run(n)
        return off

    before = steps.STEPS.copy()
    res = decode_side_by_side({k: gated(k) for k in runs}, reference, new_tokens, repeats)
    replay.Plan.learn = learn
    ms = res["decode_ms_per_token"]
    return {"model": name, "new_tokens": new_tokens, "decode_ms_per_token": ms,
            "tokens_match_eager": res["tokens_match_eager"],
            "jit_vs_package": {k: ms[k] / ms["package"] for k in ("replayed", "trusted")},
            "steps": {k: steps.STEPS[k] - before[k] for k in ("full", "trusted", "replayed")}}


def to_markdown(res: dict[str, Any]) -> str:
    rows = [{
        "model": r["model"],
        "replayed ms/token": f"{r['decode_ms_per_token']['replayed']:.3f}",
        "trusted ms/token": f"{r['decode_ms_per_token']['trusted']:.3f}",
        "package ms/token": f"{r['decode_ms_per_token']['package']:.3f}",
        "replayed / package": f"{r['jit_vs_package']['replayed']:.2f}x",
        "trusted / package": f"{r['jit_vs_package']['trusted']:.2f}x",
        "tokens = eager": all(r["tokens_match_eager"].values()),
        "steps full/trusted/replayed": "/".join(str(r["steps"][k]) for k in
                                                ("full", "trusted", "replayed")),
    } for r in res["rows"]]
    return harness.markdown_table(rows, list(rows[0]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-4x512,llama-4x512")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    rows = [measure(m, args.new_tokens, args.repeats) for m in args.models.split(",")]
    harness.publish(RESULTS, "replay", {"rows": rows}, to_markdown)


if __name__ == "__main__":
    main()
