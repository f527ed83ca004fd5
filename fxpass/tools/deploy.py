"""``fxpass export MODEL OUT``, ``fxpass run OUT``, ``fxpass generate OUT`` and ``fxpass
score OUT``: the ahead-of-time workflow from a shell.

``export`` builds the model (a built-in name such as ``bert``, or ``path/to/file.py:factory``
returning ``(model, args)``, ``(model, kwargs)`` or ``(model, args, kwargs)``; with
``--generate`` too, though the inputs are then unused), exports it through the pipeline of
the device ``--device`` names (with the device options the plugin that owns the command hands
in) and writes the package, printing each stage with its time (a large model's region compile
takes a while). ``run`` loads a package in this process, feeds it inputs (a ``torch.save``
file of ``(args, kwargs)``, or random ones of the exported specs) and prints the outputs'
shapes and the load and call times. ``generate`` loads a generation package and generates.
A package runs on the device it was exported for; ``--device`` there, when given, refuses a
package made for another.

A user's mistake (a bad inputs file, inputs of the wrong shape, a prompt past the cache) is one
line ``fxpass VERB: what is wrong and the fix`` with exit status 2, never a traceback: the
messages of ``load`` and the programs already name the cause and the fix.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch


def _progress(start: float) -> Any:
    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return say


def export_main(args: argparse.Namespace, options: dict[str, Any] | None = None) -> int:
    """``fxpass export``: for device ``args.device`` with ``options`` (the device's own, from
    the plugin that owns the command); stages with their times on stderr as they start, a
    program left without a region as one warning line naming ``--min-compute-macs``, the
    reports and the package's size on stdout. A bad option is one line, exit status 2."""
    from fxpass import device as devices
    from fxpass.aot.export import ExportError, NoRegionWarning, export
    from fxpass.jit.options import from_options
    from fxpass.tools.explain import load_inputs

    options = dict(options or {})
    if args.min_compute_macs is not None:
        options["min_compute_macs"] = args.min_compute_macs
    try:  # before the model is built: a device or option refused costs nothing
        from_options(options, args.device)
    except (devices.DeviceError, TypeError, ValueError) as e:
        print(f"fxpass export: {e}", file=sys.stderr)
        return 2
    say = _progress(time.perf_counter())
    say(f"building {args.model}")
    model, margs, kwargs = load_inputs(args.model)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", NoRegionWarning)
            if args.generate:
                from fxpass.aot.export import export_for_generate

                program = export_for_generate(
                    model, max_cache_len=args.max_cache_len,
                    prefill_length=args.prefill_length, batch_size=args.batch_size,
                    options=options, progress=say, device=args.device)
            else:
                program = export(model, margs, kwargs, options=options, progress=say,
                                 device=args.device)
    except ExportError as e:
        print(f"fxpass export: {e}", file=sys.stderr)
        return 2
    finally:
        _reissue(caught, NoRegionWarning)
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


def _reissue(caught: list[warnings.WarningMessage], one_line: type[Warning]) -> None:
    """Print the ``one_line`` warnings as ``fxpass export: warning: ...`` (a shell user needs
    no file and line of fxpass's source); hand every other warning back to ``warnings``."""
    for w in caught:
        if issubclass(w.category, one_line):
            print(f"fxpass export: warning: {w.message}", file=sys.stderr, flush=True)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def _load(path: str, verb: str, device: str | None = None) -> Any:
    """The package at ``path``, or None after printing why it is refused: ``device``, when
    given, must be the device the package records (a package made for another is refused
    before anything of it opens)."""
    from fxpass.aot.package import PackageError, load, read_manifest

    try:
        if device is not None:
            made_for = read_manifest(path).get("device")  # its name
            if made_for is not None and made_for != device:  # None: load says why
                raise PackageError(f"{path} was exported for device {made_for!r}, not "
                                   f"{device!r}; run it with --device {made_for}, or export "
                                   f"it again with --device {device}")
        return load(path)
    except PackageError as e:
        print(f"fxpass {verb}: {e}", file=sys.stderr)
        return None


def _load_runner(path: str, verb: str, device: str | None) -> Any:
    """The generation runner of the package at ``path``, or None after printing why not (as
    :func:`_load`, or: not a generation package)."""
    runner = _load(path, verb, device)
    if runner is not None and not hasattr(runner, "generate"):
        print(f"fxpass {verb}: {path} is not a generation package (export it with "
              "fxpass export MODEL OUT --generate)", file=sys.stderr)
        return None
    return runner


