"""Ahead of time: ``export(model, args, kwargs)`` -> a program that saves, loads and runs alone.

Why: inside ``torch.compile`` every process re-traces with Dynamo, re-runs AOTAutograd and
looks up its plan, and every call pays for Dynamo's guards. A board is deployed ahead of time:
build once on a workstation, copy an artifact, run it. This is the same pipeline as the JIT
backend (``backend.compile_graph``: the ``bpu`` target's rules to fixpoint, the partition,
lowering, region compile), fed by ``torch.export`` instead of Dynamo:

    torch.export.export(model, args, kwargs, strict=False)          the model's own program
      -> functionalize + make_fx with the CompositeImplicit decompositions AOTAutograd applies:
         the JIT path's aten IR, weights marked frozen, written buffers (a KV cache) as state
         with their writes as trailing copy_ (AOTAutograd's kept input mutations)
      -> compile_graph(gm, options)                                  shared with the JIT path
      -> each spliced region -> torch.ops.fxpass.region(key, [inputs])       one custom op
      -> torch.export.export of the flat graph (weights, state, inputs) -> ExportedProgram

Weights are inputs of the final program, not state inside it: a package stores every weight
once, in one file that the programs (prefill and decode share it) and the regions' ONNX
models read, so tied or shared weights are never copied. The custom op finds a region's
executor by ``key`` (a digest of its graph, weights, march and options) in this process's
table, filled by ``export`` and by ``package.load`` and emptied as their objects are collected.

Stages: an export of a large model takes minutes (its region compile above all), so every
stage is reported as it starts, to the logger ``fxpass.export`` at INFO (shown with
``logging.basicConfig(level=logging.INFO)``) and to the ``progress=`` callback if one is given
(the CLI prints them with their times). A program that gets no region because every candidate
is below ``min_compute_macs`` runs all on the CPU: export warns (:class:`NoRegionWarning`),
naming the option, as such a package would silently be no faster than eager.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.fx import GraphModule

from fxpass import device as devices
from fxpass._capture import SOURCE, mutated_inputs
from fxpass.aot import runtime
from fxpass.aot.runtime import ExportError, inplace, open_region, threads, untraceable
from fxpass.aot.stages import NoRegionWarning as NoRegionWarning  # re-exported
from fxpass.aot.stages import Progress, reporter, warn_if_no_region
from fxpass.graph import FROZEN, FROZEN_BUFFER
from fxpass.jit.options import Options, from_options


@functools.cache
def _cia_table() -> dict[Any, Callable]:
    """The CompositeImplicitAutograd decompositions AOTAutograd applies in the JIT path
    (``linear`` -> ``addmm``, ``layer_norm`` -> ``native_layer_norm``, SDPA -> its CPU
    kernel op, ...), so the rules see the same aten IR from ``torch.export``."""
    from torch._export.utils import _collect_all_valid_cia_ops, _get_decomp_for_cia

    return {op: _get_decomp_for_cia(op) for op in _collect_all_valid_cia_ops()}


@dataclass
class RegionArtifact:
    """One compiled region as a package stores it: the device's ``Artifact`` (``artifact``)
    for its ``save``, with the region (``region``, a ``fxpass.device.Region``)."""

    name: str
    key: str
    input_names: list[str]
    inputs: list[tuple[tuple[int, ...], torch.dtype]]
    outputs: list[tuple[tuple[int, ...], torch.dtype]]
    artifact: Any = None
    region: Any = None
    #: a region whose artifact exists once calibrated (no ``data`` yet): its executor
    quantizing: Any = None


@dataclass
class Lowered:
    """One program through the pipeline: ``program`` takes ``(*weights, *state, *inputs)``
    flat and returns the model's outputs flat (``out_spec`` rebuilds their structure)."""

    program: ExportedProgram
    weights: dict[str, torch.Tensor]  # by name, in the program's input order
    state: dict[str, torch.Tensor]  # written in place by the program (a KV cache)
    inputs: list[Any]  # the example user inputs, flat (their shapes and dtypes are the spec)
    in_spec: Any
    out_spec: Any
    regions: list[RegionArtifact]
    report: Any
    cpu_threads: int | None
    seconds: dict[str, float] = field(default_factory=dict)
    #: flat user inputs whose dependent CPU ops are memoized per value (``aot.memo``)
    memo: list[int] = field(default_factory=list)
    _run: Any = None

    def runner(self) -> Callable[..., list[Any]]:
        """A callable over the flat inputs that writes the state in place (``inplace``)."""
        if self._run is None:
            self._run = inplace(self.program, len(self.weights), len(self.state), self.memo)
        return self._run


