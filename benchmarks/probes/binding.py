"""The host executor's binding through onnxruntime's C object against its Python wrapper, A/B.

    python -m benchmarks.probes.binding [--rounds 41] [--tokens 128]

One Qwen3 4 x 512 ``quantize="w4"`` package (block 128), one process. Each round generates
with ``host.binding.Binding.fast`` True and then False (the order alternating), every executor's
binding made again at each switch, and times the decode: (t(1 + N) - t(1)) / N. Reported: the
median ms/token of each and the median of the paired ratios. Tokens must be equal.
Writes ``benchmarks/probes/results/binding.{json,md}``.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.probes import paired_cli


def run(rounds: int, tokens: int) -> dict:
    from benchmarks.generate import _build
    from benchmarks.weight_only import _package
    from fxpass.backends.onnx.host import binding, ort

    model, ids = _build("qwen3-4x512")
    with tempfile.TemporaryDirectory() as tmp:
        pkg = _package(model, 256, {"quantize": "w4", "block_size": 128}, Path(tmp), "pkg")
        runner = pkg["runner"]

        def gen(n: int) -> torch.Tensor:
            return runner.generate(ids, max_new_tokens=n, eos_token_id=[])

        executors = [o for o in gc.get_objects() if isinstance(o, ort.OrtExecutor)]
        per = {True: [], False: []}
        tokens_of = {}
        for r in range(rounds):
            for fast in ((True, False) if r % 2 else (False, True)):
                binding.Binding.fast = fast
                for e in executors:
                    e._generation += 1  # every thread's binding is made again
                gen(2)
                t = time.perf_counter()
                gen(1)
                one = time.perf_counter() - t
                t = time.perf_counter()
                out = gen(tokens + 1)
                per[fast].append((time.perf_counter() - t - one) / tokens * 1e3)
                tokens_of[fast] = out
        binding.Binding.fast = True
    ratios = [a / b for a, b in zip(per[True], per[False], strict=True)]
    return {"model": "qwen3-4x512 w4 block 128 package", "rounds": rounds, "tokens": tokens,
            "c_binding_ms_per_token": statistics.median(per[True]),
            "wrapper_ms_per_token": statistics.median(per[False]),
            "paired_ratio": statistics.median(ratios),
            "tokens_equal": bool(torch.equal(tokens_of[True], tokens_of[False]))}


def main(argv: list[str] | None = None) -> None:
    paired_cli(__doc__, run, "binding", [
        ("package", "model", ""), ("C binding ms/token", "c_binding_ms_per_token", ".3f"),
        ("wrapper ms/token", "wrapper_ms_per_token", ".3f"),
        ("paired ratio", "paired_ratio", ".2fx"), ("tokens equal", "tokens_equal", "")],
        rounds=41, tokens=128, argv=argv)


if __name__ == "__main__":
    main()
