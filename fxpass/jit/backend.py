"""``torch.compile(model, backend="fxpass_<device>")``: the whole pipeline behind one function.

Dynamo -> AOTAutograd (inference) -> the device target's rules to fixpoint -> convex partition
by the device's capability -> per region: extract, the device's compile, splice back as one
call -> a guarded callable. A device plugin registers ``backend_for(name)`` in the
``torch_dynamo_backends`` entry point group, so no import is needed. Options arrive as
``torch.compile(..., options={...})``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from operator import getitem
from typing import Any

import torch
from torch.fx import Graph, GraphModule

from fxpass import device as devices
from fxpass._capture import aot_backend, frame_writes_nothing
from fxpass.graph import is_static
from fxpass.hf.generation import warn_if_growing, warn_if_recompiling
from fxpass.jit import plan
from fxpass.jit.cache import ArtifactCache
from fxpass.jit.options import Options, from_options
from fxpass.jit.remote import STATS as REMOTE_STATS
from fxpass.jit.report import REPORTS, GraphReport, RegionReport
from fxpass.jit.runtime import RegionCall, TorchThreads
from fxpass.partition.cost import macs
from fxpass.partition.partition import partition
from fxpass.partition.region import extract, splice
from fxpass.passmanager import PassManager
from fxpass.plugins import load as load_plugins
from fxpass.plugins import select_rules

log = logging.getLogger("fxpass.jit")

#: fxpass.compile_reports() keeps the most recent reports only (each holds a rewrite ledger).
MAX_REPORTS = 256
#: graph numbers in reports and region names (g3_r0): one per compile in this process, never
#: reused (they were the report count, which stops at MAX_REPORTS)
_GRAPH_IDS = itertools.count()
_WARNED: set[str] = set()
#: What the backend did in this process: "rules" (pass-manager runs), "partition", "plan_hit",
#: "plan_miss", "plan_stored", "parallel_compiles", "region_compiles", "variants" (a graph
#: compiled again for another instance's weights), "unfrozen_buffers" (frozen buffers found
#: written). Tests assert on it (never on timings). ``CACHE_STATS`` (``remote.STATS``) beside
#: it counts where each region came from (local hit, remote hit, compiled) and the remote
#: tier's hits, refusals, publications, errors and compile-lock waits.
STATS: Counter[str] = Counter()
CACHE_STATS = REMOTE_STATS


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, stacklevel=3)


MODES = {
    None: "",
    "default": "",
    "reduce-overhead": "no CUDA graphs; regions already run as single calls",
    "max-autotune": "no autotuning; the device's compiler chooses its kernels itself",
    "max-autotune-no-cudagraphs": "no autotuning",
}


def backend_for(device: str) -> Callable:
    """The Dynamo backend of device ``device`` (``backend=f"fxpass_{device}"``): what a device
    plugin registers in the ``torch_dynamo_backends`` entry point group."""

    def backend(gm: GraphModule, example_inputs: list, *, options: dict | None = None,
                mode: str | None = None) -> Callable:
        return compile_dynamo(gm, example_inputs, device, options=options, mode=mode)

    backend.__name__ = backend.__qualname__ = f"fxpass_{device}"
    backend.__doc__ = f"Dynamo backend entry point (``backend='fxpass_{device}'``)."
    return backend


def compile_dynamo(
    gm: GraphModule, example_inputs: list, device: str, *, options: dict | None = None,
    mode: str | None = None,
) -> Callable:
    """Compile Dynamo's graph ``gm`` for ``device``: options checked, AOTAutograd, then
    :func:`compile_graph` per static signature (``shapes``) and set of weights (``guarded``)."""
    opts = from_options(options, device)
    dev = opts.get_device()
    who = f"fxpass_{dev.name}"
    if mode not in MODES:
        raise TypeError(f"{who}: unknown mode {mode!r}; known: {[m for m in MODES if m]}")
    if MODES[mode]:
        log.info("%s: mode=%r accepted; %s", who, mode, MODES[mode])
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    ):
        msg = (
            f"{who} compiles inference graphs only; this graph needs gradients, so it "
            "runs eagerly (gradients stay correct). Wrap inference in torch.no_grad()."
        )
        if opts.strict:
            raise RuntimeError(msg + " (strict=True)")
        warnings.warn(msg, stacklevel=2)
        return gm.forward
    dev.prepare(opts.dev)  # a missing compiler raises here; a host runtime preloads
    return aot_backend(lambda aot_gm, real, frozen: runner(aot_gm, opts),
                       freeze=opts.freeze_weights)(gm, example_inputs)


def runner(aot_gm: GraphModule, opts: Options) -> Callable:
    """The callable behind one AOT graph whose weights are marked: one static variant per input
    signature when its sizes are symbolic, else one guarded graph (per set of weights)."""
    from fxpass.jit import shapes
    from fxpass.jit.guarded import GuardedGraph

    pure = frame_writes_nothing()

    def guarded(gm: GraphModule) -> GuardedGraph:
        g = GuardedGraph(gm, opts)
        g.pure = pure
        return g

    keyed, frame = shapes.specializable(aot_gm), shapes.frame_key(aot_gm)
    if keyed is not None:  # symbolic sizes: one static variant per input signature
        # at its first call it compiles the shapes the frame's earlier graphs served
        return shapes.ShapeVariants(aot_gm, keyed, opts, guarded, frame)
    run = guarded(aot_gm)
    shapes.remember(frame, shapes.tensor_shapes(
        p.meta.get("val") for p in aot_gm.graph.find_nodes(op="placeholder")))
    return run


def _clone(gm: GraphModule) -> GraphModule:
    g = Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return GraphModule(gm, g)


def compile_graph(gm: GraphModule, opts: Options) -> tuple[Callable, GraphReport]:
    """Rules -> partition -> compile regions -> splice. Returns the callable and its report."""
    t0 = time.perf_counter()
    device = opts.get_device()
    who = f"fxpass_{device.name}"
    kind = device.label(opts.dev)
    report = GraphReport(graph=next(_GRAPH_IDS), march=getattr(opts.dev, "march", device.name),
                         executor=kind, device=device.name)
    # a symbolic int input (a cache counter) is host-side index arithmetic; a symbolic tensor
    # shape is what the BPU cannot take
    if not all(
        is_static(v)
        for p in gm.graph.find_nodes(op="placeholder")
        if isinstance(v := p.meta.get("val"), torch.Tensor)
    ):
        note = (
            f"symbolic shapes: device {device.name} takes static shapes, so those nodes stay "
            "on the CPU; compile with torch.compile(..., dynamic=False)"
        )
        report.notes.append(note)
        warnings.warn(f"{who}: {note}", stacklevel=2)
    for note in (warn_if_growing(gm), warn_if_recompiling()):
        if note:
            report.notes.append(note)
    rules = select_rules(
        target=device.target, enable=opts.enable, disable=opts.disable, only=opts.only
    )
    # a plugin that failed to load took its rules with it: never only a warning on stderr
    if failed := "; ".join(f"{s}: {e}" for s, e in load_plugins().failures):
        if opts.strict:
            raise RuntimeError(f"{who}: plugin(s) failed to load, their rules are missing: "
                               f"{failed} (strict=True; FXPASS_BLOCK_PLUGINS=name skips one)")
        report.notes.append(f"plugin(s) failed to load, their rules are missing: {failed}")
    cache = ArtifactCache(opts.cache_dir, remote=opts.remote_cache) if opts.cache else None
    min_macs = min_region_macs(opts)
    pkey = plan.key_for(gm, opts, rules, device, cache)
    if pkey is not None:
        out = plan.apply(
            cache, pkey, opts, report, functools.partial(_region_eager, gm, opts), gm
        )
        if out is not None:
            STATS["plan_hit"] += 1
            return _finish(out, report, t0, min_macs, opts), report
        STATS["plan_miss"] += 1
    STATS["rules"] += 1
    rr = PassManager(rules, check=opts.check).run(gm, recompile=False)
    report.rules, report.rewrites = rr, dict(rr.rewrites)
    STATS["partition"] += 1
    part = partition(gm, checked_capability(device, opts), min_compute_macs=min_macs)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not getitem]
    report.call_nodes = len(calls)
    report.macs = sum(macs(n) for n in calls)
    report.cpu_reasons = dict(Counter(part.rejected.values()))
    report.dropped = [f"{len(r.nodes)} nodes: {why}" for r, why in part.dropped]
    spliced, entries = [], []
    for r, name, rg, c, call, err in _compile_regions(
        gm, part.regions, report.graph, opts, cache
    ):
        if err is not None:  # a region that cannot compile stays eager
            if opts.strict:
                raise RuntimeError(f"{who}: region {name} failed to compile: {err}") from err
            fallback = f"{type(err).__name__}: {err}"
            warnings.warn(
                f"{who}: region {name} failed to compile and runs eagerly: {fallback}",
                stacklevel=2,
            )
            report.regions.append(
                RegionReport(name, len(r.nodes), r.macs, 0, 0, "eager", False, fallback)
            )
            continue  # its nodes stay in the graph and run in PyTorch
        entries.append(plan.region_entry(f"device_region_{len(spliced)}", r.id, name, c, rg, r))
        spliced.append((rg, call))
        report.regions.append(
            RegionReport(
                name,
                len(r.nodes),
                r.macs,
                len(rg.inputs),
                len(rg.outputs),
                kind,
                c.cached,
                fusions=c.fusions,
                quant=getattr(c.executor, "info", None),
                source=cache.record(c.key, c.cached) if cache is not None else "",
                executor_ref=c.executor,
            )
        )
        report.offloaded_call_nodes += sum(1 for n in r.nodes if n.target is not getitem)
        report.offloaded_macs += r.macs
    out = splice(gm, spliced) if spliced else gm
    out.graph.eliminate_dead_code()
    if pkey is not None and len(entries) == len(part.regions):  # no region fell back
        STATS["plan_stored"] += plan.store(cache, pkey, out, entries, plan.report_fields(report))
    out.recompile()
    return _finish(out, report, t0, min_macs, opts), report


#: a graph whose CPU ops hold at most this share of its MACs runs them on one torch thread
CPU_LIGHT_SHARE = 0.05


def _cpu_threads(report: GraphReport, opts: Options) -> int | None:
    """Threads for the graph's torch ops (``runtime.TorchThreads``), or None for torch's own
    setting: the option when set; else one when some region runs on onnxruntime and the CPU's
    share of the graph's MACs is light (an embedding and index arithmetic are no MACs)."""
    if opts.cpu_threads is not None:
        return opts.cpu_threads
    host = opts.get_device().runs_on_host(opts.dev) and any(
        r.fallback is None for r in report.regions)
    cpu_macs = report.macs - report.offloaded_macs
    return 1 if host and cpu_macs <= CPU_LIGHT_SHARE * report.macs else None


