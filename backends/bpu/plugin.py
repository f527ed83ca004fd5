"""The BPU target, registered through the ``fxpass`` entry point group."""

from __future__ import annotations

import argparse

from fxpass.plugins import Command, Target


def fxpass_targets() -> list[Target]:
    return [
        Target(
            name="bpu",
            description="Horizon/D-Robotics BPU (hbdk4); no BF16, static shapes only",
            enable=("bf16_promotion", "bf16_cast_cancel"),
        )
    ]


def _demo_arguments(d: argparse.ArgumentParser) -> None:
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--hidden", type=int, default=512)
    d.add_argument("--tokens", type=int, default=32)
    d.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    d.add_argument(
        "--generate", action="store_true", help="greedy generate() with a static cache instead"
    )


def _explain_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument("model", help="built-in name (e.g. qwen3-tiny) or path/to/file.py:factory")
    e.add_argument("--march", default="nash-p")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.add_argument("--svg", metavar="FILE", help="draw the graph with regions coloured")
    e.add_argument("--min-compute-macs", type=int, default=None)
    e.add_argument("--quantize", nargs="?", const="w8a16", default=None, metavar="CONFIG",
                   help="also quantize regions (w8a16 by default, or w8a8), calibrate on the "
                   "example input, and show per region where Q/DQ went and what stayed float")


def _run_demo(args: argparse.Namespace) -> int:
    from fxpass.backends.bpu.demo import main

    return main(args)


def _run_explain(args: argparse.Namespace) -> int:
    from fxpass.backends.bpu.explain import main

    return main(args)


def fxpass_commands() -> list[Command]:
    return [
        Command("demo", "compile a stock HF Qwen3 with backend='fxpass_bpu'", _demo_arguments,
                _run_demo),
        Command("explain", "show rewrites, regions and CPU-left nodes for a model",
                _explain_arguments, _run_explain),
    ]
