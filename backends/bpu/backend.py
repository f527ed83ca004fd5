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
from pathlib import Path
from typing import Any

import torch
from torch.fx import Graph, GraphModule

from fxpass._capture import SOURCE, aot_backend
from fxpass.backends.bpu import plan
from fxpass.backends.bpu.cache import ArtifactCache
from fxpass.backends.bpu.compile import EXECUTORS, compile_region, resolve_executor
from fxpass.backends.bpu.device.capability import DEFAULT_MARCH, MARCHES, Capability, march
from fxpass.backends.bpu.device.cost import macs
from fxpass.backends.bpu.device.partition import partition
from fxpass.backends.bpu.device.region import extract, splice
from fxpass.backends.bpu.hf.generation import warn_if_growing, warn_if_recompiling
from fxpass.backends.bpu.report import REPORTS, GraphReport, RegionReport
from fxpass.backends.bpu.runtime import RegionCall, RegionFallbackWarning, TorchThreads
from fxpass.graph import FROZEN, FROZEN_BUFFER, is_static
from fxpass.passmanager import ContractError, FixpointError, PassManager
from fxpass.plugins import select_rules
from fxpass.rewriter import RuleError

log = logging.getLogger("fxpass.bpu")

#: Board: the original pull request measured ~0.8 ms per BPU submission; 100M MACs keeps a
#: region well above that. Host: ``python -m benchmarks.probes.ort_overhead`` measured 4.4 us per
#: onnxruntime call and 113 GMAC/s on this 2-core machine: break-even ~0.5M MACs.
DEFAULT_MIN_MACS = {"hbdnn": 100_000_000, "onnxruntime": 500_000}
#: Rebuilds after the weights of one instance changed (written in place, or a few replaced);
#: past this the graph runs eagerly.
MAX_REBUILDS = 2
#: Compiled variants a graph keeps by default, one per set of weights (least recently used
#: evicted; option ``max_variants``). Instances of one module class share Dynamo's graph
#: (parameters are graph inputs): two copies of a model alternating, or every layer of a
#: model whose layers have a graph break inside (Dynamo then compiles one graph for the
#: piece, and each layer calls it with its own weights). Each set is compiled once.
MAX_VARIANTS = 64
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


#: set in the options by ``export()`` only (not a user option): every region must stand alone,
#: compiled with its artifact kept (``compile_region(keep=True)``), no cache and no tiers
EXPORTING = "_exporting"


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"fxpass_bpu: {msg}", stacklevel=3)


OPTIONS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "march": (str, f"target march, one of {sorted(MARCHES)} (default {DEFAULT_MARCH})"),
    "executor": (str, f"one of {EXECUTORS} (default auto)"),
    "min_compute_macs": ((int, type(None)), "regions below this many MACs stay on the CPU"),
    "strict": (bool, "raise instead of falling back to eager"),
    "cache_dir": ((str, Path, type(None)), "artifact cache directory"),
    "cache": (bool, "use the artifact cache (default True)"),
    "enable": ((list, tuple), "extra rule names to enable"),
    "disable": ((list, tuple), "rule names to disable"),
    "only": ((list, tuple), "run exactly these rules (instead of the bpu target's)"),
    "check": (bool, "run rule contract checks while compiling"),
    "threads": ((int, type(None)), "onnxruntime intra-op threads"),
    "cpu_threads": (
        (int, type(None)),
        "threads for the graph's own torch (CPU) ops; default None: one when the graph has "
        "host regions and its CPU share of MACs is light (torch's OpenMP workers would "
        "otherwise spin through the regions on onnxruntime's cores), else torch's setting",
    ),
    "host_fusions": (bool, "onnxscript's onnxruntime fusions on host regions (default True)"),
    "tiered": (
        bool,
        "host regions that prepack large weights run an in-place-weights session until the "
        "prepacked one is built in the background (default True); False builds it first",
    ),
    "prepack_one_row": (
        bool,
        "host regions that multiply one row per GEMM (a decode step, a 1-token forward) "
        "prepack their weights too (default True: ~1.2x faster, a packed copy of the weights "
        "per region); False reads them in place and holds no copy",
    ),
    "quantize": (
        (str, dict, bool, type(None)),
        "quantize regions: 'w8a16' (int8 per-channel weights, int16 activations), 'w8a8', "
        "True (w8a16) or {'config', 'method', 'percentile'}; calibrate with "
        "fxpass.backends.bpu.calibrate(fn, batches) (default None on the host; the board "
        "always quantizes)",
    ),
    "max_shape_variants": (
        int,
        "static variants one symbolic graph keeps, one per input signature (default 8; least "
        "recently used evicted with its sessions; a new shape past it still compiles)",
    ),
    "max_variants": (
        int,
        f"sets of weights one graph is compiled for and keeps (default {MAX_VARIANTS}): "
        "a graph shared by more instances of a module (a graph break inside each of more "
        "layers) runs eagerly",
    ),
    "freeze_weights": (
        bool,
        "bake weights into artifacts, guarded (default True); False "
        "passes them at every call: slower, but immune to writes via .data",
    ),
}
#: how an option's error message names the types it takes
_TYPE_NAMES = {bool: "a bool", str: "a string", Path: "a path", type(None): "None",
               int: "an int", list: "a list", tuple: "a list", dict: "a dict"}
