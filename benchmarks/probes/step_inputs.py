"""Stepped decode inputs (``fxpass.hf.inputs``) against HF's own, A/B in one process.

    python -m benchmarks.probes.step_inputs [--rounds 21] [--tokens 64]

One Qwen3 4 x 512 fp32 model under ``compile_for_generate(device="ort")``. Each round generates
with the model's ``prepare_inputs_for_generation`` stepping and then HF's (the order
alternating) and times the decode: (t(1 + N) - t(1)) / N. Reported: the median ms/token of each
and the median of the paired ratios. Tokens must be equal.
Writes ``benchmarks/probes/results/step_inputs.{json,md}``.
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.probes import paired_cli, paired_decode, paired_ratio


def run(rounds: int, tokens: int) -> dict:
    from benchmarks.generate import _build
    from fxpass.backends.bpu import settle
    from fxpass.hf import inputs
    from fxpass.hf.generation import compile_for_generate

    model, ids = _build("qwen3-4x512")
    compile_for_generate(model, max_cache_len=ids.shape[1] + tokens + 8, device="ort")
    stepping = model.prepare_inputs_for_generation
    prepare = {True: stepping, False: getattr(stepping, inputs.UNSTEPPED)}

    def gen(n: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    gen(tokens + 1)
    settle()
    before = inputs.COUNTS["stepped"]

    def switch(step: bool) -> None:
        model.prepare_inputs_for_generation = prepare[step]

    per, out = paired_decode(gen, switch, rounds, tokens)
    model.prepare_inputs_for_generation = stepping
    return {"model": "qwen3-4x512 fp32, compile_for_generate(device='ort')", "rounds": rounds,
            "tokens": tokens, "stepped_ms_per_token": statistics.median(per[True]),
            "hf_ms_per_token": statistics.median(per[False]),
            "paired_ratio": paired_ratio(per),
            "stepped_inputs": inputs.COUNTS["stepped"] - before,
            "tokens_equal": bool(torch.equal(out[True], out[False]))}


def main(argv: list[str] | None = None) -> None:
    paired_cli(__doc__, run, "step_inputs", [
        ("model", "model", ""), ("stepped ms/token", "stepped_ms_per_token", ".3f"),
        ("HF's ms/token", "hf_ms_per_token", ".3f"), ("paired ratio", "paired_ratio", ".3fx"),
        ("stepped inputs", "stepped_inputs", ""), ("tokens equal", "tokens_equal", "")],
        rounds=21, tokens=64, argv=argv)


if __name__ == "__main__":
    main()