def lower(
    module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], opts: Options,
    say: Progress, check: Callable[[ExportedProgram], None] | None = None,
) -> Lowered:
    """``module(*args, **kwargs)`` through torch.export and the JIT pipeline (module doc);
    ``check(ep)`` runs on torch.export's program before anything else (it raises to refuse)."""
    from fxpass.jit.backend import compile_graph
    from fxpass.jit.runtime import RegionCall, TorchThreads

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    say("torch.export (non-strict)")
    with torch.no_grad():
        try:
            ep = torch.export.export(module, args, kwargs, strict=False)
        except Exception as e:  # torch's tracer errors name neither the model nor the fix
            raise untraceable(module, e) from e
        if check is not None:
            check(ep)
        try:
            gm, roles, flat_user = _aten_graph(ep, args, kwargs)
        except Exception as e:
            raise untraceable(module, e) from e
    seconds["export"] = time.perf_counter() - t0
    say(f"rules, partition, lowering, region compile ({len(gm.graph.nodes)} nodes)")
    t1 = time.perf_counter()
    compiled, report = compile_graph(gm, opts)
    seconds["compile"] = time.perf_counter() - t1
    threads = None
    if isinstance(compiled, TorchThreads):
        compiled, threads = compiled.graph, compiled.n
    regions: list[RegionArtifact] = []
    opened: list[tuple[str, Any]] = []  # closed when the program is collected
    graph = compiled.graph
    for node in list(graph.nodes):
        mod = compiled.get_submodule(node.target) if node.op == "call_module" else None
        if not isinstance(mod, RegionCall):
            continue
        c = mod.compiled
        key, names = c.key[:32], list(c.executor.input_names)
        art = RegionArtifact(
            name=mod.name, key=key, input_names=names, artifact=c,
            region=devices.Region(mod._eager(), mod.name, key, names),
            quantizing=None if c.data else c.executor,
            inputs=[(tuple(s), d) for s, d in mod.expected],
            outputs=[(tuple(s), _out_dtype(mod, i)) for i, s in enumerate(mod.out_shapes)],
        )
        open_region(art.key, mod, art.outputs)
        opened.append((art.key, mod))
        regions.append(art)
        with graph.inserting_before(node):
            call = graph.call_function(torch.ops.fxpass.region.default, (art.key, list(node.args)))
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    weights, state = {}, {}
    attr_phs = list(graph.find_nodes(op="placeholder"))[: len(roles)]
    for ph, (role, name, t) in zip(attr_phs, roles, strict=True):
        if role == "weight" and not ph.users:
            graph.erase_node(ph)  # only regions read it: its data lives in their artifacts
        elif role == "weight":
            weights[name] = t
        elif role == "state":
            state[name] = t
    flat = GraphModule(compiled, graph)
    say(f"torch.export of the spliced graph ({len(regions)} region(s))")
    t2 = time.perf_counter()
    examples = (*weights.values(), *[t.clone() for t in state.values()], *flat_user)
    with torch.no_grad():
        final = torch.export.export(_Flat(flat), examples, strict=False)
    final.example_inputs = None  # they hold every weight: torch.export.save would write them
    seconds["splice_export"] = time.perf_counter() - t2
    seconds["total"] = time.perf_counter() - t0
    low = Lowered(final, weights, state, flat_user, ep.call_spec.in_spec, ep.call_spec.out_spec,
                  regions, report, threads, seconds)
    runtime.close_with(low, opened)  # the program's executors go with it
    return low


class _Flat(torch.nn.Module):
    def __init__(self, gm: GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, *flat: Any) -> Any:
        return tuple(self.gm(*flat))


