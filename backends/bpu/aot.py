"""Ahead of time: ``export(model, args, kwargs)`` -> a program that saves, loads and runs alone.

Why: inside ``torch.compile`` every process re-traces with Dynamo, re-runs AOTAutograd and
looks up its plan, and every call pays for Dynamo's guards. A board is deployed ahead of time:
build once on a workstation, copy an artifact, run it. This is the same pipeline as the JIT
backend (``backend.compile_graph``: the ``bpu`` target's rules to fixpoint, the partition,
lowering, region compile), fed by ``torch.export`` instead of Dynamo:

    torch.export.export(model, args, kwargs, strict=False)
      -> run_decompositions(the CompositeImplicit ops AOTAutograd decomposes)   same aten IR
      -> parameters and buffers marked frozen, as the JIT path marks them
      -> compile_graph(gm, options)                                              shared
      -> each spliced region -> torch.ops.fxpass.region(key, [inputs])           custom op
      -> torch.export.export of that graph: a real ExportedProgram; its CPU ops run in torch

The custom op finds the region's executor by ``key`` (a digest of the region's graph, weights,
march and options) in this process's table: ``export`` fills it with the regions it compiled,
``package.load`` with the regions it opened from a package.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule

from fxpass._capture import SOURCE
from fxpass.graph import FROZEN, FROZEN_BUFFER

#: key -> the callable that runs a region (a ``runtime.RegionCall``)
_LIVE: dict[str, Callable[..., tuple[torch.Tensor, ...]]] = {}
#: key -> the region's output (shape, dtype) list, for the op's fake implementation
_SPECS: dict[str, list[tuple[tuple[int, ...], torch.dtype]]] = {}


@torch.library.custom_op("fxpass::region", mutates_args=())
def region(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run compiled region ``key`` on ``inputs`` (one op for every region of every program)."""
    fn = _LIVE.get(key)
    if fn is None:
        raise RuntimeError(
            f"fxpass region {key!r} is not open in this process: a program that calls it must "
            "come from fxpass.backends.bpu.export() or fxpass.backends.bpu.load(path), which "
            "open its regions (torch.export.load alone does not)"
        )
    return list(fn(*inputs))


