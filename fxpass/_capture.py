"""Capture the aten inference graph(s) torch.compile would hand a backend, with weights marked.

Dynamo -> AOTAutograd (inference) gives aten GraphModules whose placeholders include the
model's parameters and buffers. Those are marked ``meta['fxpass_frozen'] = tensor`` so rules
may treat them as constants (constant folding of weight casts, rotary tables, ...). Used by
the tests, ``fxpass explain`` and the benchmarks; the backend does the same inside Dynamo.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule

from .graph import FROZEN, FROZEN_BUFFER, FROZEN_VERSION


@dataclass
class Captured:
    gm: GraphModule
    inputs: list[torch.Tensor]  # real tensors for every placeholder, in order
    frozen: list[bool]  # whether placeholder i is a parameter or buffer


_WEIGHT_SOURCE = re.compile(r"\._(parameters|buffers)\[")


def _guard_source(ph: torch.fx.Node) -> str:
    """A Dynamo graph input's guard source (``L['self']._modules['l']._parameters['weight']``),
    or "" where it has none."""
    ga = ph.meta.get("grapharg")
    name = ga.source.name if ga is not None and getattr(ga, "source", None) else ""
    return name() if callable(name) else str(name)


def weight_inputs(dynamo_gm: GraphModule, example_inputs: Sequence[Any]) -> list[bool]:
    """Which Dynamo graph inputs are parameters/buffers (by their guard source)."""
    out = []
    phs = dynamo_gm.graph.find_nodes(op="placeholder")
    for ph, ex in zip(phs, example_inputs, strict=False):
        name = _guard_source(ph)
        # the attribute access of a module's parameter/buffer dict, not a substring of a name:
        # an argument called `frame_buffers` is data, not a weight
        out.append(isinstance(ex, torch.nn.Parameter) or bool(_WEIGHT_SOURCE.search(name)))
    return out


#: placeholder meta: the model attribute a frozen weight came from (``layers.0.q_proj.weight``)
SOURCE = "fxpass_source"
_KEY = re.compile(r"\[['\"]([^'\"]+)['\"]\]|\.([A-Za-z_]\w*)")
_CONTAINERS = {"_modules", "_parameters", "_buffers", "self", "L"}


def source_names(dynamo_gm: GraphModule) -> list[str]:
    """Each Dynamo graph input's model path (``layers.0.self_attn.q_proj.weight``), from its
    guard source (``L['self']._modules['layers']...``); "" where it has none. For messages:
    a warning names the weight the user knows, not ``arg13_1``."""
    out = []
    for ph in dynamo_gm.graph.find_nodes(op="placeholder"):
        parts = [a or b for a, b in _KEY.findall(_guard_source(ph))]
        out.append(".".join(p for p in parts if p not in _CONTAINERS))
    return out


def mutated_inputs(gm: GraphModule) -> set[str]:
    """Placeholders the graph writes (the destination of an in-place op such as the
    ``copy_`` AOTAutograd keeps for an input mutation, directly or through views of it)."""
    out = set()
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            dst = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
            while (isinstance(dst, torch.fx.Node) and dst.op == "call_function"
                   and getattr(dst.target, "is_view", False) and dst.args):
                dst = dst.args[0]  # a write through a view writes its base
            if isinstance(dst, torch.fx.Node) and dst.op == "placeholder":
                out.add(dst.name)
    return out


def mark_frozen(
    gm: GraphModule, real: Sequence[Any], frozen: Sequence[bool],
    names: Sequence[str] | None = None,
) -> int:
    """Attach the real weight tensors to the AOT graph's placeholders; returns how many.

    A buffer the graph itself writes (a KV cache or a step counter kept in the module, as in
    gpt-fast) is state, not a weight: it stays an ordinary input. Frozen, every call would
    find it changed and recompile."""
    phs = gm.graph.find_nodes(op="placeholder")
    if len(phs) != len(real):
        return 0  # inputs were deduplicated or synthesized: do not guess
    written = mutated_inputs(gm)
    names = list(names) if names is not None and len(names) == len(phs) else [""] * len(phs)
    n = 0
    for ph, t, f, name in zip(phs, real, frozen, names, strict=True):
        if f and isinstance(t, torch.Tensor) and ph.name not in written:
            ph.meta[FROZEN] = t.detach()
            ph.meta[FROZEN_VERSION] = version_of(t)
            if not isinstance(t, torch.nn.Parameter):
                ph.meta[FROZEN_BUFFER] = True
            if name:
                ph.meta[SOURCE] = name
            n += 1
    return n


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter (None for an inference tensor, which has none)."""
    return None if t.is_inference() else t._version


