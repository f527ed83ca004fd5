"""A compiled graph that pickles, for ``torch.compile(...).aot_compile`` (``precompile``).

``torch.compile`` traces a model again in every new process (Dynamo, then AOTAutograd) even
when every region comes from the cache: on a 4x512 decoder that trace is most of a warm start.
torch's ahead-of-time capture saves the trace itself (Dynamo's bytecode and guards,
AOTAutograd's runtime wrappers) when the backend returns an ``OutputCode`` that can be
pickled. :class:`CompiledGraph` is that ``OutputCode``: it holds the aten graph and which
inputs are weights (no weights, no options, no compiled regions), and builds its runner at
its first call, when the real weights arrive, with the caller's options; the regions then
come from the artifact cache (local, remote or a bundle), verified as always.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch._inductor.output_code import OutputCode
from torch.fx import GraphModule

from fxpass._capture import mark_frozen, source_names, weight_inputs
from fxpass.jit.options import Options

#: node meta the pipeline reads after capture; the rest (module stacks, sources) is dropped
KEEP_META = ("val", "tensor_meta", "stack_trace")


def _dump_graph(gm: GraphModule) -> bytes:
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx._graph_pickler import Options as PickleOptions

    g = _strip(gm)
    return GraphPickler.dumps(g, PickleOptions(ops_filter=None))


def _strip(gm: GraphModule) -> GraphModule:
    from fxpass.jit.backend import _clone

    g = _clone(gm)
    for n in g.graph.nodes:
        for k in list(n.meta):
            if k not in KEEP_META:
                del n.meta[k]
    return g


def _load_graph(blob: bytes) -> GraphModule:
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    gm = GraphPickler.loads(blob, FakeTensorMode(shape_env=ShapeEnv()))
    if not isinstance(gm, GraphModule):
        raise TypeError(f"a precompiled fxpass graph holds {type(gm).__name__}, not a graph")
    gm.recompile()
    return gm


#: the options of the ``Precompiled`` calling in (``precompile.py``): a loaded graph compiles
#: with its caller's options (cache directory, remote tier, threads), never those of the
#: process that traced it, which the entry does not keep
CURRENT: ContextVar[Options | None] = ContextVar("fxpass_precompiled_options", default=None)


class CompiledGraph(OutputCode):
    """One AOT graph compiled for a device, lazily: its runner is built at the first call,
    with the options of the ``Precompiled`` calling it (:data:`CURRENT`).

    Called by AOTAutograd with its inputs as a list (boxed) or, before serialization, one by
    one; both reach the same runner."""

    _boxed_call = True

    def __init__(self, aot_gm: GraphModule | None, frozen: list[bool], names: list[str]) -> None:
        self.gm = aot_gm
        self.blob: bytes | None = None
        self.frozen, self.names = list(frozen), list(names)
        self.run: Callable | None = None

    def _runner(self, inputs: Sequence[Any]) -> Callable:
        from fxpass.jit.backend import runner

        opts = CURRENT.get()
        if opts is None:
            raise RuntimeError("a precompiled fxpass graph runs through fxpass.precompile(model, "
                               "device, options), which gives it its options")
        if self.gm is None:
            assert self.blob is not None
            self.gm = _load_graph(self.blob)
        opts.get_device().prepare(opts.dev)
        with torch.no_grad():
            if opts.freeze_weights:
                mark_frozen(self.gm, list(inputs), self.frozen, self.names)
            return runner(self.gm, opts)

    def __call__(self, *args: Any) -> Any:
        inputs = args[0] if len(args) == 1 and isinstance(args[0], list) else list(args)
        if self.run is None:
            self.run = self._runner(inputs)
        return self.run(*inputs)

    def prepare_for_serialization(self) -> None:
        """Nothing to do: the pickled state is the graph, not the runner."""

    def post_compile(self, example_inputs: Any, constants: Any, graph_kwargs: Any) -> None:
        """Nothing to do: the runner is built at the first call, from the real weights."""

    def set_triton_bundle(self, triton_bundle: Any) -> None:  # pragma: no cover - no triton
        """No triton kernels here."""

    def __deepcopy__(self, memo: dict) -> CompiledGraph:
        return self  # read-only once built; AOTAutograd deep-copies its cache entries

    def __getstate__(self) -> dict:
        blob = self.blob if self.gm is None else _dump_graph(self.gm)
        return {"blob": blob, "frozen": self.frozen, "names": self.names}

    def __setstate__(self, state: dict) -> None:
        self.__init__(None, state["frozen"], state["names"])
        self.blob = state["blob"]


def backend() -> Callable:
    """A Dynamo backend for ``aot_compile``: AOTAutograd, then a :class:`CompiledGraph`. The
    trace depends on no fxpass option: which inputs are weights is recorded, and whether they
    are frozen is the caller's ``freeze_weights`` at the first call."""
    from torch._dynamo.backends.common import aot_autograd

    def compile_fn(gm: GraphModule, example_inputs: list) -> Callable:
        frozen, names = weight_inputs(gm, example_inputs), source_names(gm)

        def fw_compiler(aot_gm: GraphModule, _inputs: list) -> CompiledGraph:
            return CompiledGraph(aot_gm, frozen, names)

        return aot_autograd(fw_compiler=fw_compiler, keep_inference_input_mutations=True)(
            gm, example_inputs)

    compile_fn.__name__ = "fxpass_precompiled"
    return compile_fn
