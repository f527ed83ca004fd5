"""``fxpass export MODEL OUT`` and ``fxpass run OUT``: the ahead-of-time workflow from a shell.

``export`` builds the model (a built-in name such as ``bert``, or ``path/to/file.py:factory``
returning ``(model, args)``, ``(model, kwargs)`` or ``(model, args, kwargs)``), exports it
through the BPU pipeline and writes the package, printing each stage with its time (a large
model's region compile takes a while). ``run`` loads a package in this process, feeds it
inputs (a ``torch.save`` file of ``(args, kwargs)``, or random ones of the exported specs) and
prints the outputs' shapes and the load and call times.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _progress(start: float) -> Any:
    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return say


def export_main(args: argparse.Namespace) -> int:
    from fxpass.backends.bpu.aot.export import ExportError, export
    from fxpass.backends.bpu.tools.explain import load_inputs

    say = _progress(time.perf_counter())
    say(f"building {args.model}")
    model, margs, kwargs = load_inputs(args.model)
    options: dict[str, Any] = {"march": args.march}
    if args.min_compute_macs is not None:
        options["min_compute_macs"] = args.min_compute_macs
    try:
        if args.generate:
            from fxpass.backends.bpu.aot.export import export_for_generate

            program = export_for_generate(
                model, max_cache_len=args.max_cache_len, prefill_length=args.prefill_length,
                batch_size=args.batch_size, options=options, progress=say)
        else:
            program = export(model, margs, kwargs, options=options, progress=say)
    except ExportError as e:
        print(f"fxpass export: {e}", file=sys.stderr)
        return 2
    path = Path(program.save(args.out, progress=say))
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) if isinstance(
        model, torch.nn.Module) else 0
    say("done")
    for low in ([program.prefill, program.decode] if args.generate else [program.lowered]):
        print(low.report.summary())
    ratio = f" ({size / weights:.3f}x the weights)" if weights else ""
    print(f"package {path}: {size / 1e6:.1f} MB{ratio}")
    return 0


def _load(path: str, verb: str) -> Any:
    """The package at ``path``, or None after printing why it is refused."""
    from fxpass.backends.bpu.aot.package import PackageError, load

    try:
        return load(path)
    except PackageError as e:
        print(f"fxpass {verb}: {e}", file=sys.stderr)
        return None


def generate_main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    runner = _load(args.package, "generate")
    if runner is None:
        return 2
    if not hasattr(runner, "generate"):
        print(f"fxpass generate: {args.package} is not a generation package (export it with "
              "fxpass export MODEL OUT --generate)", file=sys.stderr)
        return 2
    loaded = time.perf_counter() - t0
    try:
        ids = torch.tensor([[int(x) for x in args.prompt_ids.split(",")]])
    except ValueError:
        print(f"fxpass generate: --prompt-ids must be comma-separated integers, got "
              f"{args.prompt_ids!r}", file=sys.stderr)
        return 2
    try:
        runner.generate(ids, max_new_tokens=1)  # the sessions' first runs allocate
        t1 = time.perf_counter()
        first = runner.generate(ids, max_new_tokens=1)
        t2 = time.perf_counter()
        out = runner.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed)
        t3 = time.perf_counter()
    except ValueError as e:
        print(f"fxpass generate: {e}", file=sys.stderr)
        return 2
    new = out.shape[1] - ids.shape[1]
    print(",".join(str(t) for t in out[0, ids.shape[1]:].tolist()))
    per = ((t3 - t2) - (t2 - t1)) / max(new - 1, 1) * 1e3
    print(f"load {loaded:.2f} s, first token (warm) {(t2 - t1) * 1e3:.1f} ms (prefill of "
          f"{ids.shape[1]} tokens), {new} tokens, decode {per:.2f} ms/token", file=sys.stderr)
    del first
    return 0


def _random_inputs(specs: list[dict[str, Any]]) -> list[Any]:
    gen = torch.Generator().manual_seed(0)
    out: list[Any] = []
    for spec in specs:
        if "shape" not in spec:  # a Python constant the program was specialized on
            import ast

            out.append(ast.literal_eval(spec["value"]))
            continue
        dtype = getattr(torch, spec["dtype"].removeprefix("torch."))
        if dtype.is_floating_point:
            out.append(torch.randn(spec["shape"], generator=gen).to(dtype))
        else:
            out.append(torch.randint(0, 2, spec["shape"], generator=gen).to(dtype))
    return out


def run_main(args: argparse.Namespace) -> int:
    import torch.utils._pytree as pytree

    t0 = time.perf_counter()
    program = _load(args.package, "run")
    if program is None:
        return 2
    if "main" not in getattr(program, "programs", {}):
        print(f"fxpass run: {args.package} is a generation or bucket package; run it with "
              "fxpass generate, or load(path) in Python", file=sys.stderr)
        return 2
    loaded = time.perf_counter() - t0
    if args.inputs:
        call_args, call_kwargs = torch.load(args.inputs)
    else:  # the exported specs, in the program's flat order
        main = program.programs["main"]
        flat = _random_inputs(main.spec["inputs"])
        call_args, call_kwargs = pytree.tree_unflatten(flat, main.in_spec)
    with torch.no_grad():
        t1 = time.perf_counter()
        out = program(*call_args, **call_kwargs)
        first = time.perf_counter() - t1
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            program(*call_args, **call_kwargs)
            times.append(time.perf_counter() - t)
    for i, t in enumerate(x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)):
        print(f"output {i}: {t.dtype}{list(t.shape)}")
    med = sorted(times)[len(times) // 2] if times else first
    print(f"load {loaded * 1e3:.0f} ms, first call {first * 1e3:.1f} ms, median of "
          f"{len(times)} calls {med * 1e3:.2f} ms")
    return 0
