"""Two referees for what the fp64 referee (``benchmarks.fuzz.check``) leaves: overflow and
conditioning.

Both ask a question about *eager's* answer, not about fxpass's, and both are decided per
finding by running the program again, never by looking at fxpass's value:

* **Order-dependent overflow.** A sum whose positive terms (or negative terms) add up past the
  dtype's maximum overflows in *some* summation order and not in others; an intermediate
  whose exact value is beyond the dtype's range is Inf in one precision and finite in
  another (bf16 rounds where f32 does not). Which results are then finite, Inf or NaN depends
  on the kernel's order and precision (eager's MKL, onnxruntime's MLAS, the BPU's MAC array),
  so eager's answer is one of several equally valid ones. An output counts here only if it is
  downstream of such a step, found on the exact (float64) run of the program with
  ``benchmarks.fuzz.programs.SUM_TERMS``. An elementwise op that is simply wrong on a huge value
  (``hardswish(3e38)``) does not qualify: its exact result is in range and it sums nothing.
* **Ill-conditioned.** Eager's own result moves beyond the tolerance when every float input
  moves by one unit in the last place (``nextafter`` up, then down): the answer is not
  determined by the inputs at that precision (``cos`` of a value near 1e10, reached from a
  subnormal through ``rsqrt``). Only the elements that move count, element by element.

What these accept is counted and listed apart (``overflow_order``, ``ill_conditioned``),
never folded into the passes. The guarantee they bound is stated in docs/failure-model.md.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.fuzz.check import flat, unaccepted
from benchmarks.fuzz.programs import OPS, SUM_TERMS, Program


def _f64(t: Any) -> Any:
    return t.double() if isinstance(t, torch.Tensor) and t.dtype.is_floating_point else t


def _beyond(v: torch.Tensor, dtype: torch.dtype) -> bool:
    """Any finite float64 value past ``dtype``'s finite range."""
    v = v[torch.isfinite(v)]
    return bool(v.numel()) and bool((v.abs() > torch.finfo(dtype).max).any())


def overflowing_outputs(prog: Program, inputs: list, weights: list) -> set[int]:
    """Output positions downstream of a step whose exact result, or whose sum's positive or
    negative terms, leave the range of the dtype eager computes that step in."""
    vals = list(inputs)
    exact = [_f64(t) for t in inputs]
    w64 = [_f64(t) for t in weights]
    tainted = [False] * len(inputs)
    with torch.no_grad():
        for s in prog.steps:
            fn = OPS[s.op][1]
            out = fn([vals[i] for i in s.args], s.param, weights)
            param = (torch.float64 if isinstance(s.param, torch.dtype)
                     and s.param.is_floating_point else s.param)
            ex = fn([exact[i] for i in s.args], param, w64)
            hit = any(tainted[i] for i in s.args)
            if not hit and out.dtype.is_floating_point:
                hit = _beyond(ex, out.dtype)
                if not hit and s.op in SUM_TERMS:
                    terms = SUM_TERMS[s.op]([exact[i] for i in s.args], param, w64)
                    terms = terms.masked_fill(~torch.isfinite(terms), 0.0)
                    hit = _beyond(terms.clamp(min=0).sum(-1), out.dtype) or _beyond(
                        terms.clamp(max=0).sum(-1), out.dtype)
            vals.append(out)
            exact.append(ex)
            tainted.append(hit)
    return {k for k, v in enumerate(prog.outputs) if tainted[v]}


def unstable_elements(case: Program | torch.fx.GraphModule, inputs: list, weights: list,
                      expected: Any) -> list[torch.Tensor] | None:
    """Per output, the elements of eager's result that move beyond the tolerance when every
    float input moves one ULP (up, or down); None if the perturbed case does not run."""
    moved: list[torch.Tensor] | None = None
    for direction in (torch.inf, -torch.inf):
        nudged = [torch.nextafter(t, torch.full_like(t, direction))
                  if t.dtype.is_floating_point else t.clone() for t in inputs]
        try:
            with torch.no_grad():
                outs = flat(_run(case, nudged, weights))
        except Exception:  # noqa: BLE001 - no verdict
            return None
        masks = [unaccepted(e, o, None) for e, o in zip(flat(expected), outs, strict=True)]
        moved = masks if moved is None else [m | n for m, n in zip(moved, masks, strict=True)]
    return moved


def _run(case: Program | torch.fx.GraphModule, inputs: list, weights: list) -> Any:
    from benchmarks.fuzz.programs import run

    if isinstance(case, Program):
        return run(case, inputs, weights)
    return copy.deepcopy(case)(*inputs)


