"""One fuzz case through the rules path and the backend path, with the outcome tallied.

Rules path: the program traced to an aten graph (``make_fx`` on fake tensors, so every node
has ``meta['val']``), all built-in rules run to fixpoint with contract checks on, the result
run on the real inputs. Backend path: ``torch.compile(module, backend="fxpass_bpu",
options={"min_compute_macs": 0})`` with the weights as frozen parameters. Both are compared
with the eager program on the same inputs (:mod:`benchmarks.fuzz.check`).
"""

from __future__ import annotations

import copy
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.fuzz.check import compare, equals_either
from benchmarks.fuzz.programs import Program, ProgramModule, materialize, run
from benchmarks.fuzz.referee import explain

#: Findings kept in full per category (the counts are always complete).
KEEP = 50


@dataclass
class Tally:
    tried: int = 0
    invalid: int = 0  # eager itself raised: not a finding
    rules_mismatch: int = 0
    rules_crash: int = 0
    backend_mismatch: int = 0
    backend_crash: int = 0
    precision: int = 0  # passed only by the fp64 referee
    eager_inconsistent: int = 0  # eager's own kernels disagree on this value (see below)
    overflow_order: int = 0  # eager's answer depends on summation order (benchmarks.fuzz.referee)
    ill_conditioned: int = 0  # eager's answer moves when the inputs move one ULP
    graphs_with_regions: int = 0
    regions: int = 0
    fallbacks: int = 0  # regions that failed to compile/run and ran eagerly (correct, slower)
    rewrites: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)
    findings: list[dict[str, Any]] = field(default_factory=list)
    fallback_reasons: Counter = field(default_factory=Counter)

    def note(self, kind: str, case: Any, msg: str) -> None:
        if sum(1 for f in self.findings if f["kind"] == kind) < KEEP:
            rec = {"kind": kind, "case": repr(case), "message": msg[-3000:]}
            if hasattr(case, "to_json"):
                rec["program"] = case.to_json()
            self.findings.append(rec)


def reference(prog: Program, inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> Any:
    """The program in float64 (inputs, weights and float casts): the referee for rounding."""
    ref = copy.copy(prog)
    ref.steps = [
        s if not (isinstance(s.param, torch.dtype) and s.param.is_floating_point)
        else type(s)(s.op, s.args, torch.float64)
        for s in prog.steps
    ]

    def up(t: torch.Tensor) -> torch.Tensor:
        return t.double() if t.dtype.is_floating_point else t

    try:
        return run(ref, [up(t) for t in inputs], [up(t) for t in weights])
    except Exception:  # noqa: BLE001 - no referee then; the strict comparison stands
        return None


def batched_eager(prog: Program, inputs: list, weights: list) -> Any:
    """Eager on 17 stacked copies of the inputs, element 0 of each output, or None.

    ATen is not self-consistent at the edges: a one-element tensor takes a scalar kernel
    (``gelu(+inf) = inf``) where a vectorized one gives NaN. A result that matches eager on
    the vectorized path is not counted against fxpass; it is tallied as eager_inconsistent.
    """
    try:
        with torch.no_grad():
            outs = run(prog, [x.unsqueeze(0).expand(17, *x.shape).contiguous() for x in inputs],
                       weights)
        return tuple(o[0] for o in outs)
    except Exception:  # noqa: BLE001 - the program does not batch (a fixed expand): no verdict
        return None


def judge(expected: Any, got: Any, ref: Any, prog: Program | None, inputs: list,
          weights: list, t: Tally) -> str | None:
    """compare(), then the eager self-consistency check for what still differs."""
    try:
        msg, explained = compare(expected, got, ref)
    except Exception as e:  # noqa: BLE001 - e.g. a meta tensor where eager has data
        msg, explained = f"cannot compare with eager: {type(e).__name__}: {e}", False
    t.precision += explained
    if explained:
        strict = compare(expected, got)[0] or ""
        t.note("precision", prog, f"passed by the fp64 referee only; strictly: {strict}")
    if msg and prog is not None:
        other = batched_eager(prog, inputs, weights)
        inconsistent = other is not None and compare(expected, other)[0] is not None
        if inconsistent and compare(other, got, ref)[0] is None:
            t.eager_inconsistent += 1
            t.note("eager_inconsistent", prog, msg)
            return None
    if msg and prog is not None:
        return undetermined(prog, inputs, weights, expected, got, ref, t, msg)
    return msg


def undetermined(case: Program | torch.fx.GraphModule, inputs: list, weights: list,
                 expected: Any, got: Any, ref: Any, t: Tally, msg: str) -> str | None:
    """``msg``, or None when eager's own answer is not determined where fxpass differs
    (:mod:`benchmarks.fuzz.referee`): counted apart and noted, not as a mismatch."""
    why = explain(case, inputs, weights, expected, got, ref)
    if why is None:
        return msg
    setattr(t, why, getattr(t, why) + 1)
    t.note(why, case if isinstance(case, Program) else case.code, msg)
    return None


def trace(prog: Program, n_inputs: int, inputs: list, weights: list) -> torch.fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = FakeTensorMode()
    with mode:
        fakes = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in
                 [*inputs, *weights]]
        return make_fx(lambda *a: run(prog, a[:n_inputs], a[n_inputs:]))(*fakes)


