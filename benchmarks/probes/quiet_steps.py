"""The weight guard skipped on the trusted steps of a quiet ``generate()`` call
(``fxpass.hf.quiet``) against checked on every step, A/B in one process.

    python -m benchmarks.probes.quiet_steps [--rounds 21] [--tokens 64]

One Qwen3 4 x 512 fp32 model under ``compile_for_generate(device="ort")``. Each round generates
with quiet calls and then with calls taken as not quiet (the order alternating), and times the
decode: (t(1 + N) - t(1)) / N. Reported: the median ms/token of each and the median of the
paired ratios. Tokens must be equal.
Writes ``benchmarks/probes/results/quiet_steps.{json,md}``.
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.probes import paired_cli, paired_decode, paired_ratio


def run(rounds: int, tokens: int) -> dict:
    from benchmarks.generate import _build
    from fxpass.backends.bpu import settle
    from fxpass.hf import generation

    model, ids = _build("qwen3-4x512")
    generation.compile_for_generate(model, max_cache_len=ids.shape[1] + tokens + 8,
                                    device="ort")
    quiet = generation.quiet_call

    def gen(n: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    def switch(on: bool) -> None:
        generation.quiet_call = quiet if on else (lambda *a: False)

    gen(tokens + 1)
    settle()
    try:
        per, out = paired_decode(gen, switch, rounds, tokens)
    finally:
        generation.quiet_call = quiet
    return {"model": "qwen3-4x512 fp32, compile_for_generate(device='ort')", "rounds": rounds,
            "tokens": tokens, "quiet_ms_per_token": statistics.median(per[True]),
            "checked_ms_per_token": statistics.median(per[False]),
            "paired_ratio": paired_ratio(per),
            "tokens_equal": bool(torch.equal(out[True], out[False]))}


def main(argv: list[str] | None = None) -> None:
    paired_cli(__doc__, run, "quiet_steps", [
        ("model", "model", ""), ("quiet ms/token", "quiet_ms_per_token", ".3f"),
        ("weights checked ms/token", "checked_ms_per_token", ".3f"),
        ("paired ratio", "paired_ratio", ".3fx"), ("tokens equal", "tokens_equal", "")],
        rounds=21, tokens=64, argv=argv)


if __name__ == "__main__":
    main()
