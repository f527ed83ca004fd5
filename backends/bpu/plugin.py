"""The BPU target and device, and the CLI's model commands, registered through the ``fxpass``
entry point group.

``demo`` runs on the BPU device. ``explain``, ``export``, ``run`` and ``generate`` take
``--device`` (any installed device; ``bpu`` by default for ``explain`` and ``export``, the
package's own for ``run`` and ``generate``); ``--march`` is the BPU device's option.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections.abc import Callable
from typing import Any

from fxpass.plugins import Command, Target


def fxpass_devices() -> list:
    from fxpass.backends.bpu.device import DEVICE

    return [DEVICE]


def fxpass_targets() -> list[Target]:
    return [
        Target(
            name="bpu",
            description="Horizon/D-Robotics BPU (hbdk4); no BF16, static shapes only",
            enable=("bf16_promotion", "bf16_cast_cancel"),
        )
    ]


def _at_least(low: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        v = int(raw)  # argparse reports a ValueError as "invalid ... value"
        if v < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


def _hidden(raw: str) -> int:
    v = int(raw)
    if v < 64 or v % 64:
        raise argparse.ArgumentTypeError(
            f"must be a multiple of 64 (the demo's heads are 64 wide), got {v}")
    return v


def _march(raw: str) -> str:
    from fxpass.backends.bpu.capability import march

    try:
        march(raw)  # the backend's own check and message
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return raw


def _quantize(raw: str) -> str:
    from fxpass.backends.onnx.quantize import QuantizationError, resolve_config

    try:
        resolve_config(raw)
    except QuantizationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return raw


#: the device the commands use unless --device names another
DEVICE = "bpu"


def _device_argument(p: argparse.ArgumentParser, default: str | None = DEVICE,
                     text: str | None = None) -> None:
    from fxpass.plugins import load

    p.add_argument("--device", choices=sorted(load().devices), default=default,
                   help=text or f"an installed device (default {default})")


def _device_options(args: argparse.Namespace, verb: str) -> dict[str, Any] | None:
    """The device options the flags give (``--march``: the BPU's), or None after printing
    why the device has no such option (one line, the caller exits with status 2)."""
    from fxpass.plugins import get_device

    options: dict[str, Any] = {}
    for item in getattr(args, "option", None) or []:
        name, eq, raw = item.partition("=")
        if not eq or not name.strip():
            print(f"fxpass {verb}: --option takes NAME=VALUE (e.g. quantize=w4), got "
                  f"{item!r}", file=sys.stderr)
            return None
        try:  # numbers, True/False/None, quoted strings; anything else is a plain string
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            value = raw.strip()
        options[name.strip()] = value
    if args.march is not None:
        if "march" not in get_device(args.device).option_names():
            print(f"fxpass {verb}: --march is an option of device {DEVICE}; device "
                  f"{args.device!r} has no march", file=sys.stderr)
            return None
        options["march"] = args.march
    return options


def _svg(raw: str) -> str:
    parent = os.path.dirname(os.path.abspath(raw))
    if not os.path.isdir(parent):  # checked before the model runs, not after
        raise argparse.ArgumentTypeError(f"directory {parent} does not exist")
    return raw


def _demo_arguments(d: argparse.ArgumentParser) -> None:
    # (bad sizes failed deep inside transformers; found by a probe)
    d.add_argument("--layers", type=_at_least(1), default=4)
    d.add_argument("--hidden", type=_hidden, default=512)
    d.add_argument("--tokens", type=_at_least(1), default=32)
    d.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    d.add_argument(
        "--generate", action="store_true", help="greedy generate() with a static cache instead"
    )
    d.add_argument("--export", action="store_true",
                   help="export_for_generate, load in a fresh process, decode speed vs eager")


def _explain_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument("model", help="built-in name (e.g. qwen3-tiny) or path/to/file.py:factory")
    _device_argument(e)
    e.add_argument("--march", type=_march, default=None,
                   help="the BPU's target march (default: the device's, nash-p)")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.add_argument("--svg", metavar="FILE", type=_svg,
                   help="draw the graph with regions coloured")
    e.add_argument("--min-compute-macs", type=_at_least(0), default=None)
    e.add_argument("--quantize", nargs="?", const="w8a16", default=None, metavar="CONFIG",
                   type=_quantize,
                   help="also quantize regions (w8a16 by default, or w8a8), calibrate on the "
                   "example input, and show per region where Q/DQ went and what stayed float")


def _run_demo(args: argparse.Namespace) -> int:
    from fxpass.tools.demo import main

    return main(args, DEVICE)


def _run_explain(args: argparse.Namespace) -> int:
    from fxpass.tools.explain import main

    options = _device_options(args, "explain")
    if options is None:
        return 2
    calibrate = None
    if args.quantize:
        from fxpass.backends.onnx.calibration import calibrate

        if args.device == DEVICE:  # calibration records on the host stand-in's sessions
            options["executor"] = "onnxruntime"
    return main(args, options, calibrate)


def _export_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument("model", help="built-in name (e.g. bert, qwen3-tiny) or path/to/file.py:factory")
    e.add_argument("out", help="the package directory to write")
    _device_argument(e)
    e.add_argument("--march", type=_march, default=None,
                   help="the BPU's target march (default: the device's, nash-p)")
    e.add_argument("--min-compute-macs", type=_at_least(0), default=None)
    e.add_argument("--option", "-o", action="append", metavar="NAME=VALUE",
                   help="a device option, repeatable (e.g. on --device ort: -o quantize=w4 "
                   "-o block_size=128); the device checks it")
    e.add_argument("--generate", action="store_true",
                   help="a decoder-only LM for generation: prefill and decode programs over a "
                   "static KV cache (export_for_generate)")
    e.add_argument("--max-cache-len", type=_at_least(2), default=256)
    e.add_argument("--prefill-length", type=_at_least(1), default=32)
    e.add_argument("--batch-size", type=_at_least(1), default=1)


def _generate_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("package", help="a directory written by fxpass export --generate")
    _device_argument(g, None, "refuse a package exported for another device (default: run "
                     "on the package's own)")
    g.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    g.add_argument("--max-new-tokens", type=_at_least(1), default=32)
    g.add_argument("--sample", action="store_true", help="sample instead of greedy")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=_at_least(1), default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)


def _run_generate(args: argparse.Namespace) -> int:
    from fxpass.tools.deploy import generate_main

    return generate_main(args)


def _score_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("package", help="a directory written by fxpass export --generate")
    s.add_argument("--against", help="another generation package of the same vocabulary "
                   "(the fp32 export of the same model): its logits are the reference")
    _device_argument(s, None, "refuse a package exported for another device")
    ids = s.add_mutually_exclusive_group(required=True)
    ids.add_argument("--prompt-ids", help="comma-separated token ids")
    ids.add_argument("--ids-file", help="a text file of token ids (commas or spaces)")


def _run_score(args: argparse.Namespace) -> int:
    from fxpass.tools.deploy import score_main

    return score_main(args)


def _run_arguments(r: argparse.ArgumentParser) -> None:
    r.add_argument("package", help="a directory written by fxpass export")
    _device_argument(r, None, "refuse a package exported for another device (default: run "
                     "on the package's own)")
    r.add_argument("--inputs", help="a torch.save file of (args, kwargs); default: random "
                   "inputs of the exported shapes")
    r.add_argument("--repeat", type=_at_least(0), default=10, help="timed calls after the first")


def _run_export(args: argparse.Namespace) -> int:
    from fxpass.tools.deploy import export_main

    options = _device_options(args, "export")
    return 2 if options is None else export_main(args, options)


def _run_run(args: argparse.Namespace) -> int:
    from fxpass.tools.deploy import run_main

    return run_main(args)


def fxpass_commands() -> list[Command]:
    return [
        Command("demo", "compile a stock HF Qwen3 with backend='fxpass_bpu'", _demo_arguments,
                _run_demo),
        Command("explain", "show rewrites, regions and CPU-left nodes for a model on a device",
                _explain_arguments, _run_explain),
        Command("export", "export a model ahead of time to a package directory",
                _export_arguments, _run_export),
        Command("run", "load an exported package and call it (no compile)", _run_arguments,
                _run_run),
        Command("generate", "generate tokens from a package made with export --generate",
                _generate_arguments, _run_generate),
        Command("score", "a generation package's logits on given ids against another's "
                "(top-1, cosine, perplexity)", _score_arguments, _run_score),
    ]