def _leaf_index(tree: Any, key: str) -> list[int]:
    """The flat index of the leaf at dict key ``key`` in ``tree`` (as ``tree_flatten`` orders)."""
    leaves = pytree.tree_flatten_with_path(tree)[0]
    return [i for i, (path, _v) in enumerate(leaves) if getattr(path[-1], "key", None) == key]


def _out_dtype(mod: Any, i: int) -> torch.dtype:
    (out,) = mod._eager().graph.find_nodes(op="output")
    return out.args[0][i].meta["val"].dtype


def _attr(module: torch.nn.Module, target: str) -> Any:
    return functools.reduce(getattr, target.split("."), module)


def _aten_graph(
    ep: ExportedProgram, args: tuple, kwargs: dict[str, Any]
) -> tuple[GraphModule, list[tuple[str, str, Any]], list[Any]]:
    """``ep`` as the JIT backend gets a graph from AOTAutograd: functional aten IR with the
    CompositeImplicit ops decomposed, every tensor the program reads from itself (parameters,
    buffers, lifted constants) a placeholder, then the user inputs flat; a tensor it writes
    is state (its write a trailing ``copy_``), the others are weights marked frozen.

    (``ep.run_decompositions`` does the same, but fails on transformers' static-cache
    modules, whose cache-length counters export lifts as constants it then writes to.)
    Returns the graph, (role, name, tensor) per attribute placeholder, and the flat inputs.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call, functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    mod = ep.module()
    # a value read into Python that nothing uses (the length of a mask OPT and BioGpt build
    # and never read once given positions, ``static_cache``): export keeps the read, a re-trace
    # with fake tensors cannot run it
    for n in mod.graph.find_nodes(op="call_function", target=torch.ops.aten.item.default):
        if not n.users:
            mod.graph.erase_node(n)
    mod.recompile()
    attrs: dict[str, torch.Tensor] = {}
    for n in mod.graph.nodes:  # a tied weight is two inputs; weights.bin stores it once
        if n.op == "get_attr" and isinstance(t := _attr(mod, n.target), torch.Tensor):
            attrs[n.target] = t
    names = list(attrs)
    flat_user, spec = pytree.tree_flatten((args, kwargs))

    def call(*flat: Any) -> Any:
        a, k = pytree.tree_unflatten(list(flat[len(names):]), spec)
        state = dict(zip(names, flat, strict=False))
        return pytree.tree_leaves(functional_call(mod, state, a, k, tie_weights=False))

    with FakeTensorMode(allow_non_fake_inputs=False) as fm:
        fakes = [fm.from_tensor(t) if isinstance(t, torch.Tensor) else t
                 for t in (*attrs.values(), *flat_user)]
        gm = make_fx(functionalize(call, remove="mutations"), decomposition_table=_cia_table())(
            *fakes)
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(n)
    for ph, v in zip(gm.graph.find_nodes(op="placeholder")[len(attrs):], flat_user, strict=True):
        if not isinstance(v, torch.Tensor):
            ph.meta["val"] = v  # a Python constant (use_cache=False): specialized, unused
    written = mutated_inputs(gm)
    roles = []
    for ph, (name, t) in zip(gm.graph.find_nodes(op="placeholder"), attrs.items(), strict=False):
        ph.meta[SOURCE] = name
        if ph.name in written:
            roles.append(("state", name, t))
            continue
        ph.meta[FROZEN] = t.detach()
        if not isinstance(t, torch.nn.Parameter):
            ph.meta[FROZEN_BUFFER] = True
        roles.append(("weight", name, t))
    return gm, roles, flat_user


@dataclass
class Program:
    """What :func:`export` returns: call it like the model, ``save(path)`` it, read ``report``.

    ``exported_program`` is a real ``torch.export.ExportedProgram``: its CPU ops are aten ops,
    each region one ``torch.ops.fxpass.region`` call; it takes the weights it reads as inputs
    before the model's own (``weights``), so a package stores each weight once."""

    lowered: Lowered
    options: Options

    @property
    def exported_program(self) -> ExportedProgram:
        return self.lowered.program

    @property
    def regions(self) -> list[RegionArtifact]:
        return self.lowered.regions

    @property
    def report(self) -> Any:
        return self.lowered.report

    @property
    def seconds(self) -> dict[str, float]:
        return self.lowered.seconds

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        low = self.lowered
        flat = pytree.tree_leaves((args, kwargs))
        run = threads(low.runner(), low.cpu_threads)
        outs = run(*low.weights.values(), *low.state.values(), *flat)
        return pytree.tree_unflatten(outs, low.out_spec)

    def save(self, path: str, *, progress: Progress | None = None) -> str:
        """Write the package directory ``path`` (see ``package.save``); returns it. Its
        stages go where the export's do (``reporter``)."""
        from fxpass.aot.package import save

        return save({"main": self.lowered}, self.options, path, progress=reporter(progress))