MODES = {
    None: "",
    "default": "",
    "reduce-overhead": "fxpass_bpu has no CUDA graphs; regions already run as single calls",
    "max-autotune": "fxpass_bpu does not autotune; onnxruntime/hbdk4 choose kernels themselves",
    "max-autotune-no-cudagraphs": "fxpass_bpu does not autotune",
}


def validate_options(options: dict[str, Any] | None) -> dict[str, Any]:
    opts = dict(options or {})
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        valid = "; ".join(f"{k}: {d}" for k, (_, d) in OPTIONS.items())
        raise TypeError(f"fxpass_bpu got unknown option(s) {unknown}. Valid options: {valid}")
    for k, v in opts.items():
        types, desc = OPTIONS[k]
        allowed = types if isinstance(types, tuple) else (types,)
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in allowed):
            names = " or ".join(dict.fromkeys(_TYPE_NAMES.get(t, t.__name__) for t in allowed))
            hint = (f"; for one rule write [{v!r}]"
                    if isinstance(v, str) and list in allowed else "")
            raise TypeError(f"fxpass_bpu option {k!r} ({desc}) must be {names}; got "
                            f"{type(v).__name__} {v!r}{hint}")
    m = opts.setdefault("march", DEFAULT_MARCH)
    march(m)  # ValueError naming the known marches
    ex = opts.setdefault("executor", "auto")
    if ex not in EXECUTORS:
        raise TypeError(f"fxpass_bpu option 'executor' must be one of {EXECUTORS}, got {ex!r}")
    for key, chooser in (("threads", "onnxruntime"), ("cpu_threads", "fxpass")):
        th = opts.get(key)
        if th is not None and not 1 <= th <= (os.cpu_count() or 1):
            raise TypeError(
                f"fxpass_bpu option {key!r} must be between 1 and this machine's "
                f"{os.cpu_count()} CPUs, got {th}; leave it unset to let {chooser} choose"
            )
    if opts.get("min_compute_macs") is not None and opts["min_compute_macs"] < 0:
        raise TypeError("fxpass_bpu option 'min_compute_macs' must be >= 0")
    from fxpass.backends.bpu.shapes import MAX_SHAPE_VARIANTS

    if opts.setdefault("max_shape_variants", MAX_SHAPE_VARIANTS) < 1:
        raise TypeError("fxpass_bpu option 'max_shape_variants' must be >= 1, got "
                        f"{opts['max_shape_variants']}")
    if opts.setdefault("max_variants", MAX_VARIANTS) < 1:
        raise TypeError(
            f"fxpass_bpu option 'max_variants' must be >= 1, got {opts['max_variants']}"
        )
    opts.setdefault("strict", False)
    opts.setdefault("cache", True)
    if opts["cache"]:  # a bad cache_dir or FXPASS_CACHE_MAX_BYTES fails here, not per graph
        ArtifactCache(opts.get("cache_dir"))
    from fxpass import env

    # FXPASS_CHECK=1 asks for the checks as check=True does (read, and validated, here: the
    # backend passed check=False explicitly, so the variable did nothing; found by a probe)
    opts.setdefault("check", env.get("FXPASS_CHECK"))
    # every FXPASS_* variable, here: a bad one is bad configuration, an error naming it (a bad
    # FXPASS_REWRITE_LIMIT sent each graph to eager with a "please report it"; found by a probe)
    env.validate_all()
    opts.setdefault("freeze_weights", True)
    opts.setdefault("host_fusions", True)
    opts.setdefault("prepack_one_row", True)  # unset and True: one cache key
    from fxpass.backends.bpu.device.quantize import QuantizationError, resolve_config

    try:  # a bad quantize value fails here, not per region
        config = resolve_config(opts.get("quantize"))
    except QuantizationError as e:
        raise TypeError(f"fxpass_bpu option 'quantize': {e}") from None
    board = opts.get("executor") == "hbdnn"  # the board path always quantizes
    if (config is not None or board) and not opts["freeze_weights"]:
        # weights that are inputs would be calibrated as activations, once: after an update
        # the region kept the old ranges (found by a probe: cosine 0.89, no warning)
        raise TypeError(
            "fxpass_bpu quantization (option 'quantize', or executor='hbdnn', which always "
            "quantizes) needs freeze_weights=True: weights are quantized per "
            "channel when the region is built, and guarded; with freeze_weights=False they "
            "would be graph inputs quantized with calibrated activation ranges that a weight "
            "update silently outdates. Drop freeze_weights=False, or quantize=None")
    select_rules(
        target="bpu", enable=opts.get("enable"), disable=opts.get("disable"), only=opts.get("only")
    )
    return opts


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
    opts = validate_options(options)
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
        if opts["strict"]:
            raise RuntimeError(msg + " (strict=True)")
        warnings.warn(msg, stacklevel=2)
        return gm.forward
    if resolve_executor(opts["executor"]) == "onnxruntime":  # a missing hbdk4 raises here
        _preload_onnxruntime()

    def fw(aot_gm: GraphModule, real: list, frozen: list[bool]) -> Callable:
        from fxpass.backends.bpu.shapes import ShapeVariants, specializable

        keyed = specializable(aot_gm)
        if keyed is not None:  # symbolic sizes: one static variant per input signature
            return ShapeVariants(aot_gm, keyed, opts, lambda gm: GuardedGraph(gm, opts))
        return GuardedGraph(aot_gm, opts)

    return aot_backend(fw, freeze=opts["freeze_weights"])(gm, example_inputs)


