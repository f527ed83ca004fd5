"""``fxpass explain MODEL [--device NAME]``: the pipeline up to partitioning, explained.

For an installed device (its rule target, its capability and its smallest region; options
as ``torch.compile`` takes them), prints the rewrites per rule, each region (nodes, MACs,
boundary tensors), the offloaded share, and every node left on the CPU grouped by reason.
``--json`` for tools, ``--svg FILE`` to draw the graph with regions coloured.
``--quantize [CONFIG]`` also compiles the regions, calibrates them on the model's example
input (with the calibration the device's plugin hands in) and shows, per region, where Q/DQ
went, what stayed float and the accuracy against the float region. MODEL is a built-in name
(``fxpass.tools.zoo``: qwen3-tiny, llama, gpt2, bert, vit, ...) or
``path/to/file.py:factory`` where ``factory()`` returns ``(model, kwargs)``,
``(model, args_tuple)``, or ``(model, args_tuple, kwargs)``.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import json
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

#: a device plugin's calibration: ``calibrate(fn, batches)`` runs ``fn(args, kwargs)`` per batch
#: and returns each quantized region's report (``region``, ``config``, ``state``, ``cosine``,
#: ``max_abs_error``, ``summary``)
Calibrate = Callable[[Callable[[tuple, dict], Any], list[tuple[tuple, dict]]], Iterable[Any]]

FACTORY_SHAPES = (
    "(model, kwargs_dict), (model, args_tuple) or (model, args_tuple, kwargs_dict), with "
    "model a torch.nn.Module (or callable) and the inputs the ones to explain it with"
)


def _split(out: Any, where: str) -> tuple[Any, tuple, dict[str, Any]]:
    """A factory's return value -> (model, args, kwargs), or a SystemExit saying what is wrong."""
    if not isinstance(out, tuple) or not 2 <= len(out) <= 3:
        got = f"a {len(out)}-tuple" if isinstance(out, tuple) else type(out).__name__
        raise SystemExit(f"{where} returned {got}; it must return {FACTORY_SHAPES}")
    model, rest = out[0], out[1:]
    if not callable(model):
        raise SystemExit(
            f"{where} returned {type(model).__name__} as the model; it must return {FACTORY_SHAPES}"
        )
    if len(rest) == 2:
        args, kw = rest
    elif isinstance(rest[0], dict):
        args, kw = (), rest[0]
    else:
        args, kw = rest[0], {}
    if isinstance(args, list):
        args = tuple(args)
    if not isinstance(args, tuple) or not isinstance(kw, dict):
        raise SystemExit(
            f"{where} returned inputs of type {type(args).__name__}/{type(kw).__name__}; it "
            f"must return {FACTORY_SHAPES} (a single tensor goes in a tuple: (model, (x,)))"
        )
    if not all(isinstance(k, str) for k in kw):
        raise SystemExit(f"{where} returned kwargs with non-string keys; keys are argument names")
    return model, args, kw


def load_inputs(spec: str) -> tuple[Any, tuple, dict[str, Any]]:
    """``(model, args, kwargs)`` for a built-in name or ``path/to/file.py:factory``."""
    from fxpass.tools import zoo

    if ":" in spec and spec.split(":")[0].endswith(".py"):
        path, factory = spec.rsplit(":", 1)
        if not os.path.isfile(path):
            raise SystemExit(f"no such file: {path} (the model is path/to/file.py:factory)")
        mod_spec = importlib.util.spec_from_file_location("fxpass_user_model", path)
        if mod_spec is None or mod_spec.loader is None:
            raise SystemExit(f"cannot import {path}")
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        if not callable(getattr(mod, factory, None)):
            raise SystemExit(f"{path} has no function {factory!r}")
        model, args, kw = _split(getattr(mod, factory)(), f"{path}:{factory}()")
        if isinstance(model, torch.nn.Module):
            model = model.eval()
        return model, args, kw
    try:
        model, kw = zoo.get(spec)
    except ValueError as e:
        raise SystemExit(f"{e}; or pass path/to/file.py:factory") from None
    except zoo.MissingExtra as e:
        raise SystemExit(f"{spec}: {e}") from None
    return model, (), kw


