"""What a program needs at run time, and nothing of the export machinery: the one custom op
every region is spliced as (``torch.ops.fxpass.region``), the process's registry of open
regions, and the program's runtime graph (in-place cache writes, regions bound directly).
``load()`` imports this, not ``aot.export``."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

#: key -> the callables that run a region (``runtime.RegionCall``s), the last opened first
#: in use: each stays until its owner (a loaded package, an exported program) is collected
_LIVE: dict[str, list[Callable[..., tuple[torch.Tensor, ...]]]] = {}


#: key -> the region's output (shape, dtype) list, for the op's fake implementation
_SPECS: dict[str, list[tuple[tuple[int, ...], torch.dtype]]] = {}


@torch.library.custom_op("fxpass::region", mutates_args=())
def region(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run compiled region ``key`` on ``inputs`` (one op for every region of every program)."""
    fns = _LIVE.get(key)
    if not fns:
        raise RuntimeError(
            f"fxpass region {key!r} is not open in this process: a program that calls it must "
            "come from fxpass.aot.export.export() or fxpass.aot.package.load(path), which "
            "open its regions (torch.export.load alone does not)"
        )
    return list(fns[-1](*inputs))


@region.register_fake
def _(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    spec = _SPECS.get(key)
    if spec is None:
        raise RuntimeError(f"fxpass region {key!r}: no output spec registered in this process")
    return [torch.empty(shape, dtype=dtype) for shape, dtype in spec]


def open_region(key: str, fn: Callable[..., Any], outputs: list[tuple[tuple[int, ...], Any]]):
    """Make ``torch.ops.fxpass.region(key, ...)`` run ``fn`` in this process, until
    :func:`close_with`'s owner is collected."""
    _SPECS[key] = [(tuple(s), d) for s, d in outputs]
    _LIVE.setdefault(key, []).append(fn)


def close_with(owner: object, opened: list[tuple[str, Callable[..., Any]]]) -> None:
    """Close the regions ``opened`` ((key, callable) pairs given to :func:`open_region`) when
    ``owner`` is garbage collected. Why: the registry held every region ever opened, and with
    it its executor (an onnxruntime session and its packed weights), so a process that loads
    new versions of a package, or exports in a loop, grew by a model each time. Another
    owner's region of the same key (the same package loaded twice) stays open."""
    weakref.finalize(owner, _close, opened)


def _close(opened: list[tuple[str, Callable[..., Any]]]) -> None:
    for key, fn in opened:
        fns = _LIVE.get(key, [])
        fns[:] = [f for f in fns if f is not fn]
        if not fns:
            _LIVE.pop(key, None)
            _SPECS.pop(key, None)


class ExportError(RuntimeError):
    """The model cannot be exported as asked; the message names the cause and the fix."""


#: what torch says when a trace reads a tensor's value into Python (``.item()``, ``if t:``)
_DATA_DEPENDENT = ("DataDependentOutputException", "GuardOnDataDependentSymNode", "aten.item",
                   "_local_scalar_dense", "data-dependent")


def untraceable(module: torch.nn.Module, e: Exception) -> ExportError:
    """The :class:`ExportError` for a model whose forward torch.export (or the functional
    re-trace after it) cannot trace, naming the model, torch's own first line and the fix.

    Why: the error torch raises from deep inside its tracer (OPT's and BioGpt's static-cache
    forwards read a length from a tensor; GPT-2 and every encoder-decoder return their cache
    object unless told not to) names neither the model nor what to do."""
    import re

    model = getattr(module, "model", module)  # transformers' export wrapper holds the model
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = f"{type(e).__name__}: {first}"[:300]
    name = type(model).__name__
    returned = re.search(r"Found <class '([\w.]+)'> in output", first)
    if returned and returned.group(1).endswith("Cache"):
        return ExportError(
            f"cannot export {name}: its call returns a transformers cache "
            f"({returned.group(1).rsplit('.', 1)[-1]}), which a program of tensors cannot "
            f"return ({text}). Fix: pass use_cache=False with the inputs (export(model, args, "
            "{..., 'use_cache': False})); to generate, use export_for_generate")
    if returned:
        return ExportError(
            f"cannot export {name}: its call returns a {returned.group(1)}, which torch's "
            f"pytree does not know ({text}). Fix: return tensors, tuples, lists or dicts, or "
            "register the type with torch.utils._pytree.register_pytree_node")
    reads = any(k in type(e).__name__ + str(e) for k in _DATA_DEPENDENT)
    why = ("its forward reads a tensor's value into Python (data-dependent control flow: a "
           "length or a position computed from a tensor), which a program of fixed shapes "
           "cannot hold" if reads else "torch.export failed inside the model's own code")
    err = ExportError(
        f"cannot export {name}: {why} ({text}). Fix: run it compiled "
        "instead (torch.compile(model, backend=\"fxpass_ort\"), or compile_for_generate for "
        "generate()), which falls back to eager where a graph cannot be traced; or change the "
        "model's forward so that torch.export traces it (torch.export.export(model, args, "
        "strict=False) shows the same error)")
    err.data_dependent = reads
    return err


def data_dependent(e: ExportError) -> bool:
    """Whether ``e`` (from :func:`untraceable`) is a trace that read a tensor's value."""
    return getattr(e, "data_dependent", False)


def runtime_graph(ep: ExportedProgram) -> GraphModule:
    """``ep``'s graph as a plain GraphModule over the flat user inputs, which writes the inputs
    it mutates in place and returns the user outputs; lifted constants become attributes.

    Why: ``torch.export`` functionalizes the program's in-place writes (a KV cache's
    ``index_copy_``) into a new whole tensor returned as a mutation output, which
    ``ExportedProgram.module()`` then copies back: two passes over the whole cache per step.
    A mutation whose value is an ``index_copy`` of that very input, read by nothing after it,
    becomes the in-place ``index_copy_`` again (it writes only the new positions); any other
    mutation is a ``copy_`` into the input after the graph's last use of it. A package stores
    this graph beside the ``.pt2`` (``plan.encode``), so loading it imports no Dynamo
    (``torch.export.load`` does: 1.3 s of a fresh process's load)."""
    import copy

    aten = torch.ops.aten
    gm = copy.deepcopy(ep.graph_module)
    g = gm.graph
    sig = ep.graph_signature
    phs = {n.name: n for n in g.find_nodes(op="placeholder")}
    by_target = {s.target: s.arg.name for s in sig.input_specs if s.target is not None}
    (out,) = g.find_nodes(op="output")
    order = {n: i for i, n in enumerate(g.nodes)}
    keep = []
    for spec, v in zip(sig.output_specs, out.args[0], strict=True):
        kind = spec.kind.name
        if kind == "USER_OUTPUT":
            keep.append(v)
            continue
        if kind not in ("USER_INPUT_MUTATION", "BUFFER_MUTATION"):
            raise ExportError(f"program output of kind {kind} is not supported")
        target = phs[spec.target if kind == "USER_INPUT_MUTATION" else by_target[spec.target]]
        later = [u for u in target.users if u is not v and order[u] > order.get(v, -1)]
        if (isinstance(v, torch.fx.Node) and v.target is aten.index_copy.default
                and v.args[0] is target and not later):
            v.target = aten.index_copy_.default
        else:
            with g.inserting_before(out):
                g.call_function(aten.copy_.default, (target, v))
    out.args = (tuple(keep),)
    for i, spec in enumerate(s for s in sig.input_specs if s.kind.name != "USER_INPUT"):
        t = ep.state_dict[spec.target] if spec.target in ep.state_dict else (
            ep.constants[spec.target])
        name = f"_lifted_{i}"
        gm.register_buffer(name, t)
        ph = phs[spec.arg.name]
        with g.inserting_before(ph):
            ga = g.get_attr(name)
        ph.replace_all_uses_with(ga)
        g.erase_node(ph)
    gm.recompile()
    return gm


def bind(gm: GraphModule) -> GraphModule:
    """``gm`` with each region call bound to its executor directly: the dispatcher's custom-op
    path (autograd wrapper, alias checks) cost ~40 us per call, a tenth of a small decode
    step's time outside its region."""
    for n in gm.graph.find_nodes(op="call_function", target=torch.ops.fxpass.region.default):
        n.target, n.args = _direct(n.args[0]), tuple(n.args[1])
    gm.recompile()
    return gm


def inplace(ep: ExportedProgram, n_weights: int = 0, n_state: int = 0,
            memo: list[int] | None = None) -> Callable[..., list[Any]]:
    """A callable over ``ep``'s flat inputs (``runtime_graph``, regions bound, the inputs
    ``memo`` indexes memoized as ``aot.memo.memoize_inputs`` does)."""
    from fxpass.aot.memo import memoize_inputs
    from fxpass.aot.writes import fuse_index_writes, grant_in_place

    gm = bind(runtime_graph(ep))
    grant_in_place(gm, region_executor)
    fuse_index_writes(gm)
    memoize_inputs(gm, n_weights, n_state, memo or [])

    def run(*flat: Any) -> list[Any]:
        return list(gm(*flat))

    return run


def _direct(key: str) -> Callable[..., tuple[torch.Tensor, ...]]:
    fns = _LIVE.get(key)
    if not fns:
        raise RuntimeError(f"fxpass region {key!r} is not open in this process")
    fn = fns[-1]
    # a RegionCall's forward, not its Module.__call__: a loaded program has no hooks to run
    run = fn.forward if isinstance(fn, torch.nn.Module) else fn

    def region_call(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return run(*inputs)

    region_call.__name__ = f"region_{key[:8]}"
    region_call.region = fn  # type: ignore[attr-defined]  (aot.writes.grant_in_place)
    return region_call


def region_executor(node: torch.fx.Node) -> Any:
    """The executor behind a bound region call (``bind``), else None."""
    call = getattr(node.target, "region", None)
    return getattr(call, "executor", None)


def threads(fn: Callable[..., Any], n: int | None) -> Callable[..., Any]:
    """``fn`` with torch's ops on ``n`` threads (``runtime.TorchThreads``), or ``fn``."""
    from fxpass.jit.runtime import TorchThreads

    return fn if n is None else TorchThreads(fn, n)