def _clone(gm: GraphModule) -> GraphModule:
    g = Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return GraphModule(gm, g)


#: errors that check=True exists to raise (the graph-level eager fallback re-raises them)
CHECK_ERRORS = (ContractError, FixpointError)


class GuardedGraph:
    """The compiled graph plus a guard on frozen weights: a weight that changed (replaced or
    mutated in place) triggers a rebuild from the pristine graph, never a stale answer."""

    def __init__(self, aot_gm: GraphModule, opts: dict[str, Any]):
        self.pristine = _clone(aot_gm)
        self.opts = opts
        self._rebuilds: dict[tuple, int] = {}  # warned rebuilds per set of tensors
        self._buffer_writes: Counter[int] = Counter()
        self.evictions = 0
        self.eager_only = False
        #: weights signature -> (guard, compiled, report, the weights): holding the weights
        #: keeps their memory from being reused by other tensors under the same signature
        self.variants: dict[tuple, tuple[list, Callable, GraphReport, list]] = {}
        self.run = self._build(aot_gm)

    @staticmethod
    def _entry(k: int, t: torch.Tensor) -> tuple[int, int, int | None, tuple, torch.dtype]:
        """What the guard compares for weight input ``k``; inference-mode tensors have no
        version counter: pointer, shape and dtype only."""
        return (k, t.data_ptr(), None if t.is_inference() else t._version, tuple(t.shape),
                t.dtype)

    def _snapshot(self, gm: GraphModule) -> list[tuple[int, int, int | None, tuple, torch.dtype]]:
        snap = [
            self._entry(k, p.meta[FROZEN])
            for k, p in enumerate(gm.graph.find_nodes(op="placeholder"))
            if p.meta.get(FROZEN) is not None
        ]
        if any(v is None for _, _, v, _, _ in snap):
            _warn_once(
                "inference",
                "weights created under torch.inference_mode() have no version counter, so "
                "in-place writes to them after compile cannot be detected; create the model "
                "outside inference_mode (torch.no_grad() is enough), or compile with "
                "options={'freeze_weights': False}",
            )
        return snap

    def _build(self, gm: GraphModule) -> Callable:
        self.guard = self._snapshot(gm)
        try:
            compiled, report = compile_graph(gm, self.opts)
        except Exception as e:
            # strict, or check=True asking for rule-contract failures: they must surface
            if self.opts["strict"] or (self.opts.get("check") and isinstance(e, CHECK_ERRORS)):
                raise
            compiled, report = self._eager_fallback(e)
        self.report = report
        held = [p.meta[FROZEN] for p in gm.graph.find_nodes(op="placeholder") if FROZEN in p.meta]
        self.variants[tuple(self.guard)] = (self.guard, compiled, report, held)
        while len(self.variants) > self.opts["max_variants"]:
            del self.variants[next(iter(self.variants))]  # least recently used
        return compiled

    def _eager_fallback(self, e: Exception) -> tuple[Callable, GraphReport]:
        """A graph fxpass failed to compile runs as captured, with a warning and a report.

        Why: a backend exception ends the user's program (Dynamo re-raises it), while the
        captured graph is eager's answer. Each region already falls back this way on its own;
        this covers a failure before there are regions (an op the rules or the partitioner
        mishandle). ``strict=True`` raises instead."""
        why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if isinstance(e, RuleError):  # whose rule it is decides who fixes it
            from fxpass.plugins import load

            r = load().rules.get(e.rule)
            plugin = getattr(r, "plugin", "?")
            fix = (f"rule {e.rule!r} is plugin {plugin}'s: report it there, or skip it with "
                   f"options={{'disable': [{e.rule!r}]}}")
        else:
            fix = "please report it"
        msg = (
            f"fxpass_bpu: this graph failed to compile and runs eagerly ({why}); results stay "
            f"correct. Fix: {fix}; strict=True raises instead"
        )
        warnings.warn(msg, RegionFallbackWarning, stacklevel=3)
        report = GraphReport(
            graph=next(_GRAPH_IDS),
            march=str(self.opts.get("march") or DEFAULT_MARCH),
            executor=str(self.opts.get("executor") or "auto"),
        )
        report.notes.append(msg)
        REPORTS.append(report)
        del REPORTS[:-MAX_REPORTS]
        return self.pristine, report

    def __call__(self, *args: Any) -> Any:
        if self.eager_only:
            return self.pristine(*args)
        for k, ptr, ver, shape, dtype in self.guard:
            t = args[k]
            if (
                t.data_ptr() != ptr
                or (ver is not None and t._version != ver)
                or t.shape != shape
                or t.dtype != dtype
            ):
                return self._weights_changed(args)
        return self.run(*args)

    @property
    def rebuilds(self) -> int:
        """Warned rebuilds of this graph, over every set of tensors."""
        return sum(self._rebuilds.values())

    def _weights_changed(self, args: tuple) -> Any:
        """A call whose weights no compiled variant matches. Three cases, by what happened
        to the tensors the variants hold:

        - none of them was written in place: other tensors (another instance of the module,
          every layer of a model with a graph break inside its layers, or replaced
          parameters): a new variant (``_new_variant``), no warning;
        - buffers were written in place (``load_state_dict``, or state another graph of the
          model writes): the first time, compiled again with the new values; a buffer
          written again is state and becomes an ordinary input (``_unfreeze``);
        - parameters were written in place: compiled again with a warning, at most
          ``MAX_REBUILDS`` times per set of tensors (each layer of a graph-broken model
          counts on its own), then the graph runs eagerly."""
        self._check_traced_metadata(args)
        sig = tuple(self._entry(i, args[i]) for i, *_ in self.guard)
        hit = self.variants.pop(sig, None)
        if hit is not None:  # weights compiled for before (another instance of the model)
            self.variants[sig] = hit
            self.guard, self.run, self.report, _ = hit
            return self.run(*args)
        known: dict[tuple[int, int], set] = {}
        for v in self.variants:
            for i, ptr, ver, *_ in v:
                known.setdefault((i, ptr), set()).add(ver)
        written = [i for i, ptr, ver, *_ in sig
                   if (i, ptr) in known and ver is not None and ver not in known[(i, ptr)]]
        if not written:
            return self._new_variant(args)
        phs = self.pristine.graph.find_nodes(op="placeholder")
        buffers = [i for i in written if phs[i].meta.get(FROZEN_BUFFER)]
        for i in buffers:
            self._buffer_writes[i] += 1
        state = [i for i in buffers if self._buffer_writes[i] >= 2]
        if state:
            return self._unfreeze(state, args)
        self._drop_stale(sig)
        if len(buffers) == len(written):  # buffers only, written once: new values, frozen
            note = (f"buffer(s) {self._names(buffers)} written after compile: compiled again "
                    "with their new values (written again, they become inputs)")
            log.info("fxpass_bpu: %s", note)
            return self._rebuild(args, note)
        name = self._names([i for i in written if i not in buffers][:1])
        if self.opts["strict"]:
            raise RuntimeError(f"fxpass_bpu: weight {name} changed after compile (strict=True)")
        tensors = tuple((i, ptr) for i, ptr, *_ in sig)
        n = self._rebuilds.get(tensors, 0)
        if n >= MAX_REBUILDS:
            return self._give_up("weights keep changing; this graph now runs eagerly", args)
        self._rebuilds[tensors] = n + 1
        warnings.warn(
            f"fxpass_bpu: weight {name} changed after compile; recompiling "
            f"({n + 1}/{MAX_REBUILDS})",
            stacklevel=3,
        )
        return self._rebuild(args)

    def _check_traced_metadata(self, args: tuple) -> None:
        """Raise if a weight's dtype or shape is not the one this graph was traced for.

        Why: Dynamo's tensor guards recompile before such a call ever reaches the backend,
        unless they were filtered out (``options={"guard_filter_fn": ...}``, e.g.
        ``torch.compiler.skip_guard_on_all_nn_modules_unsafe``) or skipped
        (``set_stance(skip_guard_eval_unsafe=True)``). Rebuilding the traced graph over a
        ``model.double()`` then failed deep in a region with "expected scalar type Double"
        (found by a probe). No compiled or eager answer from this graph is right for it, so
        it is an error naming the cause and the fix."""
        phs = self.pristine.graph.find_nodes(op="placeholder")
        for k, *_ in self.guard:
            traced, t = phs[k].meta.get("val"), args[k]
            if not isinstance(traced, torch.Tensor) or not is_static(traced):
                continue
            if t.dtype != traced.dtype or tuple(t.shape) != tuple(traced.shape):
                raise RuntimeError(
                    f"fxpass_bpu: weight {self._names([k])} is now {t.dtype} "
                    f"{tuple(t.shape)}, but this graph was traced for {traced.dtype} "
                    f"{tuple(traced.shape)}, and Dynamo did not recompile: its guards on the "
                    "model were filtered out (a guard_filter_fn such as "
                    "torch.compiler.skip_guard_on_all_nn_modules_unsafe) or skipped "
                    "(torch.compiler.set_stance(skip_guard_eval_unsafe=True)). Fix: compile "
                    "again after changing the model's dtype or shapes, or keep Dynamo's "
                    "guards on it"
                )

    def _names(self, idx: list[int]) -> str:
        phs = self.pristine.graph.find_nodes(op="placeholder")
        return ", ".join(phs[i].meta.get(SOURCE) or phs[i].name for i in idx)

    def _drop_stale(self, sig: tuple) -> None:
        """Variants of these same tensors at older versions can never match again: drop them
        (and the session memory they hold) before building the new one."""
        ptrs = [(i, ptr) for i, ptr, *_ in sig]
        for old in [v for v in self.variants if [(i, ptr) for i, ptr, *_ in v] == ptrs]:
            del self.variants[old]

    def _unfreeze(self, written: list[int], args: tuple) -> Any:
        """Recompile with the written buffers as ordinary inputs, read at every call: once
        per buffer, without a warning or a count against the rebuild limit (they are state,
        and now never stale)."""
        phs = self.pristine.graph.find_nodes(op="placeholder")
        note = (f"buffer(s) {self._names(written)} written after compile again: now read at "
                "every call, not frozen")
        for i in written:
            del phs[i].meta[FROZEN], phs[i].meta[FROZEN_BUFFER]
        self.variants.clear()  # every variant froze them
        log.info("fxpass_bpu: %s", note)
        STATS["unfrozen_buffers"] += len(written)
        return self._rebuild(args, note)

    def _new_variant(self, args: tuple) -> Any:
        """Compile this graph for another instance's weights (a variant), keeping the others;
        past ``max_variants`` the least recently used one is evicted, and a graph that keeps
        evicting (more instances than variants, called in turn) runs eagerly."""
        cap = self.opts["max_variants"]
        if len(self.variants) >= cap:
            self.evictions += 1
            if self.evictions > MAX_REBUILDS:
                return self._give_up(
                    f"more than {cap} sets of weights call this graph in turn (a graph break "
                    "inside a layer repeated more times, or weights replaced on every call); "
                    "it now runs eagerly. Remove the graph break (torch.compile(..., "
                    "fullgraph=True) shows where) or raise options={'max_variants': N}",
                    args,
                )
        note = (f"variant {len(self.variants) + 1} of graph {self.report.graph}: compiled for "
                "another instance's weights (instances of one module share Dynamo's graph; "
                "replaced parameters are another set too)")
        log.info("fxpass_bpu: %s", note)
        STATS["variants"] += 1
        return self._rebuild(args, note)

    def _rebuild(self, args: tuple, note: str | None = None) -> Any:
        for p, t in zip(self.pristine.graph.find_nodes(op="placeholder"), args, strict=True):
            if FROZEN in p.meta:
                p.meta[FROZEN] = t.detach()
        self.run = self._build(_clone(self.pristine))
        if note:
            self.report.notes.append(note)
        return self.run(*args)

    def _give_up(self, why: str, args: tuple) -> Any:
        if self.opts["strict"]:
            raise RuntimeError(f"fxpass_bpu: {why} (strict=True raises instead)")
        warnings.warn(f"fxpass_bpu: {why}", stacklevel=4)
        self.eager_only = True
        self.variants.clear()  # never used again: release their sessions and weights
        return self.pristine(*args)


