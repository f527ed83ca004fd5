"""The ``fxpass`` command: ``rules`` (rules, targets and devices), ``cache export`` /
``cache import`` (a portable bundle of the artifact cache), ``--version``, and the commands
plugins add."""

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
    """Every rule: on/off by default, priority, the targets that run it, tags, roots, plugin;
    then every target and every installed device with its options."""
    from .plugins import load

    reg = load()
    for name in sorted(reg.rules):
        r = reg.rules[name]
        on = [t.name for t in reg.targets.values() if t.selects(r)]
        state = "on " if r.default else "off"
        kind = "pattern" if r.pattern is not None else "graph" if r.graph_level else "node"
        print(f"{name}  [{state} by default] priority={r.priority} {kind} rule, plugin={r.plugin}")
        tags = f"; tags: {', '.join(sorted(r.tags))}" if r.tags else ""
        print(f"    targets: {', '.join(on) if on else '-'}; roots: {_roots(r)}{tags}")
        print(f"    {r.description}")
    for t in sorted(reg.targets.values(), key=lambda t: t.name):
        tags = f", rules tagged {list(t.enable_tags)}" if t.enable_tags else ""
        print(
            f"target {t.name} (plugin={t.plugin}): enables {list(t.enable)}{tags}, "
            f"disables {list(t.disable)}; {t.description}"
        )
    for d in sorted(reg.devices.values(), key=lambda d: d.name):
        opts = ", ".join(d.option_names()) or "none"
        print(f"device {d.name} (plugin={d.plugin}): backend fxpass_{d.name}, target "
              f"{d.target}, options: {opts}; {d.description}")
    for source, err in reg.failures:
        print(f"FAILED plugin {source}: {err}", file=sys.stderr)
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    """``fxpass cache export OUT`` / ``import IN``: every verified entry of a cache directory
    into one file, and back (verified again) on a machine without the network or Redis."""
    from .jit.bundle import export_bundle, import_bundle

    if args.action == "export":
        s = export_bundle(args.path, args.cache_dir, used_only=False)
        print(f"exported {s['entries']} entries ({s['bytes'] / 1e6:.1f} MB) to {args.path}"
              + (f"; left out {len(s['skipped'])} that failed verification" if s["skipped"]
                 else ""))
        return 0
    s = import_bundle(args.path, args.cache_dir)
    print(f"imported {s['imported']} entries ({s['bytes'] / 1e6:.1f} MB) from {args.path}")
    for why in s["refused"]:
        print(f"refused {why}", file=sys.stderr)
    return 1 if s["refused"] else 0


def build_parser() -> argparse.ArgumentParser:
    """The core's own commands, plus every command a plugin contributes (``fxpass_commands``).

    The core imports no backend: ``demo`` and ``explain`` are a device plugin's commands.
    """
    from .plugins import load

    commands = load().commands
    p = argparse.ArgumentParser(
        prog="fxpass",
        description=__doc__,
        epilog="plugin commands: "
        + (", ".join(f"{n} ({c.plugin})" for n, c in sorted(commands.items())) or "none"),
    )
    p.add_argument("--version", action="version", version=f"fxpass {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("rules", help="list every loaded rule with its plugin, roots and description")
    c = sub.add_parser("cache", help="export the artifact cache to a bundle file, or import one")
    c.add_argument("action", choices=["export", "import"])
    c.add_argument("path", help="the bundle file (a tar) to write or read")
    c.add_argument("--cache-dir", default=None,
                   help="the cache directory, as the cache_dir option names it (default: "
                        "$FXPASS_CACHE_DIR/artifacts, else the user cache directory's)")
    for name, c in sorted(commands.items()):
        if name in ("rules", "cache"):
            continue  # the core's own command wins; load() already named both plugins
        c.arguments(sub.add_parser(name, help=f"{c.help} [plugin {c.plugin}]"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "rules":
        return cmd_rules(args)
    if args.cmd == "cache":
        return cmd_cache(args)
    from .plugins import load

    return load().commands[args.cmd].run(args)


if __name__ == "__main__":
    raise SystemExit(main())