def _finish(
    out: GraphModule, report: GraphReport, t0: float, min_macs: int, opts: Options
) -> Callable:
    threads = _cpu_threads(report, opts)
    if threads is not None:
        report.notes.append(f"the graph's torch ops run on {threads} thread(s) (cpu_threads)")
        out = TorchThreads(out, threads)
    report.compile_seconds = time.perf_counter() - t0
    if (report.macs >= max(min_macs, 1)
            and not report.offloaded_macs and report.cpu_reasons):
        # worth offloading, yet nothing was: say why once (a float64 model, say), rather than
        # leave the user to find an all-CPU graph in a report they may never print
        top = sorted(report.cpu_reasons.items(), key=lambda kv: -kv[1])[:2]
        why = "; ".join(f"{k} (x{v})" for k, v in top)
        _warn_once(f"nothing:{top[0][0]}", (
            f"fxpass_{opts.device}: graph {report.graph} runs entirely on the CPU "
            f"({report.macs / 1e6:.1f} MMACs, "
            f"none offloaded): {why}. fxpass.compile_reports() has the full report"))
    REPORTS.append(report)
    del REPORTS[:-MAX_REPORTS]  # a server compiling many graphs must not grow without bound
    log.info(report.summary())
    return out


def _compile_regions(
    gm: GraphModule, regions: list, graph: int, opts: Options, cache: Any
) -> list[tuple]:
    """Extract each region (in order: it reads the shared graph), then compile them in a thread
    pool bounded by the CPU count: session creation, shape inference, hashing and a device's
    compiler release the GIL. Returns (region, name, RegionGraph, Compiled, RegionCall, error)
    per region, in region order; a failure is returned, not raised, so each region keeps its
    own fallback (or strict error) exactly as when compiled one by one."""
    jobs = []
    for r in regions:
        name = f"g{graph}_r{r.id}"
        try:
            jobs.append((r, name, extract(gm, r), None))
        except Exception as e:  # noqa: BLE001 - reported per region by the caller
            jobs.append((r, name, None, e))

    def build(job: tuple) -> tuple:
        r, name, rg, err = job
        if err is not None:
            return (r, name, rg, None, None, err)
        STATS["region_compiles"] += 1
        try:
            c = compile_region(rg, name, opts, cache)
            inputs = [p.meta["val"] for p in rg.gm.graph.find_nodes(op="placeholder")]
            call = RegionCall(name, c.executor, rg.gm, inputs, strict=opts.strict,
                              device=opts.device)
            call.compiled = c  # export() reads the region's key and artifact from here
        except Exception as e:  # noqa: BLE001 - reported per region by the caller
            return (r, name, rg, None, None, e)
        return (r, name, rg, c, call, None)

    workers = min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        return [build(j) for j in jobs]
    STATS["parallel_compiles"] += 1
    with ThreadPoolExecutor(workers, thread_name_prefix="fxpass-region") as pool:
        return list(pool.map(build, jobs))