def load_model(spec: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``(model, kwargs)`` (kept for callers of the two-value form; positional args refused)."""
    model, args, kw = load_inputs(spec)
    if args:
        raise SystemExit(f"{spec} gives positional inputs; use load_inputs() for those")
    return model, kw


class ExplainError(ValueError):
    """A device that is not installed, or an option it or the framework refuses: the CLI
    prints it as one line ``fxpass explain: ...``, exit status 2."""


def explain(
    spec: str,
    device: str,
    options: dict[str, Any] | None = None,
    *,
    progress: bool = True,
    quantize: str | None = None,
    calibrate: Calibrate | None = None,
) -> dict[str, Any]:
    """Rewrites, regions and CPU-left nodes of model ``spec`` on installed device ``device``
    with ``options`` (the framework's and the device's, as ``torch.compile`` takes them).
    ``quantize``: also compile with ``options["quantize"]`` and calibrate on the example input
    with ``calibrate(fn, batches)`` (the device plugin's calibration; required then). A bad
    option or an unknown device is an :class:`ExplainError` naming it."""
    from fxpass import PassManager, select_rules
    from fxpass import capture_graphs as capture
    from fxpass import device as devices
    from fxpass.jit.backend import checked_capability, min_region_macs
    from fxpass.jit.options import from_options
    from fxpass.partition.cost import macs
    from fxpass.partition.partition import partition
    from fxpass.partition.region import extract
    from fxpass.plugins import get_device

    def step(msg: str) -> None:
        if progress:
            print(f"[fxpass explain] {msg}...", file=sys.stderr, flush=True)

    try:
        dev = get_device(device)
        # the explain run itself needs no artifact cache: it compiles nothing
        opts = from_options({**(options or {}), "cache": False}, dev)
        if quantize:  # a device without the option, or a bad config, fails before the run
            from_options({**(options or {}), "cache": False, "quantize": quantize}, dev)
    except (devices.DeviceError, TypeError, ValueError) as e:
        raise ExplainError(str(e)) from None
    if quantize and calibrate is None:
        raise ExplainError(f"device {dev.name} gives explain no calibration; explain it "
                           "without --quantize")
    step(f"building {spec}")
    model, args, kw = load_inputs(spec)
    step("capturing the aten graph (Dynamo + AOTAutograd)")
    graphs = capture(model, *args, **kw)
    # what the reports show as the graph's target: a device option named march, else the name
    march = getattr(opts.dev, "march", dev.name)
    out: dict[str, Any] = {"model": spec, "device": dev.name, "march": march, "graphs": []}
    threshold = min_region_macs(opts)
    rules = select_rules(target=dev.target, enable=opts.enable, disable=opts.disable,
                         only=opts.only)
    where = _cache_lookup(options or {}, opts)
    for gi, c in enumerate(graphs):
        gm = c.gm
        step(f"graph {gi}: rewriting {len(gm.graph.nodes)} nodes to fixpoint")
        rep = PassManager(rules, check=opts.check).run(gm)
        step(f"graph {gi}: partitioning")
        part = partition(gm, checked_capability(dev, opts), min_compute_macs=threshold)
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        total = sum(macs(n) for n in calls)
        regions = []
        for r in part.regions:
            rg = extract(gm, r)
            regions.append(
                {
                    "id": r.id,
                    "nodes": len(r.nodes),
                    "macs": r.macs,
                    "inputs": [f"{i.name}: {_desc(i)}" for i in rg.inputs],
                    "outputs": [f"{o.name}: {_desc(o)}" for o in rg.outputs],
                    "cache": where(rg),
                }
            )
        cpu: dict[str, list[str]] = defaultdict(list)
        for n, why in part.rejected.items():
            cpu[why].append(n.name)
        for r, why in part.dropped:
            cpu[f"region dropped: {why}"].extend(n.name for n in r.nodes)
        off = sum(len(r.nodes) for r in part.regions)
        out["graphs"].append(
            {
                "rewrites": rep.rewrites,
                "rule_ms": {k: v * 1e3 for k, v in rep.seconds.items()},
                "skips": rep.skip_reasons(),
                "call_nodes": len(calls),
                "offloaded_nodes": off,
                "macs": total,
                "offloaded_macs": sum(r.macs for r in part.regions),
                "regions": regions,
                "cpu": dict(cpu),
                "min_compute_macs": threshold,
                "_gm": gm,
                "_part": part,
            }
        )
    if quantize:
        assert calibrate is not None  # checked above, before the model was built
        step(f"quantizing regions ({quantize}) and calibrating on the example input")
        out["quantize"] = quantize_regions(model, args, kw, quantize, dev.name,
                                           {**(options or {}), "min_compute_macs": threshold},
                                           calibrate)
        out["quantize_config"] = quantize
    return out


def quantize_regions(
    model: Any, args: tuple, kw: dict[str, Any], config: str, device: str,
    options: dict[str, Any], calibrate: Calibrate,
) -> list[dict[str, Any]]:
    """Compile for ``device`` with ``options`` and ``quantize=config``, calibrate on the
    example input with ``calibrate``, and return per region where Q/DQ went, what stayed float
    and the accuracy against the float region."""
    opts = {**options, "quantize": config, "cache": False}
    fn = torch.compile(model, backend=f"fxpass_{device}", dynamic=False, options=opts)
    out = []
    for i in calibrate(lambda a, k: fn(*a, **k), [(args, kw)]):
        s = i.summary
        out.append(
            {
                "region": i.region,
                "config": i.config,
                "state": i.state,
                "cosine": i.cosine,
                "max_abs_error": i.max_abs_error,
                "qdq_on": s.get("quantized", {}),
                "qdq_nodes": s.get("quantized_nodes", []),
                "q_dtype": s.get("q_nodes", {}),
                "quantized_weights": s.get("quantized_weights", 0),
                "float": s.get("float", {}),
                "host_integer_kernels": s.get("host_integer_kernels", {}),
            }
        )
    return out


def _render_quant(q: list[dict[str, Any]], config: str) -> list[str]:
    lines = [f"quantize {config}, calibrated on the example input (accuracy vs the float region):"]
    for r in q:
        if r["cosine"] is None:
            lines.append(f"  {r['region']}: {r['state']}")
            continue
        on = ", ".join(f"{k} x{v}" for k, v in sorted(r["qdq_on"].items())) or "nothing"
        dt = ", ".join(r["q_dtype"]) or "-"
        names = ", ".join(r["qdq_nodes"][:6]) + (" ..." if len(r["qdq_nodes"]) > 6 else "")
        fl = ", ".join(f"{k} x{v}" for k, v in sorted(r["float"].items(), key=lambda kv: -kv[1]))
        ik = ", ".join(f"{k} x{v}" for k, v in r["host_integer_kernels"].items()) or "none"
        lines += [
            f"  {r['region']}: cosine {r['cosine']:.6f}, max abs error {r['max_abs_error']:.3g}",
            f"    Q/DQ ({dt}) on the inputs of {on}; "
            f"{r['quantized_weights']} int8 per-channel weight(s)",
            f"    quantized: {names}",
            f"    stayed float: {fl or '-'}",
            f"    host integer kernels (onnxruntime): {ik}",
        ]
    return lines


def _cache_lookup(options: dict[str, Any], opts: Any) -> Any:
    """``rg -> where a compile would take it from`` (local hit, remote hit, remote refused
    with the reason, or compiled; ``remote.locate``), or "" for each region when the user's
    options turn the cache off. Read-only: explain compiles and stores nothing."""
    if not options.get("cache", True):
        return lambda rg: ""
    from fxpass.jit.backend import region_cache_key
    from fxpass.jit.cache import ArtifactCache
    from fxpass.jit.remote import locate

    cache = ArtifactCache(options.get("cache_dir"), remote=options.get("remote_cache"))
    return lambda rg: locate(cache, region_cache_key(rg, opts))


def _desc(n: Any) -> str:
    v = n.meta.get("val")
    return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}" if hasattr(v, "shape") else "?"


def render(info: dict[str, Any]) -> str:
    where = info["device"] + (f" ({info['march']})" if info["march"] != info["device"] else "")
    lines = [f"{info['model']} on {where}: {len(info['graphs'])} graph(s)"]
    for gi, g in enumerate(info["graphs"]):
        share_n = g["offloaded_nodes"] / max(1, g["call_nodes"])
        share_m = g["offloaded_macs"] / max(1, g["macs"])
        lines.append(
            f"graph {gi}: {g['call_nodes']} call nodes, {g['macs'] / 1e6:.2f} MMACs; "
            f"offloaded {share_n:.0%} of nodes, {share_m:.0%} of MACs in "
            f"{len(g['regions'])} region(s) (min_compute_macs={g['min_compute_macs']})"
        )
        lines.append(
            "  rewrites: " + (", ".join(f"{k} x{v}" for k, v in g["rewrites"].items()) or "none")
        )
        for r in g["regions"]:
            lines.append(f"  region {r['id']}: {r['nodes']} nodes, {r['macs'] / 1e6:.2f} MMACs"
                         + (f"; cache: {r['cache']}" if r.get("cache") else ""))
            lines.append(f"    in:  {', '.join(r['inputs']) or '-'}")
            lines.append(f"    out: {', '.join(r['outputs'])}")
        for why, names in sorted(g["cpu"].items(), key=lambda kv: -len(kv[1])):
            shown = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
            lines.append(f"  on CPU x{len(names)}: {why}: {shown}")
    if info.get("quantize") is not None:
        lines += _render_quant(info["quantize"], info["quantize_config"])
    return "\n".join(lines)


def svg(info: dict[str, Any], path: str) -> None:
    """A column per region (CPU nodes in the first), nodes in graph order, edges as lines."""
    palette = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1"]
    g = info["graphs"][0]
    gm, part = g["_gm"], g["_part"]
    owner = {n: r.id for r in part.regions for n in r.nodes}
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "placeholder", "output")]
    pos = {}
    w, h, row = 150, 16, 0
    for n in nodes:
        col = owner.get(n, -1) + 1
        pos[n] = (20 + col * (w + 40), 30 + row * (h + 4))
        row += 1
    width = 60 + (len(part.regions) + 1) * (w + 40)
    height = 60 + row * (h + 4)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="monospace" font-size="10">',
        '<text x="20" y="18">CPU</text>',
    ]
    for r in part.regions:
        out.append(
            f'<text x="{20 + (r.id + 1) * (w + 40)}" y="18">region {r.id} '
            f"({r.macs / 1e6:.1f} MMACs)</text>"
        )
    for n in nodes:
        for i in n.all_input_nodes:
            if i in pos:
                (x1, y1), (x2, y2) = pos[i], pos[n]
                out.append(
                    f'<line x1="{x1 + w / 2}" y1="{y1 + h}" x2="{x2 + w / 2}" y2="{y2}" '
                    'stroke="#999" stroke-width="0.5"/>'
                )
    for n in nodes:
        x, y = pos[n]
        fill = palette[owner[n] % len(palette)] if n in owner else "#dddddd"
        label = html.escape(f"{n.name} {str(n.target).replace('aten.', '')}"[:28])
        out.append(
            f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}" rx="3"/>'
            f'<text x="{x + 3}" y="{y + 11}">{label}</text>'
        )
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def main(args: argparse.Namespace, options: dict[str, Any] | None = None,
         calibrate: Calibrate | None = None) -> int:
    """``fxpass explain``: ``args.device`` names the device; ``options`` are the device's own,
    from the plugin that owns the command (``--march``); ``calibrate`` its calibration for
    ``--quantize``."""
    opts = dict(options or {})
    if args.min_compute_macs is not None:
        opts["min_compute_macs"] = args.min_compute_macs
    try:
        info = explain(
            args.model,
            args.device,
            opts,
            progress=not args.json,
            quantize=getattr(args, "quantize", None),
            calibrate=calibrate,
        )
    except ExplainError as e:
        print(f"fxpass explain: {e}", file=sys.stderr)
        return 2
    if args.svg:
        svg(info, args.svg)
    public = {
        **info,
        "graphs": [{k: v for k, v in g.items() if not k.startswith("_")} for g in info["graphs"]],
    }
    print(json.dumps(public, indent=2, default=str) if args.json else render(public))
    return 0
