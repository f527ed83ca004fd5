"""The ``fxpass`` command: ``rules``, ``demo``, ``explain``, ``--version``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__


def _roots(r: object) -> str:
    roots = getattr(r, "roots", None)
    if getattr(r, "graph_level", False):
        return "<graph>"
    if roots is None:
        return "<any>"
    return ", ".join(str(t) for t in roots)


def cmd_rules(args: argparse.Namespace) -> int:
    from .plugins import load

    reg = load()
    for name in sorted(reg.rules):
        r = reg.rules[name]
        on = [
            t.name
            for t in reg.targets.values()
            if (r.default or name in t.enable) and name not in t.disable
        ]
        state = "on " if r.default else "off"
        print(f"{name}  [{state} by default] plugin={r.plugin}")
        print(f"    targets: {', '.join(on) if on else '-'}; roots: {_roots(r)}")
        print(f"    {r.description}")
    for t in sorted(reg.targets.values(), key=lambda t: t.name):
        print(
            f"target {t.name} (plugin={t.plugin}): enables {list(t.enable)}, "
            f"disables {list(t.disable)}; {t.description}"
        )
    for source, err in reg.failures:
        print(f"FAILED plugin {source}: {err}", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from fxpass.backends.bpu.demo import main as demo_main

    return demo_main(args)


def cmd_explain(args: argparse.Namespace) -> int:
    from fxpass.backends.bpu.explain import main as explain_main

    return explain_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxpass", description=__doc__)
    p.add_argument("--version", action="version", version=f"fxpass {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("rules", help="list every loaded rule with its plugin, roots and description")
    d = sub.add_parser("demo", help="compile a stock HF Qwen3 with backend='fxpass_bpu'")
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--hidden", type=int, default=512)
    d.add_argument("--tokens", type=int, default=32)
    d.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    d.add_argument(
        "--generate", action="store_true", help="greedy generate() with a static cache instead"
    )
    e = sub.add_parser("explain", help="show rewrites, regions and CPU-left nodes for a model")
    e.add_argument("model", help="built-in name (e.g. qwen3-tiny) or path/to/file.py:factory")
    e.add_argument("--march", default="nash-p")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.add_argument("--svg", metavar="FILE", help="draw the graph with regions coloured")
    e.add_argument("--min-compute-macs", type=int, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"rules": cmd_rules, "demo": cmd_demo, "explain": cmd_explain}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
