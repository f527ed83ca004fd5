"""Decode steps replayed: the step's compiled graph called directly, without Dynamo's frame.

Why: a trusted decode step (``fxpass.hf.steps``) still enters Dynamo's frame: the frame's
bytecode fetches every parameter the graph reads from the module tree, checks the guards that
tell graphs apart, runs AOTAutograd's wrapper, and builds the output object. Right after a
region has streamed the weights through the caches, replaying instead saved 0.08-0.45 ms per
token on Qwen3 and Llama 4 x 512 over five runs of ``benchmarks.probes.replay`` (a package
step spends 0.24 ms outside its region).
A package's runner calls its graph with arguments it holds; a replayed step does the same.

A plan is learned from two consecutive decode steps of one quiet ``generate()`` call with the
same signature, each run through Dynamo with nothing compiled, each running exactly one
guarded graph (``fxpass.jit.held``'s tap) whose frame writes no Python state
(``GuardedGraph.pure``). Each argument of that graph must be either the same object in both
steps (a weight, a cache buffer, a position tensor updated in place) or found by identity in
the step's keyword arguments (the new token's ids, the masks' dict); each field of the
output either one of the graph's outputs, a keyword argument (the cache) or the same object
in both steps. Anything else, and there is no plan: the steps stay trusted ones.

A replayed step calls the same guarded graph, whose weight guard runs unless the call is
quiet (where a trusted step skips it too), so what it can miss is what a trusted step of a
quiet call can miss (``fxpass.hf.steps``, ``fxpass.hf.quiet``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fxpass.jit.held import HELD

#: how deep to look for a keyword argument's tensors (HF passes the masks in a dict)
DEPTH = 2


def watched(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``fn(*args, **kwargs)`` and the one guarded graph call it made, as (graph, arguments,
    outputs), or None when it made none or several, or when the call left torch's grad or
    inference mode changed (an effect of the frame that Dynamo keeps out of its side
    effects: calling the graph alone would not make it)."""
    outer, modes = HELD.tap, _modes()
    HELD.tap = tap = []
    try:
        out = fn(*args, **kwargs)
    finally:
        HELD.tap = outer
    return out, (tap[0] if len(tap) == 1 and _modes() == modes else None)


def _leaves(kwargs: dict[str, Any]) -> dict[int, tuple | None]:
    """id -> path of every tensor and object among ``kwargs`` (dicts, lists and tuples looked
    into, :data:`DEPTH` deep); None for an object found at two paths (which of them a later
    step's argument follows is unknown)."""
    found: dict[int, tuple | None] = {}

    def walk(v: Any, path: tuple) -> None:
        found[id(v)] = None if id(v) in found else path
        if len(path) < DEPTH:
            items = v.items() if type(v) is dict else enumerate(v) if type(v) in (
                list, tuple) else ()
            for k, x in items:
                walk(x, (*path, k))

    for k, v in kwargs.items():
        walk(v, (k,))
    return found


def _modes() -> tuple[bool, bool]:
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def _at(kwargs: dict[str, Any], path: tuple) -> Any:
    v = kwargs[path[0]]
    for k in path[1:]:
        v = v[k]
    return v


class Plan:
    """How to run one decode step without Dynamo: the guarded graph, its arguments (the
    constant ones held, the others picked from the step's keyword arguments) and how to
    build the forward's return value from the graph's outputs."""

    def __init__(self, graph: Any, args: list[Any], picks: list[tuple[int, tuple]],
                 build: Callable[[tuple, dict[str, Any]], Any], modes: tuple[bool, bool]):
        self.graph, self.args, self.picks, self.build = graph, args, picks, build
        self.modes = modes  # torch's grad and inference modes when learned

    @classmethod
    def learn(cls, before: tuple, now: tuple, kwargs: dict[str, Any]) -> Plan | None:
        """A plan from two steps' (graph call, forward output) (:func:`watched`), ``kwargs``
        the second step's keyword arguments; None where one argument or output field is
        neither constant nor found (module docstring)."""
        (graph, args, outs), result = now
        (graph0, args0, _), result0 = before
        if graph is not graph0 or not graph.pure:  # (one graph: the same arity)
            return None
        leaves = _leaves(kwargs)
        picks, held = [], list(args)
        for i, (a, a0) in enumerate(zip(args, args0, strict=True)):
            if not isinstance(a, torch.Tensor):  # a symbolic int: a value the guards watch
                return None
            if id(a) in leaves:
                if leaves[id(a)] is None:
                    return None
                picks.append((i, leaves[id(a)]))
            elif a is not a0:
                return None
        build = _builder(result, result0, outs, leaves)
        if build is None:
            return None
        return cls(graph, held, picks, build, _modes())

    def fits(self) -> bool:
        """Whether this step runs under the grad and inference modes the plan was learned
        under (Dynamo guards both; nothing of the caller's runs between two steps of a quiet
        call to change them, but a nested call could)."""
        return _modes() == self.modes

    def __call__(self, kwargs: dict[str, Any], hold: bool) -> Any:
        """The step: the graph called with this step's arguments (``hold``: its weight guard
        skipped, as on a trusted step of a quiet call), its outputs made the forward's."""
        args = list(self.args)
        for i, path in self.picks:
            args[i] = _at(kwargs, path)
        HELD.on = hold
        try:
            outs = self.graph(*args)
        finally:
            HELD.on = False
        return self.build(outs, kwargs)


def _builder(result: Any, result0: Any, outs: Any, leaves: dict[int, tuple | None]
             ) -> Callable[[tuple, dict[str, Any]], Any] | None:
    """How to make a forward's return value like ``result`` (a transformers ``ModelOutput``
    or a tuple) from a step's graph outputs and keyword arguments; None if some field is not
    a graph output, a keyword argument or the same object as in ``result0``."""
    from transformers.utils import ModelOutput

    if isinstance(result, ModelOutput) and type(result0) is type(result):
        items = list(result.items())
        old = dict(result0.items())
    elif type(result) is tuple and type(result0) is tuple and len(result) == len(result0):
        items, old = list(enumerate(result)), dict(enumerate(result0))
    else:
        return None
    by_id = {id(o): j for j, o in enumerate(outs)}
    fields: list[tuple[Any, str, Any]] = []
    for k, v in items:
        if id(v) in by_id:
            fields.append((k, "out", by_id[id(v)]))
        elif leaves.get(id(v)) is not None and len(leaves[id(v)]) == 1:
            fields.append((k, "kw", leaves[id(v)][0]))
        elif k in old and old[k] is v:
            fields.append((k, "same", v))
        else:
            return None
    kind = type(result)

    def build(outs: tuple, kwargs: dict[str, Any]) -> Any:
        vals = [(k, outs[x] if how == "out" else kwargs[x] if how == "kw" else x)
                for k, how, x in fields]
        return tuple(v for _, v in vals) if kind is tuple else kind(**dict(vals))

    return build