def _region_eager(gm: GraphModule, opts: Options, rid: int) -> GraphModule:
    """Region ``rid``'s eager graph, rebuilt from the captured graph (a plan hit has none):
    the same rules and partition as the cold compile, on a copy."""
    g = _clone(gm)
    device = opts.get_device()
    rules = select_rules(
        target=device.target, enable=opts.enable, disable=opts.disable, only=opts.only
    )
    STATS["rules"] += 1
    PassManager(rules, check=False).run(g, recompile=False)
    part = partition(g, checked_capability(device, opts),
                     min_compute_macs=min_region_macs(opts))
    for r in part.regions:
        if r.id == rid:
            return extract(g, r).gm
    raise RuntimeError(f"fxpass_{device.name}: region {rid} is not in the rebuilt partition")


def min_region_macs(opts: Options) -> int:
    """The user's ``min_compute_macs``, else the device's own threshold."""
    if opts.min_compute_macs is not None:
        return opts.min_compute_macs
    return opts.get_device().min_region_macs(opts.dev)


def checked_capability(device: devices.Device, opts: Options) -> Callable[[Any], str | None]:
    """The device's capability, held to the contract: a reason is a string or None, and an
    exception names the device and the node instead of surfacing from the partitioner."""
    cap = device.capability(opts.dev)

    def reason(node: Any) -> str | None:
        try:
            why = cap(node)
        except Exception as e:  # noqa: BLE001 - re-raised naming the device
            raise devices.DeviceError(
                f"device {device.name} ({device.plugin}): its capability raised on node "
                f"{node.name} ({node.target}): {type(e).__name__}: {e}") from e
        if why is not None and not isinstance(why, str):
            raise devices.DeviceError(
                f"device {device.name} ({device.plugin}): its capability returned "
                f"{why!r:.60} for node {node.name}; want a reason string or None")
        return why

    return reason


