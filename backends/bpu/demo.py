"""``fxpass demo``: a stock transformers Qwen3 compiled with backend="fxpass_bpu".

Builds the model from a small config with random weights (no download), compiles it with
``torch.compile(model, backend="fxpass_bpu", dynamic=False)`` (no fxpass import needed: the
backend is an entry point), checks the logits against eager, prints the partition report and
the speedup over eager (medians, measured side by side).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(args: argparse.Namespace) -> int:
    import fxpass
    from fxpass import zoo

    heads = max(2, args.hidden // 64)
    model, kwargs = zoo.get(
        "qwen3",
        layers=args.layers,
        hidden=args.hidden,
        heads=heads,
        kv_heads=max(1, heads // 2),
        vocab=32000,
        tokens=args.tokens,
        dtype=getattr(torch, args.dtype),
    )
    print(
        f"Qwen3ForCausalLM: {args.layers} layers, hidden {args.hidden}, {args.tokens} tokens, "
        f"{args.dtype}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
        "(random weights)"
    )
    with torch.no_grad():
        expected = model(**kwargs).logits
        t = time.perf_counter()
        compiled = torch.compile(model, backend="fxpass_bpu", dynamic=False)
        got = compiled(**kwargs).logits
        first = time.perf_counter() - t
        report = fxpass.compile_reports()[-1]
        print(report)
        err = (got.float() - expected.float()).abs().max().item()
        scale = expected.float().abs().max().item()
        cos = torch.nn.functional.cosine_similarity(
            got.double().flatten(), expected.double().flatten(), 0
        ).item()
        ok = got.dtype == expected.dtype and (
            err <= 1e-4 * max(1.0, scale) if args.dtype == "float32" else cos >= 0.999
        )
        print(
            f"check vs eager: max abs err {err:.2e} (output scale {scale:.2f}), cosine "
            f"{cos:.6f}, dtype {got.dtype} -> {'OK' if ok else 'MISMATCH'}"
        )
        for _ in range(3):  # warm both before timing
            model(**kwargs)
            compiled(**kwargs)
        eager_ms, ours_ms = [], []
        for _ in range(5):  # interleaved rounds so machine noise hits both alike
            eager_ms.append(_median_ms(lambda: model(**kwargs), 5))
            ours_ms.append(_median_ms(lambda: compiled(**kwargs), 5))
        e, o = statistics.median(eager_ms), statistics.median(ours_ms)
    print(
        f"first call (compile) {first:.2f}s; latency eager {e:.2f} ms, fxpass_bpu {o:.2f} ms "
        f"(median of 25): speedup {e / o:.2f}x"
    )
    return 0 if ok else 1