def aot_backend(
    fw: Callable[[GraphModule, list, list[bool]], Callable], freeze: bool = True
) -> Callable:
    """A Dynamo backend running AOTAutograd and calling ``fw(aot_gm, real_inputs, frozen)``.

    ``freeze=False`` marks nothing: weights stay ordinary graph inputs (never baked in)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def backend(gm: GraphModule, example_inputs: list) -> Callable:
        frozen = weight_inputs(gm, example_inputs) if freeze else [False] * len(example_inputs)
        names = source_names(gm)

        def fw_compiler(aot_gm: GraphModule, _aot_inputs: list) -> Callable:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():  # the real weights, not Dynamo's fakes
                mark_frozen(aot_gm, example_inputs, frozen, names)
                return make_boxed_func(fw(aot_gm, list(example_inputs), frozen))

        return aot_autograd(fw_compiler=fw_compiler, keep_inference_input_mutations=True)(
            gm, example_inputs
        )

    return backend


def capture_graphs(fn: Callable, *args: Any, **kwargs: Any) -> list[Captured]:
    """Like :func:`capture`, with each graph's real inputs and which of them are weights."""
    out: list[Captured] = []

    def fw(gm: GraphModule, real: list, frozen: list[bool]) -> Callable:
        out.append(Captured(gm, real, frozen))
        return gm.forward

    compiled = torch.compile(fn, backend=aot_backend(fw), dynamic=False)
    with torch.no_grad():
        compiled(*args, **kwargs)
    return out


def capture(model: Callable, *args: Any, **kwargs: Any) -> list[GraphModule]:
    """The aten inference graphs ``torch.compile`` hands a backend for ``model(*args, **kwargs)``.

    This is the supported way to get graphs for ``PassManager.run``: every node carries a
    ``meta["val"]`` fake tensor from one shared fake mode (``make_fx`` on a module gives each
    node its own, which the rewriter cannot mix), parameters and buffers are placeholders marked
    as frozen weights (``meta["fxpass_frozen"]``), and in-place input updates (a KV cache) stay
    in the graph as ``copy_``. Static shapes (``dynamic=False``), no grad. One graph per Dynamo
    graph (a graph break gives several). ``gm.meta["fxpass_example_inputs"]`` holds the real
    inputs, in placeholder order, to run it with.
    """
    graphs = []
    for c in capture_graphs(model, *args, **kwargs):
        c.gm.meta["fxpass_example_inputs"] = c.inputs
        graphs.append(c.gm)
    return graphs


def frame_writes_nothing() -> bool:
    """Whether the frame Dynamo is compiling now (call from inside a backend) leaves every
    Python object that existed before the call as it found it: no attribute or container
    written to a new value, no tensor hook. False when unsure (another torch's internals).

    Why: a compiled frame is a graph call plus the Python effects Dynamo replays around it.
    A decode step replayed by calling the graph alone (``fxpass.hf.replay``) skips those
    effects, so it may only replay frames that have none. Two kinds are no-ops and pass:
    writes to the frame's own ``**kwargs`` dict (a new dict each call) and attributes
    written back to the value they had (transformers' output collector sets and resets two
    flags on every forward)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.variables.base import AttributeMutationNew, ValueMutationNew

        tx = InstructionTranslator.current_tx()
        effects = tx.output.side_effects
        if effects.tensor_hooks or effects.save_for_backward:
            return False
        own_kwargs = _var_keyword(tx.f_code)
        for v in effects.id_to_variable.values():
            if not effects.is_modified(v) or isinstance(
                    v.mutation_type, AttributeMutationNew | ValueMutationNew):
                continue
            source = getattr(v, "source", None)
            writes = effects.store_attr_mutations.get(v)
            if own_kwargs and not writes and type(source).__name__ == "LocalSource" and (
                    getattr(source, "local_name", None) == own_kwargs):
                continue
            if not writes or not hasattr(v, "value") or not all(
                    _unchanged(v.value, name, vt) for name, vt in writes.items()):
                return False
        return True
    except Exception:  # noqa: BLE001 - Dynamo's private internals; unknown means "not pure"
        return False


def _var_keyword(code: Any) -> str | None:
    """The name of ``code``'s ``**kwargs`` parameter, if it has one."""
    import inspect

    if not code.co_flags & inspect.CO_VARKEYWORDS:
        return None
    n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)
    return code.co_varnames[n]


_MISSING = object()


def _unchanged(obj: Any, name: str, vt: Any) -> bool:
    """Whether Dynamo's pending write of ``vt`` to ``obj.name`` writes the value it has now
    (plain constants only)."""
    if not vt.is_python_constant():
        return False
    new, old = vt.as_python_constant(), getattr(obj, name, _MISSING)
    plain = (type(None), bool, int, float, str)
    return isinstance(new, plain) and type(old) is type(new) and old == new