def explain(case: Program | torch.fx.GraphModule, inputs: list, weights: list, expected: Any,
            got: Any, ref: Any) -> str | None:
    """``"overflow_order"`` or ``"ill_conditioned"`` if every element fxpass gets wrong is in
    an output (overflow) or at an element (conditioning) where eager's own answer is not
    determined; None otherwise (a real mismatch)."""
    exp, act = flat(expected), flat(got)
    refs = flat(ref) if ref is not None else [None] * len(exp)
    bad = []
    for i, (e, a, r) in enumerate(zip(exp, act, refs, strict=True)):
        if not (isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor)):
            return None
        if a.dtype != e.dtype or a.shape != e.shape:
            return None
        m = unaccepted(e, a, r if isinstance(r, torch.Tensor) else None)
        if bool(m.any()):
            bad.append((i, m))
    if not bad:
        return None
    over = (overflowing_outputs(case, inputs, weights) if isinstance(case, Program)
            else graph_overflowing_outputs(case, inputs))
    left = [(i, m) for i, m in bad if i not in over]
    if not left:
        return "overflow_order"
    moved = unstable_elements(case, inputs, weights, expected)
    if moved is not None and all(not bool((m & ~moved[i]).any()) for i, m in left):
        return "ill_conditioned" if len(left) == len(bad) else "overflow_order"
    return None


aten = torch.ops.aten


def _sdpa_terms(q: torch.Tensor, k: torch.Tensor, *rest: Any, scale: Any = None,
                **_: Any) -> torch.Tensor:
    """The products q_d * k_d * scale summed into each attention score (GQA heads repeated)."""
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return q.unsqueeze(-2) * k.unsqueeze(-3) * s


def _mm_terms(a: torch.Tensor, b: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    if a.dim() == 1 or b.dim() == 1:
        return a * b if a.dim() == b.dim() == 1 else (
            a.unsqueeze(-1) * b if a.dim() == 1 else a * b)
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).transpose(-1, -2)


def _all_terms(x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    return x.reshape(-1)  # conservative: every element could be one of the terms of a sum


#: Graph-level counterpart of ``benchmarks.fuzz.programs.SUM_TERMS``: aten op -> the terms it sums.
GRAPH_SUM_TERMS: dict[Any, Callable[..., torch.Tensor]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa_terms,
    aten._scaled_dot_product_attention_math.default: _sdpa_terms,
    aten.scaled_dot_product_attention.default: _sdpa_terms,
    aten.mm.default: _mm_terms, aten.bmm.default: _mm_terms, aten.matmul.default: _mm_terms,
    aten.sum.default: _all_terms, aten.sum.dim_IntList: _all_terms,
    aten.mean.default: _all_terms, aten.mean.dim: _all_terms,
    aten._softmax.default: _all_terms, aten._safe_softmax.default: _all_terms,
    aten._log_softmax.default: _all_terms, aten.logsumexp.default: _all_terms,
}


def graph_overflowing_outputs(gm: torch.fx.GraphModule, inputs: list) -> set[int]:
    """:func:`overflowing_outputs` for a traced aten graph: each node is run eagerly and in
    float64 (explicit casts in the graph still apply), and a node is tainted when its exact
    value, or the terms it sums (``GRAPH_SUM_TERMS``), leave its eager dtype's range."""
    eager = _node_values(gm, inputs)
    exact = _node_values(gm, [_f64(t) for t in inputs], exact=True)
    tainted: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n not in eager or n not in exact:
            continue
        if any(a in tainted for a in n.all_input_nodes):
            tainted.add(n)
            continue
        outs = [x for x in flat(eager[n]) if isinstance(x, torch.Tensor)]
        exs = [x for x in flat(exact[n]) if isinstance(x, torch.Tensor)]
        if not outs or len(outs) != len(exs) or not outs[0].dtype.is_floating_point:
            continue
        dtype = outs[0].dtype  # a tuple (SDPA's out, logsumexp): its first output's dtype
        hit = any(x.dtype.is_floating_point and _beyond(x, dtype) for x in exs)
        terms_of = GRAPH_SUM_TERMS.get(n.target)
        if not hit and terms_of is not None:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: exact.get(a))
            try:
                terms = terms_of(*args, **kwargs).double()
            except Exception:  # noqa: BLE001 - no verdict for this node
                terms = None
            if terms is not None:
                terms = terms.masked_fill(~torch.isfinite(terms), 0.0)
                hit = _beyond(terms.clamp(min=0).sum(-1), dtype) or _beyond(
                    terms.clamp(max=0).sum(-1), dtype)
        if hit:
            tainted.add(n)
    outs = flat(next(iter(gm.graph.find_nodes(op="output"))).args[0])
    return {i for i, o in enumerate(outs) if o in tainted}


def _node_values(gm: torch.fx.GraphModule, inputs: list, exact: bool = False) -> dict:
    """Every node's value, or {} if the graph does not run. ``exact``: every float value is
    carried in float64, including constants the graph makes in its own dtype (a bf16 mask)."""
    values: dict = {}

    class _Record(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            if exact:
                out = torch.utils._pytree.tree_map(_f64, out)
            values[n] = out
            return out

    try:
        with torch.no_grad():
            _Record(gm).run(*[t.clone() for t in inputs])
    except Exception:  # noqa: BLE001 - e.g. an op without a float64 kernel: no verdict
        return {}
    return values