def as_module(prog: Program, inputs: list, weights: list) -> torch.fx.GraphModule:
    """The program as straight-line aten code with its weights as parameters: what the
    backend compiles. (Dynamo traces a generated ``forward`` in a fraction of the time it
    takes to trace the interpreter loop, and the weights are still frozen parameters.)"""
    gm = trace(prog, len(inputs), inputs, weights)
    root = torch.nn.Module()
    g = torch.fx.Graph()
    env: dict = {}
    for i, ph in enumerate(gm.graph.find_nodes(op="placeholder")):
        if i < len(inputs):
            env[ph] = g.placeholder(ph.name)
        else:
            k = i - len(inputs)
            root.register_parameter(f"w{k}", torch.nn.Parameter(weights[k], requires_grad=False))
            env[ph] = g.get_attr(f"w{k}")
    g.output(g.graph_copy(gm.graph, env))
    return torch.fx.GraphModule(root, g)


def rules_path(prog: Program, inputs: list, weights: list, expected: Any, ref: Any,
               rules: list, t: Tally) -> None:
    from fxpass import PassManager

    try:
        gm = trace(prog, len(inputs), inputs, weights)
        rep = PassManager(rules, check=True).run(gm)
        t.rewrites.update(rep.rewrites)
        with torch.no_grad():
            got = gm(*[x.clone() for x in inputs], *weights)
    except Exception:  # noqa: BLE001 - a crash is a finding
        t.rules_crash += 1
        t.note("rules_crash", prog, traceback.format_exc())
        return
    msg = judge(expected, got, ref, prog, inputs, weights, t)
    if msg:
        t.rules_mismatch += 1
        t.note("rules_mismatch", prog, msg)


def backend_path(fn: torch.nn.Module, inputs: list, expected: Any, ref: Any, case: Any,
                 t: Tally, options: dict, weights: list | None = None,
                 control: Any = None, graph: torch.fx.GraphModule | None = None) -> None:
    """The default (non-strict) compile is what is compared with eager; a region that fell
    back to eager is compiled again with ``strict=True`` to keep its cause as a finding."""
    import fxpass

    before = len(fxpass.compile_reports())
    try:
        got = _compile_and_call(fn, inputs, options)
    except Exception:  # noqa: BLE001
        t.backend_crash += 1
        t.note("backend_crash", case, traceback.format_exc())
        return
    reports = fxpass.compile_reports()[before:] if before < 256 else fxpass.compile_reports()[-1:]
    n = sum(1 for r in reports for g in r.regions if g.fallback is None)
    t.regions += n
    t.graphs_with_regions += n > 0
    if any(g.fallback is not None for r in reports for g in r.regions):
        t.fallbacks += 1
        try:
            _compile_and_call(fn, inputs, {**options, "strict": True})
            t.note("fallback", case, "fell back, but not under strict=True (flaky)")
        except Exception as e:  # noqa: BLE001
            root = e
            while root.__cause__ is not None:
                root = root.__cause__
            t.fallback_reasons[f"{type(root).__name__}: {root}"[:200]] += 1
            t.note("fallback", case, traceback.format_exc()[-1500:])
    prog = case if isinstance(case, Program) else None
    msg = judge(expected, got, ref, prog, inputs, weights or [], t)
    if msg and control is not None and equals_either(expected, control, got, ref):
        # equals PyTorch's other kernel for the op (see benchmarks.fuzz.kit)
        t.eager_inconsistent += 1
        t.note("sdpa_kernels_disagree", case, msg)
        msg = None
    if msg and graph is not None:
        msg = undetermined(graph, inputs, [], expected, got, ref, t, msg)
    if msg:
        t.backend_mismatch += 1
        t.note("backend_mismatch", case, msg)


def _compile_and_call(fn: Any, inputs: list, options: dict) -> Any:
    torch._dynamo.reset()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        c = torch.compile(fn, backend="fxpass_bpu", options=options, dynamic=False)
        return c(*[x.clone() for x in inputs])


def run_program(prog: Program, t: Tally, rules: list, options: dict, backend: bool) -> None:
    inputs, weights = materialize(prog)
    t.tried += 1
    t.ops.update(s.op for s in prog.steps)
    try:
        with torch.no_grad():
            expected = run(prog, [x.clone() for x in inputs], weights)
    except Exception:  # noqa: BLE001 - not a valid program at runtime (eager raises)
        t.invalid += 1
        return
    ref = reference(prog, inputs, weights)
    rules_path(prog, inputs, weights, expected, ref, rules, t)
    if backend:
        try:
            module = as_module(prog, inputs, weights)
        except Exception:  # noqa: BLE001 - counted by the rules path already (same trace)
            module = ProgramModule(prog, weights)
        backend_path(module, inputs, expected, ref, prog, t, options, weights)