def compile_graph(gm: GraphModule, opts: dict[str, Any]) -> tuple[Callable, GraphReport]:
    """Rules -> partition -> compile regions -> splice. Returns the callable and its report."""
    t0 = time.perf_counter()
    m = march(opts["march"])
    kind = resolve_executor(opts["executor"])
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
        target="bpu", enable=opts.get("enable"), disable=opts.get("disable"), only=opts.get("only")
    )
    cache = ArtifactCache(opts.get("cache_dir")) if opts["cache"] else None
    min_macs = opts.get("min_compute_macs")
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
    rr = PassManager(rules, check=opts["check"]).run(gm, recompile=False)
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
            if opts["strict"]:
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


def _cpu_threads(report: GraphReport, opts: dict[str, Any]) -> int | None:
    """Threads for the graph's torch ops (``runtime.TorchThreads``), or None for torch's own
    setting: the option when set; else one when some region runs on onnxruntime and the CPU's
    share of the graph's MACs is light (an embedding and index arithmetic are no MACs)."""
    if opts.get("cpu_threads") is not None:
        return opts["cpu_threads"]
    host = any(r.executor == "onnxruntime" and r.fallback is None for r in report.regions)
    cpu_macs = report.macs - report.offloaded_macs
    return 1 if host and cpu_macs <= CPU_LIGHT_SHARE * report.macs else None


