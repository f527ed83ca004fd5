"""``torch.compile(model, backend="fxpass_bpu")``: the whole BPU pipeline behind one function.

Dynamo -> AOTAutograd (inference) -> the target's rules to fixpoint -> convex partition ->
per region: extract, lower to ONNX, compile (hbdk4 or onnxruntime), splice back as one call ->
a guarded callable. Registered in the ``torch_dynamo_backends`` entry point group, so no import
is needed. Options arrive as ``torch.compile(..., options={...})``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from operator import getitem
from typing import Any

import torch
from torch.fx import Graph, GraphModule

from fxpass._capture import aot_backend
from fxpass.backends.bpu.capability import Capability, march
from fxpass.backends.bpu.compile import compile_region, resolve_executor
from fxpass.graph import is_static
from fxpass.hf.generation import warn_if_growing, warn_if_recompiling
from fxpass.jit import plan
from fxpass.jit.cache import ArtifactCache
from fxpass.jit.options import Options, from_options
from fxpass.jit.report import REPORTS, GraphReport, RegionReport
from fxpass.jit.runtime import RegionCall, TorchThreads
from fxpass.partition.cost import macs
from fxpass.partition.partition import partition
from fxpass.partition.region import extract, splice
from fxpass.passmanager import PassManager
from fxpass.plugins import load as load_plugins
from fxpass.plugins import select_rules

log = logging.getLogger("fxpass.bpu")

#: Board: the original pull request measured ~0.8 ms per BPU submission; 100M MACs keeps a
#: region well above that. Host: ``python -m benchmarks.probes.ort_overhead`` measured 4.4 us per
#: onnxruntime call and 113 GMAC/s on this 2-core machine: break-even ~0.5M MACs.
DEFAULT_MIN_MACS = {"hbdnn": 100_000_000, "onnxruntime": 500_000}
#: fxpass.compile_reports() keeps the most recent reports only (each holds a rewrite ledger).
MAX_REPORTS = 256
#: graph numbers in reports and region names (g3_r0): one per compile in this process, never
#: reused (they were the report count, which stops at MAX_REPORTS)
_GRAPH_IDS = itertools.count()
_WARNED: set[str] = set()
#: What the backend did in this process: "rules" (pass-manager runs), "partition", "plan_hit",
#: "plan_miss", "plan_stored", "parallel_compiles", "region_compiles", "variants" (a graph
#: compiled again for another instance's weights), "unfrozen_buffers" (frozen buffers found
#: written). Tests assert on it (never on timings).
STATS: Counter[str] = Counter()


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"fxpass_bpu: {msg}", stacklevel=3)


MODES = {
    None: "",
    "default": "",
    "reduce-overhead": "fxpass_bpu has no CUDA graphs; regions already run as single calls",
    "max-autotune": "fxpass_bpu does not autotune; onnxruntime/hbdk4 choose kernels themselves",
    "max-autotune-no-cudagraphs": "fxpass_bpu does not autotune",
}


_PRELOAD: list[threading.Thread] = []


def _preload_onnxruntime() -> None:
    """Import onnxruntime on a background thread while AOTAutograd traces the graph.

    Why: the host path needs it (the artifact keys name its version, the regions run in it),
    and loading its native module took 0.03-0.3 s of the backend's own time in a fresh process
    (0.3 s after a Qwen3 trace: ``python -m benchmarks.compile_time --profile``), most of a warm
    plan hit. Loading it while the main thread traces uses the other core; the first import
    in the main thread then waits for this one (Python's import lock) or finds it done. A
    failure here is ignored: the real import raises it where it is needed."""
    if _PRELOAD or "onnxruntime" in sys.modules:
        return

    def load() -> None:
        with contextlib.suppress(Exception):
            import onnxruntime  # noqa: F401

    t = threading.Thread(target=load, name="fxpass-preload", daemon=True)
    _PRELOAD.append(t)
    t.start()


def fxpass_bpu(
    gm: GraphModule, example_inputs: list, *, options: dict | None = None, mode: str | None = None
) -> Callable:
    """Dynamo backend entry point (``backend="fxpass_bpu"``)."""
    opts = from_options(options)
    if mode not in MODES:
        raise TypeError(f"fxpass_bpu: unknown mode {mode!r}; known: {[m for m in MODES if m]}")
    if MODES[mode]:
        log.info("fxpass_bpu: mode=%r accepted; %s", mode, MODES[mode])
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    ):
        msg = (
            "fxpass_bpu compiles inference graphs only; this graph needs gradients, so it "
            "runs eagerly (gradients stay correct). Wrap inference in torch.no_grad()."
        )
        if opts.strict:
            raise RuntimeError(msg + " (strict=True)")
        warnings.warn(msg, stacklevel=2)
        return gm.forward
    if resolve_executor(opts.executor) == "onnxruntime":  # a missing hbdk4 raises here
        _preload_onnxruntime()

    def fw(aot_gm: GraphModule, real: list, frozen: list[bool]) -> Callable:
        from fxpass.jit.guarded import GuardedGraph
        from fxpass.jit.shapes import ShapeVariants, specializable

        keyed = specializable(aot_gm)
        if keyed is not None:  # symbolic sizes: one static variant per input signature
            return ShapeVariants(aot_gm, keyed, opts, lambda gm: GuardedGraph(gm, opts))
        return GuardedGraph(aot_gm, opts)

    return aot_backend(fw, freeze=opts.freeze_weights)(gm, example_inputs)


def _clone(gm: GraphModule) -> GraphModule:
    g = Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return GraphModule(gm, g)


def compile_graph(gm: GraphModule, opts: Options) -> tuple[Callable, GraphReport]:
    """Rules -> partition -> compile regions -> splice. Returns the callable and its report."""
    t0 = time.perf_counter()
    m = march(opts.march)
    kind = resolve_executor(opts.executor)
    report = GraphReport(graph=next(_GRAPH_IDS), march=m.name, executor=kind)
    # a symbolic int input (a cache counter) is host-side index arithmetic; a symbolic tensor
    # shape is what the BPU cannot take
    if not all(
        is_static(v)
        for p in gm.graph.find_nodes(op="placeholder")
        if isinstance(v := p.meta.get("val"), torch.Tensor)
    ):
        note = (
            "symbolic shapes: the BPU needs static shapes, so those nodes stay on the CPU; "
            "compile with torch.compile(..., dynamic=False)"
        )
        report.notes.append(note)
        warnings.warn(f"fxpass_bpu: {note}", stacklevel=2)
    for note in (warn_if_growing(gm), warn_if_recompiling()):
        if note:
            report.notes.append(note)
    rules = select_rules(
        target="bpu", enable=opts.enable, disable=opts.disable, only=opts.only
    )
    # a plugin that failed to load took its rules with it: never only a warning on stderr
    if failed := "; ".join(f"{s}: {e}" for s, e in load_plugins().failures):
        if opts.strict:
            raise RuntimeError(f"fxpass_bpu: plugin(s) failed to load, their rules are missing: "
                               f"{failed} (strict=True; FXPASS_BLOCK_PLUGINS=name skips one)")
        report.notes.append(f"plugin(s) failed to load, their rules are missing: {failed}")
    cache = ArtifactCache(opts.cache_dir) if opts.cache else None
    min_macs = opts.min_compute_macs
    if min_macs is None:
        min_macs = DEFAULT_MIN_MACS[kind]
    pkey = plan.key_for(gm, opts, rules, kind, cache)
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
    part = partition(gm, Capability(m), min_compute_macs=min_macs)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not getitem]
    report.call_nodes = len(calls)
    report.macs = sum(macs(n) for n in calls)
    report.cpu_reasons = dict(Counter(part.rejected.values()))
    report.dropped = [f"{len(r.nodes)} nodes: {why}" for r, why in part.dropped]
    spliced, entries = [], []
    for r, name, rg, c, call, err in _compile_regions(
        gm, part.regions, report.graph, m, kind, opts, cache
    ):
        if err is not None:  # a region that cannot compile stays eager
            if opts.strict:
                raise RuntimeError(f"fxpass_bpu: region {name} failed to compile: {err}") from err
            fallback = f"{type(err).__name__}: {err}"
            warnings.warn(
                f"fxpass_bpu: region {name} failed to compile and runs eagerly: {fallback}",
                stacklevel=2,
            )
            report.regions.append(
                RegionReport(name, len(r.nodes), r.macs, 0, 0, "eager", False, fallback)
            )
            continue  # its nodes stay in the graph and run in PyTorch
        entries.append(plan.region_entry(f"bpu_region_{len(spliced)}", r.id, name, c, rg, r))
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
    host = any(r.executor == "onnxruntime" and r.fallback is None for r in report.regions)
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
            f"graph {report.graph} runs entirely on the CPU ({report.macs / 1e6:.1f} MMACs, "
            f"none offloaded): {why}. fxpass.compile_reports() has the full report"))
    REPORTS.append(report)
    del REPORTS[:-MAX_REPORTS]  # a server compiling many graphs must not grow without bound
    log.info(report.summary())
    return out


def _compile_regions(
    gm: GraphModule, regions: list, graph: int, m: Any, kind: str, opts: Options, cache: Any
) -> list[tuple]:
    """Extract each region (in order: it reads the shared graph), then compile them in a thread
    pool bounded by the CPU count: ORT session creation, onnx shape inference, hashing and
    hbdk4 release the GIL. Returns (region, name, RegionGraph, Compiled, RegionCall, error)
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
            c = compile_region(
                rg,
                name,
                march=m.name,
                executor=kind,
                cache=cache,
                options=opts,
                threads=opts.threads,
                tiered=opts.tiered,
                keep=opts.exporting,
            )
            inputs = [p.meta["val"] for p in rg.gm.graph.find_nodes(op="placeholder")]
            call = RegionCall(name, c.executor, rg.gm, inputs, strict=opts.strict)
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
    rules = select_rules(
        target="bpu", enable=opts.enable, disable=opts.disable, only=opts.only
    )
    STATS["rules"] += 1
    PassManager(rules, check=False).run(g, recompile=False)
    kind = resolve_executor(opts.executor)
    min_macs = opts.min_compute_macs
    min_macs = DEFAULT_MIN_MACS[kind] if min_macs is None else min_macs
    part = partition(g, Capability(march(opts.march)), min_compute_macs=min_macs)
    for r in part.regions:
        if r.id == rid:
            return extract(g, r).gm
    raise RuntimeError(f"fxpass_bpu: region {rid} is not in the rebuilt partition")