@region.register_fake
def _(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    spec = _SPECS.get(key)
    if spec is None:
        raise RuntimeError(f"fxpass region {key!r}: no output spec registered in this process")
    return [torch.empty(shape, dtype=dtype) for shape, dtype in spec]


def open_region(key: str, fn: Callable[..., Any], outputs: list[tuple[tuple[int, ...], Any]]):
    """Make ``torch.ops.fxpass.region(key, ...)`` run ``fn`` in this process."""
    _SPECS[key] = [(tuple(s), d) for s, d in outputs]
    _LIVE[key] = fn


class ExportError(RuntimeError):
    """The model cannot be exported as asked; the message names the cause and the fix."""


def _cia_table() -> dict[Any, Callable]:
    """The CompositeImplicitAutograd decompositions AOTAutograd applies in the JIT path
    (``linear`` -> ``addmm``, ``layer_norm`` -> ``native_layer_norm``, SDPA -> its CPU
    kernel op, ...), so the rules see the same aten IR from ``torch.export``."""
    from torch._export.utils import _collect_all_valid_cia_ops, _get_decomp_for_cia

    return {op: _get_decomp_for_cia(op) for op in _collect_all_valid_cia_ops()}


@dataclass
class RegionArtifact:
    """One compiled region as a package stores it."""

    name: str
    key: str
    model: Any  # onnx.ModelProto without weight data
    weights: Any  # lowering.driver.Weights
    input_names: list[str]
    inputs: list[tuple[tuple[int, ...], torch.dtype]]
    outputs: list[tuple[tuple[int, ...], torch.dtype]]


@dataclass
class Program:
    """What :func:`export` returns: call it like the model, ``save(path)`` it, read ``report``.

    ``exported_program`` is a real ``torch.export.ExportedProgram``: its CPU ops are aten ops,
    each region one ``torch.ops.fxpass.region`` call."""

    exported_program: ExportedProgram
    regions: list[RegionArtifact]
    report: Any
    options: dict[str, Any]
    cpu_threads: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    _module: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._module is None:
            self._module = self.exported_program.module()
        return _threads(self._module, self.cpu_threads)(*args, **kwargs)

    def save(self, path: str, *, progress: Callable[[str], None] | None = None) -> str:
        """Write the package directory ``path`` (see ``package.save``); returns it."""
        from fxpass.backends.bpu.package import save

        return save(self, path, progress=progress)


def _threads(fn: Callable[..., Any], n: int | None) -> Callable[..., Any]:
    if n is None:
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        prev = torch.get_num_threads()
        if prev == n:
            return fn(*args, **kwargs)
        torch.set_num_threads(n)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(prev)

    return run


def export(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    options: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Program:
    """Export ``model(*args, **kwargs)`` through the BPU pipeline, ahead of time.

    ``options`` are the backend's (``torch.compile(..., options=...)``); the artifact cache and
    tiered sessions do not apply (a package holds every region's model itself). Shapes are
    those of ``args``/``kwargs``: the program refuses other shapes with a clear error.
    """
    from fxpass.backends.bpu.backend import EXPORTING, compile_graph, validate_options
    from fxpass.backends.bpu.runtime import RegionCall, TorchThreads

    say = progress or (lambda _msg: None)
    from fxpass.backends.bpu.compile import resolve_executor

    opts = validate_options(options)
    if opts.get("quantize") is not None or resolve_executor(opts["executor"]) != "onnxruntime":
        raise ExportError(
            "export() packages host (onnxruntime) regions in float only for now: quantized "
            "regions (option 'quantize', and the board's executor='hbdnn', which always "
            "quantizes) are not exported yet. Pass executor='onnxruntime' and no 'quantize', "
            "or use torch.compile(model, backend='fxpass_bpu') for those")
    opts.update(cache=False, tiered=False, **{EXPORTING: True})
    kwargs = dict(kwargs or {})
    args = tuple(args)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    say("torch.export (non-strict)")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ep = torch.export.export(model, args, kwargs, strict=False)
            ep = ep.run_decompositions(_cia_table())
    finally:
        model.train(was_training)
    seconds["export"] = time.perf_counter() - t0
    gm = _pipeline_graph(ep)
    say(f"rules, partition, lowering, region compile ({len(gm.graph.nodes)} nodes)")
    t1 = time.perf_counter()
    compiled, report = compile_graph(gm, opts)
    seconds["compile"] = time.perf_counter() - t1
    threads = None
    if isinstance(compiled, TorchThreads):
        compiled, threads = compiled.graph, compiled.n
    regions: list[RegionArtifact] = []
    graph = compiled.graph
    for node in list(graph.nodes):
        mod = compiled.get_submodule(node.target) if node.op == "call_module" else None
        if not isinstance(mod, RegionCall):
            continue
        c = mod.compiled
        art = RegionArtifact(
            name=mod.name,
            key=c.key[:32],
            model=c.artifact[0],
            weights=c.artifact[1],
            input_names=list(c.executor.input_names),
            inputs=[(tuple(s), d) for s, d in mod.expected],
            outputs=[(tuple(s) if s is not None else (), _out_dtype(mod, i))
                     for i, s in enumerate(mod.out_shapes)],
        )
        open_region(art.key, mod, art.outputs)
        regions.append(art)
        with graph.inserting_before(node):
            call = graph.call_function(torch.ops.fxpass.region.default, (art.key, list(node.args)))
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    _weights_as_attributes(compiled)
    flat_out = GraphModule(compiled, graph)
    say(f"torch.export of the spliced graph ({len(regions)} region(s))")
    t2 = time.perf_counter()
    program = _Spliced(flat_out, ep.call_spec.out_spec)
    with torch.no_grad():
        final = torch.export.export(program, args, kwargs, strict=False)
    seconds["splice_export"] = time.perf_counter() - t2
    seconds["total"] = time.perf_counter() - t0
    return Program(final, regions, report, opts, threads, seconds)


def _out_dtype(mod: Any, i: int) -> torch.dtype:
    (out,) = mod._eager().graph.find_nodes(op="output")
    return out.args[0][i].meta["val"].dtype


class _Spliced(torch.nn.Module):
    """The spliced graph behind the model's own call signature (pytree in, pytree out)."""

    def __init__(self, gm: GraphModule, out_spec: Any):
        super().__init__()
        self.gm = gm
        self.out_spec = out_spec

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = pytree.tree_leaves((args, kwargs))
        return pytree.tree_unflatten(list(self.gm(*flat)), self.out_spec)


def _pipeline_graph(ep: ExportedProgram) -> GraphModule:
    """``ep``'s graph as the JIT backend gets it from AOTAutograd: parameters, buffers and
    constants are placeholders marked frozen (``meta[FROZEN]`` = the tensor), user inputs
    plain placeholders; export's own metadata asserts are dropped (inputs are checked where
    the program is called)."""
    sig = ep.graph_signature
    if sig.buffers_to_mutate or sig.user_inputs_to_mutate:
        written = sorted({*sig.buffers_to_mutate.values(), *sig.user_inputs_to_mutate.values()})
        raise ExportError(
            f"the model writes {written} in place; export() takes models whose calls are "
            "pure functions of their inputs. A KV cache belongs to export_for_generate"
        )
    gm = ep.graph_module
    phs = gm.graph.find_nodes(op="placeholder")
    for ph, spec in zip(phs, sig.input_specs, strict=True):
        if spec.kind == InputKind.USER_INPUT:
            continue
        t = ep.state_dict.get(spec.target) if spec.target in ep.state_dict else (
            ep.constants.get(spec.target))
        if not isinstance(t, torch.Tensor):
            raise ExportError(f"input {spec.target!r} of kind {spec.kind.name} has no tensor")
        ph.meta[FROZEN] = t.detach()
        if spec.kind != InputKind.PARAMETER:
            ph.meta[FROZEN_BUFFER] = True
        ph.meta[SOURCE] = spec.target
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(n)
    return gm


def _weights_as_attributes(gm: GraphModule) -> None:
    """Frozen placeholders the CPU ops still read become attributes of ``gm`` (the re-export
    lifts them into the program's state); those only regions read are dropped: their data
    lives in the regions' artifacts, so every weight is stored once."""
    taken: set[str] = set()
    for ph in list(gm.graph.find_nodes(op="placeholder")):
        t = ph.meta.get(FROZEN)
        if t is None:
            continue
        if ph.users:
            name = _attr_name(ph.meta.get(SOURCE) or ph.name, taken)
            gm.register_buffer(name, t)
            with gm.graph.inserting_before(ph):
                ga = gm.graph.get_attr(name)
            ga.meta.update(ph.meta)
            ph.replace_all_uses_with(ga)
        gm.graph.erase_node(ph)


def _attr_name(source: str, taken: set[str]) -> str:
    base = "w_" + re.sub(r"\W", "_", source)
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name
