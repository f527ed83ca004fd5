"""``pattern_from(fn, examples)``: a pattern written as the PyTorch function it matches.

Why: a pattern spelled as a ``P`` tree is the aten graph written out by hand, and the hand
gets what aten does wrong (``x ** 2`` is ``pow.Tensor_Scalar``, ``mean`` has a ``dtype=``, a
bf16 model casts around the norm). Inductor's ``register_replacement`` and onnxscript's
pattern functions trace an example instead; so does this:

- ``fn``'s tensor parameters become ``Var``s of their names; parameters named in ``nums``
  become ``Num``s (traced with a sentinel value that must reach the graph as a constant);
- the trace (``make_fx`` on fake copies of the examples, :func:`fxpass.tracing.trace`) is
  normalized by the node rules of the caller's ``target`` (or by ``rules``), so that it is the
  form the rules leave in a real graph: ``x ** 2``, ``x ** 2.0`` and ``x * x`` all become one
  spelling where a canonical rule exists. The core names no backend, so there is no default;
- the trace and its normalization run under :func:`fxpass.tracing.clean_mode`: a plugin module
  calling ``pattern_from`` builds the same pattern whether it is first imported at top level or
  inside ``torch.compile`` (where Dynamo's fake mode would otherwise be picked up);
- several examples (other shapes, other dtypes) are traced and merged: constants that differ
  become ``ANY`` (the pattern is shape-generic where the function is), graphs that differ
  become alternatives (``Or``): a bf16 trace with its casts beside the float32 one;
- an intermediate value used twice inside the pattern is named, so both uses must be the
  same node (``P(name=...)`` bound twice).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node

from .matching import ANY, Num, Or, P, Var
from .tracing import clean_mode, trace

#: sentinel values for ``Num`` parameters: odd enough never to occur in a function by chance
_SENTINEL = 0.7853981633974483  # pi / 4


def _trace(fn: Callable, names: list[str], nums: Sequence[str],
           example: Sequence[torch.Tensor]) -> tuple[GraphModule, dict[float, str]]:
    sentinels = {_SENTINEL + 1e-3 * i: n for i, n in enumerate(nums)}
    by_name = {n: v for v, n in sentinels.items()}
    tensor_names = [n for n in names if n not in nums]
    if len(example) != len(tensor_names):
        raise TypeError(f"pattern_from: {fn.__name__} takes tensors {tensor_names} (and numbers "
                        f"{list(nums)}), an example gave {len(example)} tensor(s)")

    def call(*ts: torch.Tensor) -> Any:
        kw = dict(zip(tensor_names, ts, strict=True))
        kw.update({n: by_name[n] for n in nums})
        return fn(**kw)

    return trace(call, *example), sentinels


def _normalize(gm: GraphModule, target: str | None, rules: Iterable[Any] | None) -> None:
    # imported here: the pass manager and the plugin registry are only needed to normalize
    from .passmanager import PassManager
    from .plugins import select_rules

    chosen = list(rules) if rules is not None else [
        r for r in select_rules(target=target) if not r.graph_level]
    if chosen:
        PassManager(chosen).run(gm)


def _tree(gm: GraphModule, names: list[str], sentinels: dict[float, str]) -> Any:
    phs = gm.graph.find_nodes(op="placeholder")
    leaf = {p: Var(n) for p, n in zip(phs, [n for n in names if n not in sentinels.values()],
                                      strict=True)}
    (out,) = gm.graph.find_nodes(op="output")
    roots = out.args[0]
    roots = list(roots) if isinstance(roots, (tuple, list)) else [roots]
    if len(roots) != 1 or not isinstance(roots[0], Node):
        raise TypeError("pattern_from: the function must return one tensor; for several "
                        "outputs write fxpass.pattern.Multi(p0, p1, ...) of one pattern each")
    inside = {n for n in gm.graph.nodes if n.op == "call_function"}
    shared = {n for n in inside if sum(u in inside for u in n.users) > 1}
    seen_num: set[str] = set()

    def conv(a: Any) -> Any:
        if isinstance(a, Node):
            if a in leaf:
                return leaf[a]
            if a.op != "call_function":
                raise TypeError(f"pattern_from: node {a.name} ({a.op}) cannot be in a pattern")
            args = tuple(conv(x) for x in a.args)
            kwargs = {k: conv(v) for k, v in a.kwargs.items()}
            return P(a.target, *args, name=f"_{a.name}" if a in shared else None, **kwargs)
        if isinstance(a, float) and a in sentinels:
            seen_num.add(sentinels[a])
            return Num(sentinels[a])
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        return a

    tree = conv(roots[0])
    missing = set(sentinels.values()) - seen_num
    if missing:
        raise TypeError(f"pattern_from: number(s) {sorted(missing)} never reach the graph as a "
                        "constant (computed with before use?); use them directly in an op, or "
                        "make them tensors")
    if not isinstance(tree, P):
        raise TypeError("pattern_from: the function returns an input unchanged: no op to match")
    return tree


def _merge(a: Any, b: Any) -> Any:
    """One pattern for two traces: equal parts kept, differing constants ANY, differing
    structure alternatives."""
    if repr(a) == repr(b):
        return a
    if isinstance(a, P) and isinstance(b, P):
        if (a.targets == b.targets and len(a.args) == len(b.args)
                and set(a.kwargs) == set(b.kwargs) and a.name == b.name):
            args = tuple(_merge(x, y) for x, y in zip(a.args, b.args, strict=True))
            kwargs = {k: _merge(a.kwargs[k], b.kwargs[k]) for k in a.kwargs}
            return P(a.targets, *args, name=a.name, **kwargs)
        return Or(a, b)
    if isinstance(a, Or):
        if any(repr(x) == repr(b) for x in a.alternatives):
            return a
        return Or(*a.alternatives, b)
    if isinstance(a, (Var, Num)) or isinstance(b, (Var, Num, P)):
        return Or(a, b) if isinstance(a, P) or isinstance(b, P) else a
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return type(a)(_merge(x, y) for x, y in zip(a, b, strict=True))
    return ANY  # a constant that differs between examples (a size): any value


def pattern_from(
    fn: Callable[..., torch.Tensor],
    *examples: Sequence[torch.Tensor],
    nums: Sequence[str] = (),
    target: str | None = None,
    rules: Iterable[Any] | None = None,
) -> P | Or:
    """The aten pattern of ``fn`` traced on ``examples`` (each a tuple of tensors, one per
    tensor parameter of ``fn``), normalized by ``target``'s node rules (or by ``rules``).

    One of ``target`` and ``rules`` is required: the pattern must be in the form the rules that
    run before it leave, and only the caller knows which those are (``rules=[]``: the raw
    trace). ``target=`` loads the plugin registry; called while a plugin module imports, that
    registry has every plugin but the importing one (:mod:`fxpass.plugins`): right for a
    third-party rule normalized by another plugin's target, not for a built-in rule, whose own
    package is then the missing plugin (``rules/rms_norm.py`` passes ``rules=``)."""
    if not examples:
        raise TypeError("pattern_from needs at least one example: a tuple of tensors")
    if (target is None) == (rules is None):
        raise TypeError(
            "pattern_from needs exactly one of target= (the target whose node rules normalize "
            "the trace, e.g. target='ort') and rules= (those rules themselves; rules=[] for the "
            f"raw trace); got target={target!r}, rules={rules!r}")
    names = list(inspect.signature(fn).parameters)
    unknown = [n for n in nums if n not in names]
    if unknown:
        raise TypeError(f"pattern_from: nums {unknown} are not parameters of {fn.__name__} "
                        f"({names})")
    merged: Any = None
    for ex in examples:
        ex = (ex,) if isinstance(ex, torch.Tensor) else tuple(ex)
        with clean_mode():  # the rules' fake-tensor work too, not only the trace
            gm, sentinels = _trace(fn, names, nums, ex)
            _normalize(gm, target, rules)
        tree = _tree(gm, names, sentinels)
        merged = tree if merged is None else _merge(merged, tree)
    return merged