def export_options(options: dict[str, Any] | None, device: Any = None) -> Options:
    """The backend's options, validated, for a program that must stand alone."""
    opts = from_options(options, device)
    return opts.replace(cache=False, exporting=True, **(
        {"tiered": False} if "tiered" in opts.get_device().option_names() else {}))


def export(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    options: dict[str, Any] | None = None,
    calibration: Sequence[Any] | None = None,
    progress: Progress | None = None,
    device: Any = None,
) -> Program:
    """Export ``model(*args, **kwargs)`` through ``device``'s pipeline, ahead of time.

    ``device`` names an installed device (``"ort"``, ``"bpu"``; or ``options["device"]``).
    ``options`` are the backend's (``torch.compile(..., options=...)``); the artifact cache and
    tiered sessions do not apply (a package holds every region's model itself). Shapes are
    those of ``args``/``kwargs``: the program refuses other shapes with a clear error.
    Quantized regions (``quantize``, or a device that always quantizes, such as a board) need
    ``calibration``: inputs shaped like ``args``/``kwargs``, as ``calibrate()`` takes them (a
    dict is keyword arguments, a tuple positional, a tensor the one argument).
    Each stage is logged to ``fxpass.export`` at INFO and passed to ``progress`` (module doc);
    a program with no region warns (:class:`NoRegionWarning`).
    """
    from fxpass.aot import quantized

    opts = export_options(options, device)
    batches = quantized.check_calibration(opts, calibration, "export()")
    if batches is not None:
        quantized.check_like(batches, tuple(args), dict(kwargs or {}), opts.get_device())
    say = reporter(progress)
    was_training = model.training
    model.eval()
    try:
        low = lower(model, tuple(args), dict(kwargs or {}), opts, say)
    finally:
        model.train(was_training)
    if low.state:
        raise ExportError(
            f"the model writes {sorted(low.state)} in place; export() takes models whose calls "
            "are pure functions of their inputs. A KV cache belongs to export_for_generate")
    warn_if_no_region("program", low.report, opts)
    program = Program(low, opts)
    if batches is not None:
        from fxpass.aot.batches import call

        quantized.calibrate([low], lambda b: call(program, b), batches, say)
    return program


@dataclass
class GenerateProgram:
    """What :func:`export_for_generate` returns: a prefill and a decode program over one
    static KV cache; ``save(path)`` it, then ``load(path).generate(...)``."""

    prefill: Lowered
    decode: Lowered
    options: Options
    generate: dict[str, Any]

    def save(self, path: str, *, progress: Progress | None = None) -> str:
        """Write the package directory ``path``; its stages go where the export's do."""
        from fxpass.aot.package import save

        return save({"prefill": self.prefill, "decode": self.decode}, self.options, path,
                    extra={"generate": self.generate}, progress=reporter(progress))


