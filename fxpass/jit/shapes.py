"""Symbolic graphs: one Dynamo trace, a bounded set of static variants, no recompile cliff.

Why: after a second input shape Dynamo hands the backend a graph with symbolic sizes (the
default ``dynamic=None``), and a static-shape device cannot take one. Asking the user for
``dynamic=False`` only moves the cliff: every new length is another Dynamo graph until
Dynamo's recompile limit, then eager. Instead the backend keeps the symbolic graph and
specializes it itself, per concrete input signature at call time: the symbolic aten graph
re-traced with the call's shapes (``make_fx`` over fake tensors: every size a constant),
then the usual rules, partition, regions and weight guard (``guarded.GuardedGraph``). Dynamo
compiles once.

Variants live in a bounded cache (option ``max_shape_variants``, default 8): the least
recently used is evicted with its sessions and memory, and a shape past the bound still gets
a compiled variant (evicting one), never a silent eager fallback. Each variant's report says
which shapes it is for, its compile time and the evictions so far.

A frame's graphs follow one another: Dynamo compiles the first shapes it sees as static graphs
and a later one as symbolic, and from then on it sends those first shapes to the newest graph
whose guards they pass. A symbolic graph therefore compiles up front the shapes its frame's
earlier graphs served and its guards admit (``ShapeVariants.prepare``): without that, the
second pass over a handful of shapes recompiled the first one (0.7-1.4 s, ELECTRA 4 x 512:
the second pass 4.7x the steady one, ``python -m benchmarks.second_pass``).

Only graphs whose symbolic ints are all sizes of their tensor inputs are specialized. A
symbolic int that is no tensor's size (a KV-cache counter that ``compile_for_generate`` makes
symbolic on purpose) is host-side index arithmetic: specializing on it would compile a
variant per token, so such graphs keep the static path. So do graphs that grow their state by
concatenation (HF's dynamic cache): a variant per token; the backend warns with the
static-cache fix (``generation.warn_if_growing``).
"""

from __future__ import annotations

import itertools
import linecache
import threading
import time
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule

from fxpass._capture import SOURCE
from fxpass.graph import FROZEN, FROZEN_BUFFER
from fxpass.jit.options import Options

#: every live ShapeVariants in this process (for tests and tools; held weakly)
INSTANCES: weakref.WeakSet = weakref.WeakSet()
#: per Dynamo frame, the tensor input shapes its graphs were compiled for, newest last
#: (``remember``; read by ``ShapeVariants.prepare``); bounded per frame and in frames
SEEN: OrderedDict[tuple, list[list[tuple[tuple[int, ...], torch.dtype]]]] = OrderedDict()
SEEN_PER_FRAME, SEEN_FRAMES = 16, 256

Shapes = list[tuple[tuple[int, ...], torch.dtype]]


