"""Executors for one compiled region, and the module spliced into the graph to call it.

``OrtExecutor`` runs the region's ONNX model in onnxruntime on the host (zero-copy in: torch
CPU tensors are handed over as numpy views; zero-copy out: numpy results become tensors
without a copy). ``HbmExecutor`` runs a ``.hbm`` through the board runtime (``hbm_runtime``),
binding inputs by name as it requires. ``RegionCall`` checks what it is given, and falls back
to the region's own eager graph with a warning if the executor fails (or raises if strict).
"""

from __future__ import annotations

import ctypes
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.fx import GraphModule

from fxpass.device import Artifact, CallDeclined


class RegionFallbackWarning(UserWarning):
    """A region could not run on its executor and ran eagerly instead (results stay correct)."""


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return None


def _malloc_trim() -> None:
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _np(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view when the tensor is contiguous (a cache buffer, say).

    Not ``np.ascontiguousarray`` unconditionally: it turns a 0-dim array into shape ``(1,)``.
    """
    a = (t.detach() if t.requires_grad else t).numpy()
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A zero-copy tensor of an executor's output, keeping its exact shape (0-dim stays 0-dim)."""
    return torch.from_numpy(a if a.flags.c_contiguous else np.ascontiguousarray(a))

#: one compiled region (``fxpass.device.Artifact``): its executor, key, size and what a
#: package writes of it
Compiled = Artifact


#: for executors: a zero-copy numpy view of a torch CPU tensor, a zero-copy tensor of an
#: executor's output, and giving freed memory back to the OS after a large release
as_numpy, as_tensor, malloc_trim = _np, _tensor, _malloc_trim


class TorchThreads:
    """Runs a spliced graph with torch's own CPU ops on ``n`` threads, then restores the
    caller's count.

    Why: after every parallel torch op, torch's OpenMP workers keep spinning for milliseconds
    (libgomp's default wait policy), and onnxruntime's workers run on the same cores, so a
    host region started right after one ran a core short. Qwen3 4 x 1024, 128 tokens
    (``benchmarks.probes.forward_split``, 2026-12-03): 69.5 ms per call against 79.0 with the
    embedding in front of the region on torch's 2 threads. The backend uses
    this only for graphs whose torch ops are light (an embedding, index arithmetic), which lose
    nothing on one thread. ``torch.set_num_threads`` is a few hundred ns each way."""

    def __init__(self, graph: Callable[..., Any], n: int):
        self.graph = graph
        self.n = n
        #: a region that failed runs its eager graph, the heavy work, from then on: on the
        #: caller's threads (found in review: it stayed pinned to one)
        self.regions = [m for m in graph.modules() if isinstance(m, RegionCall)] if (
            isinstance(graph, GraphModule)) else []

    def __call__(self, *args: Any) -> Any:
        prev = torch.get_num_threads()
        if prev == self.n or any(r.failed is not None for r in self.regions):
            return self.graph(*args)
        torch.set_num_threads(self.n)
        try:
            return self.graph(*args)
        finally:
            torch.set_num_threads(prev)


class DirectRegion:
    """A compiled graph that is one region and nothing else (a whole model offloaded), called
    without the graph around it: the arguments the region reads picked by position, its
    outputs (or passed-through arguments) returned in the graph's order.

    Why: such a graph's Python forward, the module call around the region and the thread
    switch of ``TorchThreads`` run no op of the model, yet cost the call a few microseconds
    each, and more with cold caches: right after a region streamed its weights, every object
    the host code touches comes back from memory (``benchmarks.probes.forward_split``'s
    "cache refill"). The region's own checks and eager fallback stay as they are."""

    def __init__(self, graph: GraphModule, region: RegionCall, picks: list[int],
                 outs: list[tuple[int, int | None]], kind: type):
        self.graph = graph  # kept for tools (and to keep its modules alive)
        self.region = region
        self.picks = picks
        self.outs = outs  # (0, element of the region's outputs) | (1, argument) | (2, None)
        self.kind = kind
        self.identity = kind is tuple and outs == [(0, i) for i in range(len(outs))] and (
            len(region.out_shapes) == len(outs))

    def __call__(self, *args: Any) -> Any:
        outs = self.region.forward(*[args[i] for i in self.picks])
        if self.identity:
            return tuple(outs)
        return self.kind(outs[j] if k == 0 else args[j] if k == 1 else None
                         for k, j in self.outs)


def direct(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` as a :class:`DirectRegion` when its graph is one region and nothing else;
    else ``compiled`` unchanged."""
    import operator

    gm = compiled.graph if isinstance(compiled, TorchThreads) else compiled
    if not isinstance(gm, GraphModule):
        return compiled
    phs = {p: i for i, p in enumerate(gm.graph.find_nodes(op="placeholder"))}
    calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    mods = [n for n in calls if n.op == "call_module"]
    if len(mods) != 1 or mods[0].kwargs or any(
            n is not mods[0] and not (n.op == "call_function" and n.target is operator.getitem
                                      and n.args[0] is mods[0]) for n in calls):
        return compiled
    region = gm.get_submodule(mods[0].target)
    if not isinstance(region, RegionCall) or not all(a in phs for a in mods[0].args):
        return compiled
    (ret,) = gm.graph.find_nodes(op="output")
    leaves = ret.args[0]
    if not isinstance(leaves, tuple | list):
        return compiled
    outs: list[tuple[int, int | None]] = []
    for v in leaves:
        if v is None:
            outs.append((2, None))
        elif v in phs:
            outs.append((1, phs[v]))
        elif isinstance(v, torch.fx.Node) and v.target is operator.getitem and (
                v.args[0] is mods[0] and isinstance(v.args[1], int)):
            outs.append((0, v.args[1]))
        else:
            return compiled
    return DirectRegion(gm, region, [phs[a] for a in mods[0].args], outs, type(leaves))


class RegionCall(torch.nn.Module):
    """One spliced region: runs the executor; on failure, the region's eager graph."""

    def __init__(
        self,
        name: str,
        executor: Any,
        eager: GraphModule | Callable[[], GraphModule],
        expected: list[Any],
        strict: bool = False,
        out_shapes: list[torch.Size | None] | None = None,
        device: str = "",
    ):
        """``eager`` is the region's own graph, or (on a cached plan, where the rules did not
        run) a function that rebuilds it; it is only needed if the executor fails."""
        super().__init__()
        self.name = name
        self.who = f"fxpass_{device}" if device else "fxpass"
        self.executor = executor
        self._eager_factory = None if isinstance(eager, GraphModule) else eager
        if isinstance(eager, GraphModule):
            self.eager = eager
        # torch.Size compares with a tensor's .shape without building tuples (per-call path)
        self.expected = [(torch.Size(v.shape), v.dtype) for v in expected]
        if out_shapes is None:
            (out,) = eager.graph.find_nodes(op="output")
            vals = [a.meta.get("val") if hasattr(a, "meta") else None for a in out.args[0]]
            out_shapes = [
                torch.Size(v.shape) if isinstance(v, torch.Tensor) else None for v in vals
            ]
        self.out_shapes = out_shapes
        #: (output, its compiled shape, that shape's element count): the per-call checks
        #: read these instead of recomputing them
        self._outs = [(i, s, math.prod(s)) for i, s in enumerate(out_shapes) if s is not None]
        self.strict = strict
        self.failed: str | None = None if executor is not None else "not compiled"
        #: calls the executor declined and eager answered (``_declined``)
        self.declined = 0

    def _eager(self) -> GraphModule:
        if self._eager_factory is not None:
            self.eager = self._eager_factory()
            self._eager_factory = None
        return self.eager

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.failed is None:
            for t, (shape, dtype) in zip(tensors, self.expected, strict=True):
                if t.dtype != dtype or t.shape != shape:
                    return self._fallback(
                        f"input {tuple(t.shape)} {t.dtype} differs from the compiled "
                        f"{tuple(shape)} {dtype}",
                        tensors,
                    )
            try:
                outs = self.executor(*tensors)
            except CallDeclined as e:  # this call's values only: eager now, the region next
                return self._declined(f"{type(e).__name__}: {e}", tensors)
            except Exception as e:  # noqa: BLE001 - any executor failure must not give a wrong answer
                return self._fallback(f"{type(e).__name__}: {e}", tensors)
            if len(outs) != len(self.out_shapes):
                return self._fallback(f"{len(outs)} outputs, compiled for "
                                      f"{len(self.out_shapes)}", tensors)
            views = None  # an output left unreshaped (host.output_views): viewed back here
            for i, shape, numel in self._outs:
                o = outs[i]
                if o is None:  # a row the kernel wrote in place (``aot.writes``), not returned
                    continue
                if o.shape != shape:
                    if o.numel() != numel:
                        return self._fallback(
                            f"output shape {tuple(o.shape)} is not the compiled {tuple(shape)}",
                            tensors,
                        )
                    if views is None:
                        views = list(outs)
                    views[i] = o.reshape(shape)
            return outs if views is None else tuple(views)
        return tuple(self._eager()(*tensors))

    def _declined(self, why: str, tensors: tuple) -> tuple[torch.Tensor, ...]:
        """A call the executor declined (``fxpass.device.CallDeclined``): eager's answer for
        it, a warning the first time. Why not eager for good: a decline is about one call's
        values (a prompt batch with padded rows the fused attention cannot take), and the
        region's next calls are usually its own."""
        if self.strict:
            raise RuntimeError(f"{self.who} region {self.name} cannot run: {why} (strict=True)")
        out = tuple(self._eager()(*tensors))
        self.declined += 1
        if self.declined == 1:
            warnings.warn(
                f"{self.who} region {self.name} answered a call eagerly: {why}; its later "
                "calls still try the region (warned once per region)",
                RegionFallbackWarning, stacklevel=3)
        return out

    def _fallback(self, why: str, tensors: tuple) -> tuple[torch.Tensor, ...]:
        if self.strict:
            raise RuntimeError(f"{self.who} region {self.name} cannot run: {why} (strict=True)")
        # eager first: if it raises too, the input is at fault (a token id past the table),
        # not the region, which keeps its executor; the caller gets eager's own error
        out = tuple(self._eager()(*tensors))
        self.failed = why
        warnings.warn(
            f"{self.who} region {self.name} runs eagerly from now on: {why}",
            RegionFallbackWarning,
            stacklevel=2,
        )
        return out