def export_for_generate(
    model: torch.nn.Module,
    *,
    max_cache_len: int,
    prefill_length: int,
    batch_size: int = 1,
    options: dict[str, Any] | None = None,
    calibration: Sequence[torch.Tensor] | None = None,
    calibration_tokens: int = 16,
    progress: Progress | None = None,
    device: Any = None,
) -> GenerateProgram:
    """Export a decoder-only HF model for generation: transformers' own static-cache module
    (``TorchExportableModuleWithStaticCache``: the cache as buffers it writes in place; with
    explicit positions where the model's own are data-dependent, ``static_cache``),
    exported twice through the device's pipeline: ``prefill`` takes ``prefill_length`` tokens,
    ``decode`` one. Both read and write the same cache (state shared by name in the package).
    Quantized regions need ``calibration``: prompts (``(batch_size, tokens)`` id tensors),
    each generated ``calibration_tokens`` tokens greedily, so prefill and decode regions
    both see real activations. Stages and a program without a region are reported as
    :func:`export` reports them.
    """
    try:
        import transformers.integrations.executorch  # noqa: F401
    except ImportError as e:  # a plain install has no transformers: name the extra
        raise ExportError(f"export_for_generate needs transformers ({e}); install it with "
                          'pip install "fxpass[demo]"') from None

    from fxpass.aot import quantized, static_cache

    for name, v, low in (("max_cache_len", max_cache_len, 2), ("prefill_length", prefill_length, 1),
                         ("batch_size", batch_size, 1)):
        if not isinstance(v, int) or v < low:
            raise ExportError(f"export_for_generate: {name} must be an int >= {low}, got {v!r}")
    if prefill_length > max_cache_len:
        raise ExportError(f"export_for_generate: prefill_length {prefill_length} is longer than "
                          f"the cache ({max_cache_len}); choose prefill_length <= max_cache_len")
    opts = export_options(options, device)
    prompts = quantized.check_calibration(opts, calibration, "export_for_generate()")
    say = reporter(progress)
    gc = model.generation_config
    saved = (gc.cache_implementation, gc.use_cache, model.training)
    gc.cache_implementation, gc.use_cache = "static", True
    model.eval()
    def trace(wrapper: torch.nn.Module) -> dict[str, Lowered]:
        progs = {}
        for name, length in (("prefill", prefill_length), ("decode", 1)):
            say(f"{name} program ({length} token(s) x batch {batch_size})")
            ids = torch.zeros(batch_size, length, dtype=torch.long)
            kw = {"input_ids": ids, "cache_position": torch.arange(length)}
            check = static_cache.same_elsewhere(wrapper, kw, max_cache_len)
            progs[name] = lower(wrapper, (), kw, opts, say, check)
            # the rotary tables, the mask and the write index depend on the position alone
            progs[name].memo = _leaf_index(((), kw), "cache_position")
        return progs

    try:
        progs = static_cache.programs(model, batch_size, max_cache_len, trace, say)
    finally:
        gc.cache_implementation, gc.use_cache = saved[0], saved[1]
        model.train(saved[2])
    pre, dec = progs["prefill"], progs["decode"]
    if {k: tuple(t.shape) for k, t in pre.state.items()} != {
            k: tuple(t.shape) for k, t in dec.state.items()} or not pre.state:
        raise ExportError(
            f"export_for_generate: the prefill and decode programs write different state "
            f"({sorted(pre.state)} against {sorted(dec.state)}); this model's cache is not the "
            "static cache transformers' export module makes")
    for name, low in progs.items():
        warn_if_no_region(f"{name} program", low.report, opts)
    ids = getattr(gc, "eos_token_id", None)
    meta = {
        "max_cache_len": max_cache_len,
        "prefill_length": prefill_length,
        "batch_size": batch_size,
        "eos_token_id": [ids] if isinstance(ids, int) else list(ids or []),
        "pad_token_id": getattr(gc, "pad_token_id", None),
        "model": type(model).__name__,
    }
    if prompts is not None:
        runner = quantized.generate_runner(pre, dec, meta)
        room = max_cache_len - max(p.shape[-1] for p in prompts)
        if room < 1:
            raise ExportError("export_for_generate: a calibration prompt fills the whole cache; "
                              "give shorter prompts")
        n = min(calibration_tokens, room)
        quantized.calibrate([pre, dec], lambda ids: runner.generate(ids, max_new_tokens=n),
                            prompts, say)
    return GenerateProgram(pre, dec, opts, meta)