def frame_key(gm: GraphModule) -> tuple | None:
    """Which frame ``gm`` is a graph of: Dynamo's frame id, its code object and the frozen
    weights it reads (two instances of one model share the code, not the weights; frame ids
    start again after ``torch._dynamo.reset()``). None outside a Dynamo compile
    (``torch.export``, a direct call)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._guards import CompileContext

        cid, tx = CompileContext.current_compile_id(), InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - private APIs: no frame, no ahead-of-time variants
        return None
    frame = getattr(cid, "frame_id", None) if cid is not None else None
    code = getattr(tx, "f_code", None)
    if frame is None or code is None:
        return None
    _CODES[id(code)] = code  # the id stays this code's while the key is kept
    weights = tuple(p.meta[FROZEN].data_ptr() for p in gm.graph.find_nodes(op="placeholder")
                    if isinstance(p.meta.get(FROZEN), torch.Tensor))[:8]
    return (frame, id(code), weights)


#: the code objects ``frame_key`` named, kept alive (a few hundred bytes each)
_CODES: dict[int, Any] = {}


def tensor_shapes(args: Any) -> Shapes:
    """The shapes and dtypes of the tensors among ``args`` (placeholder values or inputs)."""
    return [(tuple(int(d) for d in a.shape), a.dtype) for a in args
            if isinstance(a, torch.Tensor)]


def remember(frame: tuple | None, shapes: Shapes) -> None:
    """Record that a graph of ``frame`` was compiled for ``shapes``."""
    if frame is None:
        return
    seen = SEEN.pop(frame, [])
    if shapes in seen:
        seen.remove(shapes)
    seen.append(shapes)
    del seen[:-SEEN_PER_FRAME]
    SEEN[frame] = seen
    while len(SEEN) > SEEN_FRAMES:
        SEEN.popitem(last=False)
        live = {k[1] for k in SEEN}
        for c in [c for c in _CODES if c not in live]:
            del _CODES[c]


def concrete_args(gm: GraphModule, shapes: Shapes) -> list[Any] | None:
    """Inputs for symbolic ``gm`` at ``shapes`` (one per tensor placeholder, in order), or None
    when its guards do not admit them: every symbolic size solved from a plain dimension, each
    dimension and every guard of its shape environment (ranges included: Dynamo's 0/1
    specialization makes a size-1 dimension another graph's) holding. Frozen weights are
    their own tensors; other tensors are zeros (a variant compiles from shapes alone)."""
    phs = gm.graph.find_nodes(op="placeholder")
    vals = [p.meta.get("val") for p in phs]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    if len(tensors) != len(shapes):
        return None
    bind: dict[Any, int] = {}
    env = None
    for v, (shape, dtype) in zip(tensors, shapes, strict=True):
        if v.dtype != dtype or v.dim() != len(shape):
            return None
        for d, n in zip(v.shape, shape, strict=True):
            if isinstance(d, torch.SymInt):
                env, e = d.node.shape_env, d.node.expr
                if e.is_Symbol and bind.setdefault(e, n) != n:
                    return None
            elif d != n:
                return None
    if env is None:
        return None

    import sympy

    bind = {k: sympy.Integer(n) for k, n in bind.items()}

    def value(e: Any) -> int | None:
        got = sympy.sympify(e).xreplace(bind)
        return int(got) if got.is_number else None

    for v, (shape, _) in zip(tensors, shapes, strict=True):
        if any(isinstance(d, torch.SymInt) and value(d.node.expr) != n
               for d, n in zip(v.shape, shape, strict=True)):
            return None
    for sym, n in bind.items():
        r = env.var_to_range.get(sym)
        if r is not None and not (r.lower <= n <= r.upper):
            return None
    for g in env.guards:
        e = env.replace(g.expr)  # symbols Dynamo found equal to others, as those
        if e.free_symbols - set(bind) or e.xreplace(bind) is not sympy.true:
            return None
    args: list[Any] = []
    it = iter(shapes)
    for p, v in zip(phs, vals, strict=True):
        if isinstance(v, torch.Tensor):
            shape, dtype = next(it)
            args.append(p.meta[FROZEN] if FROZEN in p.meta else torch.zeros(shape, dtype=dtype))
        elif isinstance(v, torch.SymInt):
            n = value(v.node.expr)
            if n is None:
                return None
            args.append(n)
        else:
            args.append(v)
    return args


_BUILDING = threading.RLock()


def _symbols(v: Any) -> set[Any]:
    if isinstance(v, torch.SymInt):
        return set(v.node.expr.free_symbols)
    if isinstance(v, torch.Tensor):
        out: set[Any] = set()
        for s in (*v.shape, *v.stride()):
            if isinstance(s, torch.SymInt):
                out |= set(s.node.expr.free_symbols)
        return out
    return set()


def specializable(gm: GraphModule) -> list[int] | None:
    """The placeholder indices that key a variant, or None when ``gm`` is not a symbolic
    graph this module specializes: static, with a symbolic int that is no tensor's size, or
    one that returns state grown by concatenation (a dynamic KV cache: every token a new
    shape, so a variant per token; the backend warns with the static-cache fix instead)."""
    from fxpass.hf.generation import growing_state

    if growing_state(gm):
        return None
    phs = gm.graph.find_nodes(op="placeholder")
    vals = [p.meta.get("val") for p in phs]
    tensor_syms: set[Any] = set()
    for v in vals:
        if isinstance(v, torch.Tensor):
            tensor_syms |= _symbols(v)
    if not tensor_syms:
        return None
    for v in vals:
        if isinstance(v, torch.SymInt) and not _symbols(v) <= tensor_syms:
            return None
    return [i for i, v in enumerate(vals)
            if isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and _symbols(v))]


def signature(args: tuple, keyed: list[int]) -> tuple:
    """What a call's variant is keyed by: the symbolic inputs' shapes and dtypes (ints as is)."""
    out = []
    for i in keyed:
        a = args[i]
        out.append((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a)
    return tuple(out)


def specialize(gm: GraphModule, args: tuple) -> GraphModule:
    """``gm`` re-traced with the concrete shapes of ``args``: a static aten graph whose
    placeholders carry the symbolic graph's weight marks (frozen tensors, their sources)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import make_fx

    with unset_fake_temporarily(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a
                 for a in args]
        static = make_fx(gm, pre_dispatch=False)(*fakes)
    for old, new, a in zip(gm.graph.find_nodes(op="placeholder"),
                           static.graph.find_nodes(op="placeholder"), args, strict=True):
        if not isinstance(a, torch.Tensor):
            new.meta["val"] = a  # a size, now a constant of the graph
        for key in (FROZEN, FROZEN_BUFFER, SOURCE):
            if key in old.meta:
                new.meta[key] = old.meta[key]
    return static


def _torch_caches() -> tuple[dict, dict]:
    """torch's two process-wide, never-bounded caches that grow with every static graph this
    module traces: FakeTensor's dispatch cache (keyed by concrete sizes: ~120 entries, 170 KB
    per BERT 4 x 256 signature) and torch.fx's generated-source cache (every
    ``GraphModule.recompile()``: 7 sources, 70 KB per signature). An empty dict when this torch
    has neither (private names)."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake = FakeTensorMode.cache
    except (ImportError, AttributeError):
        fake = {}
    try:
        from torch.fx.graph_module import _loader

        sources = _loader.eval_cache
    except (ImportError, AttributeError):
        sources = {}
    return fake, sources


def _added(d: dict, before: int) -> list:
    """The keys inserted into ``d`` (insertion-ordered) since it held ``before`` entries."""
    return list(itertools.islice(reversed(d), max(len(d) - before, 0)))


def _reports(run: Any) -> list[Any]:
    """The compile reports a variant holds (``GuardedGraph``: its report and those of its
    weight variants), each once."""
    out = [getattr(run, "report", None)]
    out += [v[2] for v in getattr(run, "variants", {}).values()]  # (guard, compiled, report, _)
    return list({id(r): r for r in out if r is not None}.values())


def _describe(sig: tuple) -> str:
    return ", ".join(f"{list(s[0])}" if isinstance(s, tuple) else str(s) for s in sig)


#: calls of the recent window per kept variant (``ShapeVariants.window``)
WINDOW_PER_VARIANT = 4
#: calls in the window a shape past the bound needs before it may be compiled
ADMIT_MIN_CALLS = 4
#: windows' length of calls between two admissions past the bound
ADMIT_SPACING_WINDOWS = 2


class ShapeVariants:
    """A symbolic graph compiled per concrete input signature, at most ``max_shape_variants``.

    Past the bound a new shape must earn its compile: it replaces the kept variant called
    least in the recent window (``WINDOW_PER_VARIANT`` calls per variant; least recently used
    among equals) only if it was called more than twice as often there, at least
    ``ADMIT_MIN_CALLS`` times, and no other shape was admitted lately (``_admit``);
    otherwise it runs as captured, in PyTorch, with a warning (``strict=True`` raises).

    Why: evicting on every new shape (plain LRU) compiled on every call once the shapes in use
    outnumbered the bound (BERT, 16 lengths cycling through 8 variants: the warm pass took 53x
    eager's time). Now such a working set keeps the bound's worth compiled and the rest at
    eager's speed (0.94x eager's time in all, ``benchmarks.shapes``), and a shift in the
    shapes in use still moves the compiled ones over."""

    def __init__(self, gm: GraphModule, keyed: list[int], opts: Options,
                 build: Callable[[GraphModule], Any], frame: tuple | None = None):
        self.symbolic, self.keyed, self.opts, self._build = gm, keyed, opts, build
        self.frame = frame
        #: ``prepare`` runs at the first call: outside Dynamo's compile, whose fake mode the
        #: rules would otherwise mix with the specialization's
        self.pending = frame is not None
        self.variants: OrderedDict[tuple, Any] = OrderedDict()
        self.compiled: list[tuple[str, float]] = []  # (shapes, seconds) per compile, in order
        self.evictions = 0
        self.eager_calls = 0  # calls past the bound that ran as captured
        self._sources: dict[tuple, list[str]] = {}  # per variant: the fx sources it made
        #: the recent calls' signatures and how often each occurs among them
        self.window: deque[tuple] = deque(maxlen=WINDOW_PER_VARIANT * opts.max_shape_variants)
        self.recent: Counter[tuple] = Counter()
        self.calls = 0
        self._admitted_at = -(1 << 62)  # the call count at the last admission past the bound
        INSTANCES.add(self)

    def __call__(self, *args: Any) -> Any:
        if self.pending:
            self.pending = False
            self.prepare()
        sig = signature(args, self.keyed)
        self._count(sig)
        run = self.variants.get(sig)
        if run is None:
            if len(self.variants) >= self.opts.max_shape_variants and not self._admit(sig):
                return self._eager(sig, args)
            run = self._compile(sig, args)
        else:
            self.variants.move_to_end(sig)
        return run(*args)

    def _admit(self, sig: tuple) -> bool:
        """Whether a new shape past the bound is compiled (replacing a kept variant): called
        at least ``ADMIT_MIN_CALLS`` times in the window and more than twice as often as the
        least-called kept variant, and no other shape admitted within the last
        ``ADMIT_SPACING_WINDOWS`` windows' length of calls. Why the last two: with many shapes
        in random order a kept variant often falls out of the window (0 calls), and a shape
        seen once or twice would then replace it, a compile on a fifth of the calls. Simulated
        with 8 variants: 16 / 64 / 200 shapes in random order compile on 1.6% / 0.8% / 0.2% of
        calls, a cycle of 16 on none past the first 8, and a working set that moves to 8 new
        shapes is compiled over within about 500 calls."""
        n = self.recent[sig]
        if n < ADMIT_MIN_CALLS or n <= 2 * self.recent[self._victim()]:
            return False
        if self.calls - self._admitted_at < ADMIT_SPACING_WINDOWS * (self.window.maxlen or 1):
            return False
        self._admitted_at = self.calls
        return True

    def _count(self, sig: tuple) -> None:
        w = self.window
        self.calls += 1
        if len(w) == w.maxlen:
            old = w[0]
            if self.recent.get(old, 0) <= 1:  # (calls on several threads: never a KeyError)
                self.recent.pop(old, None)
            else:
                self.recent[old] -= 1
        w.append(sig)
        self.recent[sig] += 1

    def _victim(self) -> tuple:
        """The kept variant to give up: called least in the window, least recently used first."""
        return min(self.variants, key=self.recent.__getitem__)  # OrderedDict: LRU first

    def _eager(self, sig: tuple, args: tuple) -> Any:
        from fxpass.jit.backend import STATS, _warn_once

        cap = self.opts.max_shape_variants
        if self.opts.strict:
            raise RuntimeError(
                f"fxpass_{self.opts.device}: input shapes {_describe(sig)} would run eagerly: "
                f"more shapes are in use than max_shape_variants={cap} (strict=True; raise "
                "max_shape_variants, or pad inputs to a few lengths, docs/shapes.md)")
        self.eager_calls += 1
        STATS["shape_eager"] += 1
        _warn_once(f"shape-eager:{id(self)}", (
            f"fxpass_{self.opts.device}: a graph sees more input shapes than "
            f"max_shape_variants={cap}; a shape not called more than twice as often as a "
            f"kept one runs eagerly (first: {_describe(sig)}). Raise max_shape_variants, or "
            "pad inputs to a few lengths (docs/shapes.md)"))
        return self.symbolic(*args)

    def prepare(self) -> int:
        """Compile up front the shapes this graph's frame was compiled for before (by its
        earlier graphs) that this graph's guards admit: Dynamo sends them here from now on.
        Newest first, leaving room for one shape of its own under ``max_shape_variants``.
        Returns how many were compiled; one that fails is left for its call."""
        from fxpass.jit.backend import STATS

        done = 0
        for shapes in reversed(SEEN.get(self.frame, []) if self.frame is not None else []):
            if len(self.variants) + 1 >= self.opts.max_shape_variants:
                break
            args = concrete_args(self.symbolic, shapes)
            if args is None:
                continue
            sig = signature(tuple(args), self.keyed)
            if sig in self.variants:
                continue
            try:
                self._compile(sig, tuple(args), ahead=True)
            except Exception as e:  # noqa: BLE001 - its own call compiles it (and reports)
                self.variants.pop(sig, None)
                import logging

                logging.getLogger("fxpass.jit").info("shape %s not compiled ahead: %s",
                                                     _describe(sig), e)
                continue
            done += 1
            STATS["shape_variants_ahead"] += 1
        return done

    def _compile(self, sig: tuple, args: tuple, ahead: bool = False) -> Any:
        from fxpass.jit.backend import STATS

        fake, sources = _torch_caches()
        # one variant build at a time: what the caches gained meanwhile is this build's (a
        # compile on another thread outside variant builds can still add to them; it loses
        # at most a cache entry, or the source lines of its tracebacks)
        with _BUILDING:
            n_fake, n_sources = len(fake), len(sources)
            t0 = time.perf_counter()
            try:
                run = self._build(specialize(self.symbolic, args))
            finally:
                # FakeTensor's dispatch cache is keyed by this signature's concrete sizes:
                # only this same signature ever hits its entries again, and the cache is
                # process-wide and unbounded (~0.17 MB per distinct length, kept after the
                # eviction)
                for k in _added(fake, n_fake):
                    fake.pop(k, None)
            seconds = time.perf_counter() - t0
            self._sources[sig] = _added(sources, n_sources)  # released with the variant
        STATS["shape_variants"] += 1
        cap = self.opts.max_shape_variants
        evicted = False
        while len(self.variants) >= cap:
            victim = self._victim()
            self._release(victim, self.variants.pop(victim))  # its sessions go with it
            self.evictions += 1
            STATS["shape_evictions"] += 1
            evicted = True
        if evicted:  # hand the evicted sessions' memory back to the OS, not to malloc's pool
            import gc

            from fxpass.jit.runtime import _malloc_trim

            gc.collect()
            _malloc_trim()
        self.variants[sig] = run
        self.compiled.append((_describe(sig), seconds))
        remember(self.frame, tensor_shapes(args))
        report = getattr(run, "report", None)
        if report is not None:
            why = (" ahead of its first call (an earlier graph of this frame served them)"
                   if ahead else "")
            report.notes.append(
                f"shape variant {len(self.compiled)} of a symbolic graph, for input shapes "
                f"{_describe(sig)}: specialized and compiled in {seconds:.2f}s{why}; "
                f"{len(self.variants)} variant(s) kept (max_shape_variants={cap}), "
                f"{self.evictions} evicted so far")
        return run

    def _release(self, sig: tuple, run: Any) -> None:
        """What an evicted variant left outside itself: torch.fx's generated source of the graph
        modules its compile made (and their linecache entries), and the rewrite ledgers of its
        compile reports (``fxpass.compile_reports()`` keeps the last 256 reports, more than
        the distinct lengths of a whole benchmark; a ledger is ~30 KB of a report's ~33). The
        reports stay, with their summaries and a note. Without this each distinct shape kept
        ~0.27 MB after its eviction."""
        _, sources = _torch_caches()
        for k in self._sources.pop(sig, ()):
            sources.pop(k, None)
            linecache.cache.pop(k, None)
        for report in _reports(run):
            if report.rules is not None:
                report.rules = None
                report.notes.append("shape variant evicted: its rewrite ledger was released")
