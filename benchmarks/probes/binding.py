"""The host executor's binding through onnxruntime's C object against its Python wrapper, A/B.

    python -m benchmarks.probes.binding [--rounds 41] [--tokens 128]

One Qwen3 4 x 512 ``quantize="w4"`` package (block 128), one process. Each round generates
with ``host.binding.Binding.fast`` True and then False (the order alternating), every executor's
binding made again at each switch, and times the decode: (t(1 + N) - t(1)) / N. Reported: the
median ms/token of each and the median of the paired ratios. Tokens must be equal.
Writes ``benchmarks/probes/results/binding.{json,md}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args(argv)
    r = run(args.rounds, args.tokens)
    md = ("| package | C binding ms/token | wrapper ms/token | paired ratio | tokens equal |\n"
          "|---|---|---|---|---|\n"
          f"| {r['model']} | {r['c_binding_ms_per_token']:.3f} | {r['wrapper_ms_per_token']:.3f}"
          f" | {r['paired_ratio']:.2f}x | {r['tokens_equal']} |\n")
    out = ROOT / "benchmarks" / "probes" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "binding.json").write_text(json.dumps(r, indent=1) + "\n")
    (out / "binding.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