def _finish(
    out: GraphModule, report: GraphReport, t0: float, min_macs: int, opts: dict[str, Any]
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


def _region_options(opts: dict[str, Any]) -> dict[str, Any]:
    """The options that shape a region's artifact (part of its cache key)."""
    keys = ("enable", "disable", "only", "host_fusions", "quantize", "prepack_one_row")
    return {k: opts.get(k) for k in keys}


def _compile_regions(
    gm: GraphModule, regions: list, graph: int, m: Any, kind: str, opts: dict, cache: Any
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
                options=_region_options(opts),
                threads=opts.get("threads"),
                tiered=opts.get("tiered", True),
                keep=opts.get(EXPORTING, False),
            )
            inputs = [p.meta["val"] for p in rg.gm.graph.find_nodes(op="placeholder")]
            call = RegionCall(name, c.executor, rg.gm, inputs, strict=opts["strict"])
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


def _region_eager(gm: GraphModule, opts: dict[str, Any], rid: int) -> GraphModule:
    """Region ``rid``'s eager graph, rebuilt from the captured graph (a plan hit has none):
    the same rules and partition as the cold compile, on a copy."""
    g = _clone(gm)
    rules = select_rules(
        target="bpu", enable=opts.get("enable"), disable=opts.get("disable"), only=opts.get("only")
    )
    STATS["rules"] += 1
    PassManager(rules, check=False).run(g, recompile=False)
    kind = resolve_executor(opts["executor"])
    min_macs = opts.get("min_compute_macs")
    min_macs = DEFAULT_MIN_MACS[kind] if min_macs is None else min_macs
    part = partition(g, Capability(march(opts["march"])), min_compute_macs=min_macs)
    for r in part.regions:
        if r.id == rid:
            return extract(g, r).gm
    raise RuntimeError(f"fxpass_bpu: region {rid} is not in the rebuilt partition")
