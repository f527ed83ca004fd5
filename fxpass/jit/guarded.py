"""A compiled graph behind a guard on its frozen weights.

Weights are baked into the regions' artifacts (``freeze_weights``), so a weight that changes
after compile (replaced, written in place, ``load_state_dict``) must never meet a stale
artifact: the guard notices and the graph is compiled again from the pristine capture, kept as
one variant per set of weights (another instance of the module), or, when weights keep
changing, run eagerly. Never a stale answer.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule

from fxpass._capture import SOURCE, version_of
from fxpass.graph import FROZEN, FROZEN_BUFFER, FROZEN_VERSION, is_static
from fxpass.jit import backend
from fxpass.jit.backend import (
    _GRAPH_IDS,
    STATS,
    _clone,
    _warn_once,
)
from fxpass.jit.held import HELD
from fxpass.jit.options import Options
from fxpass.jit.report import REPORTS, GraphReport
from fxpass.jit.runtime import RegionFallbackWarning, direct
from fxpass.jit.streamline import streamline
from fxpass.passmanager import ContractError, FixpointError
from fxpass.rewriter import RuleError

log = logging.getLogger("fxpass.jit")


#: Rebuilds after the weights of one instance changed (written in place, or a few replaced);
#: past this the graph runs eagerly.
MAX_REBUILDS = 2


#: errors that check=True exists to raise (the graph-level eager fallback re-raises them)
CHECK_ERRORS = (ContractError, FixpointError)


class GuardedGraph:
    """The compiled graph plus a guard on frozen weights: a weight that changed (replaced or
    mutated in place) triggers a rebuild from the pristine graph, never a stale answer."""

    def __init__(self, aot_gm: GraphModule, opts: Options):
        self.pristine = _clone(aot_gm)
        self.opts = opts
        self.who = f"fxpass_{opts.device}"
        #: Dynamo's frame around this graph writes no Python state (``_capture.
        #: frame_writes_nothing``): a step of it may be replayed by calling this graph alone
        self.pure = False
        self._rebuilds: dict[tuple, int] = {}  # warned rebuilds per set of tensors
        self._buffer_writes: Counter[int] = Counter()
        self.evictions = 0
        self.eager_only = False
        #: weights signature -> (guard, compiled, report, the weights): holding the weights
        #: keeps their memory from being reused by other tensors under the same signature
        self.variants: dict[tuple, tuple[list, Callable, GraphReport, list]] = {}
        self.run = self._build(aot_gm)

    @staticmethod
    def _entry(k: int, t: torch.Tensor, version: Any = ...
               ) -> tuple[int, int, int | None, tuple, torch.dtype]:
        """What the guard compares for weight input ``k``; inference-mode tensors have no
        version counter: pointer, shape and dtype only. ``version``: the counter read when
        ``t`` was frozen (``graph.FROZEN_VERSION``), else ``t``'s own."""
        return (k, t.data_ptr(), version_of(t) if version is ... else version, tuple(t.shape),
                t.dtype)

    def _snapshot(self, gm: GraphModule) -> list[tuple[int, int, int | None, tuple, torch.dtype]]:
        snap = [
            self._entry(k, p.meta[FROZEN], p.meta.get(FROZEN_VERSION, ...))
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
            # through the module: a profiler or a test may wrap it there
            compiled, report = backend.compile_graph(gm, self.opts)
            # per call, the CPU side as cheap as a package's (not in compile_graph: an exported
            # program is streamlined by aot.package after torch.export)
            report.streamlined = streamline(compiled, [
                (p.meta.get("val"), FROZEN in p.meta)
                for p in gm.graph.find_nodes(op="placeholder")])
            compiled = direct(compiled)  # a graph that is one region: called without the graph
        except Exception as e:
            # strict, or check=True asking for rule-contract failures: they must surface
            if self.opts.strict or (self.opts.check and isinstance(e, CHECK_ERRORS)):
                raise
            compiled, report = self._eager_fallback(e)
        self.report = report
        held = [p.meta[FROZEN] for p in gm.graph.find_nodes(op="placeholder") if FROZEN in p.meta]
        self.variants[tuple(self.guard)] = (self.guard, compiled, report, held)
        while len(self.variants) > self.opts.max_variants:
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
            f"{self.who}: this graph failed to compile and runs eagerly ({why}); results stay "
            f"correct. Fix: {fix}; strict=True raises instead"
        )
        warnings.warn(msg, RegionFallbackWarning, stacklevel=3)
        report = GraphReport(
            graph=next(_GRAPH_IDS),
            march=getattr(self.opts.dev, "march", self.opts.device),
            executor=self.opts.get_device().label(self.opts.dev),
            device=self.opts.device,
        )
        report.notes.append(msg)
        REPORTS.append(report)
        del REPORTS[:-backend.MAX_REPORTS]  # read at call time: a test may lower it
        return self.pristine, report

    def __call__(self, *args: Any) -> Any:
        if HELD.tap is not None:  # a watched step (``fxpass.hf.replay``)
            return self._tapped(args)
        held = HELD.on
        if held:  # this graph's (a trusted forward's one graph): a graph called from inside
            HELD.on = False  # this one, through a custom op, checks its own weights
        if self.eager_only:
            return self.pristine(*args)
        if held:  # checked by the step before, unwritten since (``held.Held``)
            return self.run(*args)
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

    def _tapped(self, args: tuple) -> Any:
        """A call while a step is watched: run as any other, and tell the watcher."""
        tap = HELD.tap
        HELD.tap = None  # a graph called from inside this one is not the step's
        try:
            out = self(*args)
        finally:
            HELD.tap = tap
        tap.append((self, args, out))
        return out

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
            log.info("%s: %s", self.who, note)
            return self._rebuild(args, note)
        name = self._names([i for i in written if i not in buffers][:1])
        if self.opts.strict:
            raise RuntimeError(f"{self.who}: weight {name} changed after compile (strict=True)")
        tensors = tuple((i, ptr) for i, ptr, *_ in sig)
        n = self._rebuilds.get(tensors, 0)
        if n >= MAX_REBUILDS:
            return self._give_up("weights keep changing; this graph now runs eagerly", args)
        self._rebuilds[tensors] = n + 1
        warnings.warn(
            f"{self.who}: weight {name} changed after compile; recompiling "
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
                    f"{self.who}: weight {self._names([k])} is now {t.dtype} "
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
            phs[i].meta.pop(FROZEN_VERSION, None)
        self.variants.clear()  # every variant froze them
        log.info("%s: %s", self.who, note)
        STATS["unfrozen_buffers"] += len(written)
        return self._rebuild(args, note)

    def _new_variant(self, args: tuple) -> Any:
        """Compile this graph for another instance's weights (a variant), keeping the others;
        past ``max_variants`` the least recently used one is evicted, and a graph that keeps
        evicting (more instances than variants, called in turn) runs eagerly."""
        cap = self.opts.max_variants
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
        log.info("%s: %s", self.who, note)
        STATS["variants"] += 1
        return self._rebuild(args, note)

    def _rebuild(self, args: tuple, note: str | None = None) -> Any:
        for p, t in zip(self.pristine.graph.find_nodes(op="placeholder"), args, strict=True):
            if FROZEN in p.meta:
                p.meta[FROZEN], p.meta[FROZEN_VERSION] = t.detach(), version_of(t)
        self.run = self._build(_clone(self.pristine))
        if note:
            self.report.notes.append(note)
        return self.run(*args)

    def _give_up(self, why: str, args: tuple) -> Any:
        if self.opts.strict:
            raise RuntimeError(f"{self.who}: {why} (strict=True raises instead)")
        warnings.warn(f"{self.who}: {why}", stacklevel=4)
        self.eager_only = True
        self.variants.clear()  # never used again: release their sessions and weights
        return self.pristine(*args)