class _Clock:
    """A streamer that stamps each token as ``generate`` emits it: one timed call then gives
    the first token's latency (prompt to first token) and the decode time per token."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.stamps: list[float] = []

    def put(self, _tokens: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate_main(args: argparse.Namespace) -> int:
    """``fxpass generate``: the new tokens on stdout; load time, the warm first token and
    decode ms/token on stderr, timed on a second run of the user's own request."""
    t0 = time.perf_counter()
    runner = _load_runner(args.package, "generate", getattr(args, "device", None))
    if runner is None:
        return 2
    loaded = time.perf_counter() - t0
    try:
        ids = torch.tensor([[int(x) for x in args.prompt_ids.split(",")]])
    except ValueError:
        print(f"fxpass generate: --prompt-ids must be comma-separated integers, got "
              f"{args.prompt_ids!r}", file=sys.stderr)
        return 2
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample,
              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    try:
        # the request itself, untimed: the package checks it with the user's own numbers (a
        # one-token warm-up checked max_new_tokens=1 and named that), and the sessions' first
        # runs allocate
        runner.generate(ids, **kw)
        clock = _Clock()
        out = runner.generate(ids, streamer=clock, **kw)
    except ValueError as e:
        print(f"fxpass generate: {e}", file=sys.stderr)
        return 2
    new = out.shape[1] - ids.shape[1]
    print(",".join(str(t) for t in out[0, ids.shape[1]:].tolist()))
    tokens = clock.stamps[1:]  # the first put is the prompt
    first = (tokens[0] - clock.start) * 1e3
    decode = (f", decode {(tokens[-1] - tokens[0]) / (len(tokens) - 1) * 1e3:.2f} ms/token"
              if len(tokens) > 1 else "")
    print(f"load {loaded:.2f} s, first token (warm) {first:.1f} ms (prefill of "
          f"{ids.shape[1]} tokens), {new} tokens{decode}", file=sys.stderr)
    return 0


def score_main(args: argparse.Namespace) -> int:
    """``fxpass score``: a generation package's teacher-forced logits over the given ids
    (``Runner.score``), against another package's over the same ids (``--against``: the fp32
    export of the same model, to check a ``quantize="w4"`` one before deploying it), as one
    line on stdout: top-1 agreement, mean logit cosine and both perplexities; alone, its
    perplexity. A user's mistake is one line on stderr, exit status 2."""
    from fxpass.aot.quality import agreement

    runners = []
    for path in [args.package, *([args.against] if args.against else [])]:
        runner = _load_runner(path, "score", getattr(args, "device", None))
        if runner is None:
            return 2
        runners.append(runner)
    try:
        text = Path(args.ids_file).read_text() if args.ids_file else args.prompt_ids or ""
        ids = torch.tensor([[int(x) for x in text.replace(",", " ").split()]])
    except (OSError, ValueError) as e:
        print(f"fxpass score: the ids must be integers separated by commas or spaces, in "
              f"--prompt-ids or a --ids-file ({e})", file=sys.stderr)
        return 2
    if ids.shape[1] < 2:
        print("fxpass score: give at least 2 token ids (a perplexity scores each next token)",
              file=sys.stderr)
        return 2
    try:
        logits = [r.score(ids) for r in runners]
        q = agreement(logits[0], logits[-1], ids)
    except ValueError as e:
        print(f"fxpass score: {e}", file=sys.stderr)
        return 2
    n = ids.shape[1]
    if args.against:
        print(f"top-1 {q['top1']:.3f}, cosine {q['cosine']:.4f}, perplexity "
              f"{q['perplexity']:.2f} against {q['reference_perplexity']:.2f}, over {n} "
              "positions")
    else:
        print(f"perplexity {q['perplexity']:.2f} over {n} positions")
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


def _read_inputs(path: str) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` from a ``torch.save`` file, or a ValueError naming what is wrong."""
    if not Path(path).is_file():
        raise ValueError(f"--inputs {path}: no such file; give a torch.save file of "
                         "(args, kwargs), or leave --inputs out for random inputs")
    try:
        data = torch.load(path)
    except Exception as e:  # any unreadable file: pickle, zip or weights_only errors
        raise ValueError(f"--inputs {path} is not a torch.save file of tensors that "
                         f"torch.load(weights_only=True) reads ({type(e).__name__}); write it "
                         "with torch.save((args, kwargs), path)") from None
    if not (isinstance(data, (tuple, list)) and len(data) == 2
            and isinstance(data[0], (tuple, list)) and isinstance(data[1], dict)):
        raise ValueError(f"--inputs {path} holds {type(data).__name__}, not (args, kwargs); "
                         "write it with torch.save((args, kwargs), path), e.g. "
                         "torch.save(((x,), {}), path)")
    return tuple(data[0]), dict(data[1])


def run_main(args: argparse.Namespace) -> int:
    """``fxpass run``: the outputs' dtypes and shapes, load and call times; inputs the
    program refuses (count, shape, dtype) or cannot read are one line, exit status 2."""
    import torch.utils._pytree as pytree

    t0 = time.perf_counter()
    program = _load(args.package, "run", getattr(args, "device", None))
    if program is None:
        return 2
    if "main" not in getattr(program, "programs", {}):
        print(f"fxpass run: {args.package} is a generation or bucket package; run it with "
              "fxpass generate, or load(path) in Python", file=sys.stderr)
        return 2
    loaded = time.perf_counter() - t0
    main = program.programs["main"]
    try:
        if args.inputs:
            call_args, call_kwargs = _read_inputs(args.inputs)
        else:  # the exported specs, in the program's flat order
            flat = _random_inputs(main.spec["inputs"])
            call_args, call_kwargs = pytree.tree_unflatten(flat, main.in_spec)
        with torch.no_grad():
            t1 = time.perf_counter()
            # inputs of another count, shape or dtype are refused here with a ValueError
            # that names the input, the exported spec and the fix
            out = program(*call_args, **call_kwargs)
            first = time.perf_counter() - t1
    except ValueError as e:
        print(f"fxpass run: {e}", file=sys.stderr)
        return 2
    with torch.no_grad():
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