def region_cache_key(rg: Any, opts: Options) -> str:
    """A region's artifact key: its graph, arguments, weights, options, the device's identity
    (``explain`` looks it up in the caches with it)."""
    from fxpass.jit.cache import region_key

    device = opts.get_device()
    return region_key(rg.gm, device=device.identity(opts.dev), options=opts.region_keyed(),
                      host=device.runs_on_host(opts.dev))


def compile_region(rg: Any, name: str, opts: Options, cache: Any) -> Any:
    """One extracted region through the device: keyed by the framework (graph, arguments,
    weights, options, rules, the device's identity), compiled by the device."""
    device = opts.get_device()
    key = region_cache_key(rg, opts)
    names = [p.name for p in rg.gm.graph.find_nodes(op="placeholder")]
    region = devices.Region(rg.gm, name, key, names, dict(rg.sources))
    ctx = devices.Context(opts, opts.dev, None if opts.exporting else cache, opts.exporting)
    # with a remote tier, one process of a fleet compiles the region; the others wait for it
    with cache.compiling(key) if ctx.cache is not None else contextlib.nullcontext():
        c = device.compile(region, ctx)
    if not isinstance(c, devices.Artifact) or not callable(c.executor):
        raise devices.DeviceError(f"device {device.name}: compile() returned {c!r:.80}; want "
                                  "an fxpass.device.Artifact with a callable executor")
    if not c.key:
        c.key = key
    return c
