"""Two referees for what the fp64 referee (``fuzz_check``) leaves: overflow and conditioning.

Both ask a question about *eager's* answer, not about fxpass's, and both are decided per
finding by running the program again, never by looking at fxpass's value:

* **Order-dependent overflow.** A sum whose positive terms (or negative terms) add up past the
  dtype's maximum overflows in *some* summation order and not in others; an intermediate
  whose exact value is beyond the dtype's range is Inf in one precision and finite in
  another (bf16 rounds where f32 does not). Which results are then finite, Inf or NaN depends
  on the kernel's order and precision (eager's MKL, onnxruntime's MLAS, the BPU's MAC array),
  so eager's answer is one of several equally valid ones. An output counts here only if it is
  downstream of such a step, found on the exact (float64) run of the program with
  ``fuzz_programs.SUM_TERMS``. An elementwise op that is simply wrong on a huge value
  (``hardswish(3e38)``) does not qualify: its exact result is in range and it sums nothing.
* **Ill-conditioned.** Eager's own result moves beyond the tolerance when every float input
  moves by one unit in the last place (``nextafter`` up, then down): the answer is not
  determined by the inputs at that precision (``cos`` of a value near 1e10, reached from a
  subnormal through ``rsqrt``). Only the elements that move count, element by element.

What these accept is counted and listed apart (``overflow_order``, ``ill_conditioned``),
never folded into the passes. The guarantee they bound is stated in docs/failure-model.md.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.fuzz_check import flat, unaccepted
from benchmarks.fuzz_programs import OPS, SUM_TERMS, Program


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


def unstable_elements(prog: Program, inputs: list, weights: list,
                      expected: Any) -> list[torch.Tensor] | None:
    """Per output, the elements of eager's result that move beyond the tolerance when every
    float input moves one ULP (up, or down); None if the perturbed program does not run."""
    from benchmarks.fuzz_programs import run

    moved: list[torch.Tensor] | None = None
    for direction in (torch.inf, -torch.inf):
        nudged = [torch.nextafter(t, torch.full_like(t, direction))
                  if t.dtype.is_floating_point else t for t in inputs]
        try:
            with torch.no_grad():
                outs = flat(run(prog, nudged, weights))
        except Exception:  # noqa: BLE001 - no verdict
            return None
        masks = [unaccepted(e, o, None) for e, o in zip(flat(expected), outs, strict=True)]
        moved = masks if moved is None else [m | n for m, n in zip(moved, masks, strict=True)]
    return moved


def explain(prog: Program, inputs: list, weights: list, expected: Any, got: Any,
            ref: Any) -> str | None:
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
    over = overflowing_outputs(prog, inputs, weights)
    left = [(i, m) for i, m in bad if i not in over]
    if not left:
        return "overflow_order"
    moved = unstable_elements(prog, inputs, weights, expected)
    if moved is not None and all(not bool((m & ~moved[i]).any()) for i, m in left):
        return "ill_conditioned" if len(left) == len(bad) else "overflow_order"
    return None
