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
    from fxpass.backends.bpu.aot import ExportError, export
    from fxpass.backends.bpu.explain import load_inputs

    say = _progress(time.perf_counter())
    say(f"building {args.model}")
    model, margs, kwargs = load_inputs(args.model)
    options: dict[str, Any] = {"march": args.march}
    if args.min_compute_macs is not None:
        options["min_compute_macs"] = args.min_compute_macs
    try:
        program = export(model, margs, kwargs, options=options, progress=say)
    except ExportError as e:
        print(f"fxpass export: {e}", file=sys.stderr)
        return 2
    path = Path(program.save(args.out, progress=say))
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) if isinstance(
        model, torch.nn.Module) else 0
    say("done")
    print(program.report.summary())
    ratio = f" ({size / weights:.3f}x the weights)" if weights else ""
    print(f"package {path}: {size / 1e6:.1f} MB{ratio}, {len(program.regions)} region(s)")
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

    from fxpass.backends.bpu.package import PackageError, load

    t0 = time.perf_counter()
    try:
        program = load(args.package)
    except PackageError as e:
        print(f"fxpass run: {e}", file=sys.stderr)
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
