"""``fxpass demo``: a stock transformers Qwen3 compiled with ``backend=f"fxpass_{device}"``.

Builds the model from a small config with random weights (no download), compiles it with
``torch.compile(model, backend=f"fxpass_{device}", dynamic=False)`` (no fxpass import needed:
the backend is an entry point), checks the logits against eager, prints the partition report
and the speedup over eager (medians, measured side by side). The device is the one the plugin
that owns the command passes in.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from fxpass.plugins import get_device


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _qwen3(args: argparse.Namespace, **kw: object) -> tuple[torch.nn.Module, dict]:
    from fxpass.tools import zoo

    heads = max(2, args.hidden // 64)
    return zoo.get(
        "qwen3",
        layers=args.layers,
        hidden=args.hidden,
        heads=heads,
        kv_heads=max(1, heads // 2),
        vocab=32000,
        tokens=args.tokens,
        **kw,
    )


def main(args: argparse.Namespace, device: str) -> int:
    """``fxpass demo`` on installed device ``device``: a one-line error, not a traceback, where
    transformers is missing (the demo's model is a transformers Qwen3; a plain install has the
    backend but not it)."""
    from fxpass.tools.zoo import MissingExtra

    try:
        if getattr(args, "export", False):
            return export_demo(args, device)
        if getattr(args, "generate", False):
            return generate_demo(args, device)
        return compile_demo(args, device)
    except MissingExtra as e:
        print(f"fxpass demo: {e}", file=sys.stderr)
        return 2


def compile_demo(args: argparse.Namespace, device: str) -> int:
    """``fxpass demo``: torch.compile with ``backend=f"fxpass_{device}"``, checked against
    eager."""
    import fxpass

    backend = f"fxpass_{device}"

    model, kwargs = _qwen3(args, dtype=getattr(torch, args.dtype))
    print(
        f"Qwen3ForCausalLM: {args.layers} layers, hidden {args.hidden}, {args.tokens} tokens, "
        f"{args.dtype}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
        "(random weights)"
    )
    with torch.no_grad():
        expected = model(**kwargs).logits
        t = time.perf_counter()
        compiled = torch.compile(model, backend=backend, dynamic=False)
        got = compiled(**kwargs).logits
        first = time.perf_counter() - t
        # timed below at steady state: tiered regions on their prepacked sessions
        get_device(device).settle()
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
        f"first call (compile) {first:.2f}s; latency eager {e:.2f} ms, {backend} {o:.2f} ms "
        f"(median of 25): speedup {e / o:.2f}x"
    )
    return 0 if ok else 1


def generate_demo(args: argparse.Namespace, device: str, new_tokens: int = 32) -> int:
    """``fxpass demo --generate``: greedy generate() with a static cache, tokens/s vs eager."""
    import fxpass
    from fxpass.hf.generation import compile_for_generate

    model, kwargs = _qwen3(args)
    ids = kwargs["input_ids"]
    eager = _qwen3(args)[0]  # the same seeded weights, left uncompiled

    def gen(m: torch.nn.Module, n: int, **kw: object) -> torch.Tensor:
        with torch.no_grad():
            return m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)

    print(
        f"Qwen3ForCausalLM: {args.layers} layers, hidden {args.hidden}, prompt {args.tokens} "
        f"tokens, {new_tokens} new tokens, greedy, static cache (random weights)"
    )
    expected = gen(eager, new_tokens, cache_implementation="static")
    before = len(fxpass.compile_reports())
    compile_for_generate(model, max_cache_len=args.tokens + new_tokens + 1, device=device)
    t = time.perf_counter()
    got = gen(model, new_tokens)
    first = time.perf_counter() - t
    get_device(device).settle()
    reports = fxpass.compile_reports()[before:]
    for r in reports:
        print(r)
    ok = torch.equal(got, expected)
    print(f"tokens vs eager: {'identical' if ok else 'DIFFERENT'}; {len(reports)} graph(s)")
    e_ms, o_ms = [], []
    for _ in range(3):  # interleaved rounds; decode ms/token = (t(1+n) - t(1)) / n
        for m, out, kw in (
            (eager, e_ms, {"cache_implementation": "static"}),
            (model, o_ms, {}),
        ):
            one = _median_ms(lambda m=m, kw=kw: gen(m, 1, **kw), 3)
            full = _median_ms(lambda m=m, kw=kw: gen(m, new_tokens + 1, **kw), 3)
            out.append((full - one) / new_tokens)
    e, o = statistics.median(e_ms), statistics.median(o_ms)
    print(
        f"first generate() {first:.2f}s; decode eager {e:.2f} ms/token ({1e3 / e:.0f} tokens/s), "
        f"fxpass_{device} {o:.2f} ms/token ({1e3 / o:.0f} tokens/s): {e / o:.2f}x"
    )
    return 0 if ok else 1


def export_demo(args: argparse.Namespace, device: str, new_tokens: int = 32) -> int:
    """``fxpass demo --export``: export_for_generate, save, load in a fresh process and
    generate there; then decode speed of the loaded package against eager, side by side."""
    import json
    import subprocess
    import tempfile

    from fxpass.aot.export import export_for_generate
    from fxpass.aot.package import load

    model, kwargs = _qwen3(args)
    ids = kwargs["input_ids"]
    print(f"Qwen3ForCausalLM: {args.layers} layers, hidden {args.hidden}, prompt {args.tokens} "
          f"tokens, {new_tokens} new tokens, greedy, static cache (random weights)")
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, cache_implementation="static")
    t = time.perf_counter()
    program = export_for_generate(model, max_cache_len=args.tokens + new_tokens + 1,
                                  prefill_length=min(args.tokens, 32), device=device)
    exported = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        path = program.save(f"{tmp}/qwen3")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        print(f"exported in {exported:.1f}s: {path} {size / 1e6:.0f} MB "
              f"(prefill and decode, 1 region each: "
              f"{[len(p.report.regions) for p in (program.prefill, program.decode)]})")
        torch.save(ids, f"{tmp}/ids.pt")
        child = (
            "import json, sys, time, torch\n"
            "t0 = time.perf_counter()\n"
            "from fxpass.aot.package import load\n"
            "r = load(sys.argv[1])\n"
            "out = r.generate(torch.load(sys.argv[2]), max_new_tokens=int(sys.argv[3]))\n"
            "print(json.dumps({'s': time.perf_counter() - t0, 'tokens': out.tolist()}))\n"
        )
        res = subprocess.run([sys.executable, "-c", child, path, f"{tmp}/ids.pt",
                              str(new_tokens)], capture_output=True, text=True, timeout=600)
        if res.returncode:
            print(res.stderr[-2000:], file=sys.stderr)
            return 1
        fresh = json.loads(res.stdout.strip().splitlines()[-1])
        ok = fresh["tokens"] == expected.tolist()
        print(f"fresh process: load + {new_tokens} tokens in {fresh['s']:.2f}s (no compile); "
              f"tokens vs eager: {'identical' if ok else 'DIFFERENT'}")
        runner = load(path)
        e_ms, p_ms = [], []
        for _ in range(3):  # interleaved rounds; decode ms/token = (t(1+n) - t(1)) / n
            for out, fn in (
                (e_ms, lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n,
                                                do_sample=False, cache_implementation="static")),
                (p_ms, lambda n: runner.generate(ids, max_new_tokens=n)),
            ):
                with torch.no_grad():
                    one = _median_ms(lambda fn=fn: fn(1), 3)
                    full = _median_ms(lambda fn=fn: fn(new_tokens + 1), 3)
                out.append((full - one) / new_tokens)
    e, p = statistics.median(e_ms), statistics.median(p_ms)
    print(f"decode eager {e:.2f} ms/token, package {p:.2f} ms/token: {e / p:.2f}x")
    return 0 if ok else 1
