"""Compare a fuzz result with eager: per-dtype tolerances, NaN == NaN, and an fp64 referee.

The rule (stated in docs/benchmarks.md, "Fuzzing"):

* dtype and shape must be eager's exactly; bool and integer values must be equal;
* float values: ``torch.testing.assert_close(actual, expected, equal_nan=True)`` with
  (rtol, atol) = f64 (1e-7, 1e-7), f32 (1e-4, 1e-4), f16 (1e-2, 1e-2), bf16 (5e-2, 5e-2);
  atol is scaled by max(1, max |finite expected|). A NaN where eager has a number, or an
  Inf where eager is finite (or the reverse), fails this;
* when that fails and an fp64 reference of the same program exists, the result still passes
  ("precision", counted separately) if at every element where it differs from eager it is
  at least as close to the fp64 result (rounded to the output dtype) as eager is, within
  the tolerance; or where eager has no correct digit itself (|eager - fp64| beyond the
  tolerance, e.g. cos of a huge argument rounded in bf16) and the result is of the same class
  (NaN/Inf/finite); or where the result is Inf, eager finite, and the fp64 value within 16x
  of the dtype's maximum (the same terms summed in another order overflow). NaN where eager
  has a number is never accepted unless eager itself is that far off.
"""

from __future__ import annotations

from typing import Any

import torch

TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


def flat(x: Any) -> list[Any]:
    if isinstance(x, (tuple, list)):
        return [y for e in x for y in flat(e)]
    return [x]


def _close_mask(a: torch.Tensor, e: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    a64, e64 = a.double(), e.double()
    both_nan = a64.isnan() & e64.isnan()
    same_inf = a64.isinf() & e64.isinf() & (a64 == e64)
    near = (a64 - e64).abs() <= atol + rtol * e64.abs()
    return both_nan | same_inf | (near & a64.isfinite() & e64.isfinite())


def compare(expected: Any, actual: Any, reference: Any = None) -> tuple[str | None, bool]:
    """``(None, False)`` if equal; ``(None, True)`` if only the fp64 referee accepts it;
    otherwise ``(message, False)``."""
    exp, act = flat(expected), flat(actual)
    ref = flat(reference) if reference is not None else None
    if len(exp) != len(act):
        return f"output count {len(act)} != eager's {len(exp)}", False
    explained = False
    for i, (e, a) in enumerate(zip(exp, act, strict=True)):
        if not isinstance(e, torch.Tensor):
            if e != a:
                return f"output {i}: {a!r} != eager's {e!r}", False
            continue
        if not isinstance(a, torch.Tensor):
            return f"output {i}: {type(a).__name__} where eager has a tensor", False
        if a.dtype != e.dtype:
            return f"output {i}: dtype {a.dtype} != eager's {e.dtype}", False
        if a.shape != e.shape:
            return f"output {i}: shape {tuple(a.shape)} != eager's {tuple(e.shape)}", False
        if e.is_complex():  # compare (real, imag) pairs as floats of the component dtype
            e, a = (torch.view_as_real(x.to(torch.complex128)).to(
                torch.float32 if x.dtype != torch.complex128 else torch.float64) for x in (e, a))
        if not e.dtype.is_floating_point:
            if not torch.equal(a, e):
                bad = int((a != e).sum())
                return f"output {i}: {bad}/{e.numel()} {e.dtype} values differ", False
            continue
        bad = unaccepted(e, a, None)
        if not bool(bad.any()):
            continue
        if ref is not None and isinstance(ref[i], torch.Tensor):
            bad = unaccepted(e, a, ref[i])  # the message names an element the referee refused
            if not bool(bad.any()):
                explained = True
                continue
        idx = bad.nonzero()[0].tolist() if bad.any() else []
        msg = (f"output {i} ({e.dtype}{tuple(e.shape)}): {int(bad.sum())}/{e.numel()} elements "
               f"differ; first at {idx}: got {a[tuple(idx)].item()!r}, "
               f"eager {e[tuple(idx)].item()!r}")
        if ref is not None:
            msg += f", fp64 {ref[i][tuple(idx)].item()!r}"
        return msg, False
    return None, explained


def unaccepted(e: torch.Tensor, a: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
    """The elements of ``a`` (same dtype and shape as eager's ``e``) that fail the rule above:
    without ``ref`` the strict comparison, with it the fp64 referee too."""
    if not e.dtype.is_floating_point:
        return a != e
    rtol, atol = TOLERANCE.get(e.dtype, (1e-4, 1e-4))
    fin = e[torch.isfinite(e)].abs()
    atol *= max(1.0, float(fin.max())) if fin.numel() else 1.0
    ok = _close_mask(a, e, rtol, atol)
    if ref is None:
        return ~ok
    r = ref.to(e.dtype)
    # the referee: where a differs from eager, a must be as close to fp64 as eager is
    err_a = (a.double() - ref.double()).abs()
    err_e = (e.double() - ref.double()).abs()
    better = _close_mask(a, r, rtol, atol) | (a.isfinite() & (err_a <= err_e * 2 + atol))
    # where eager itself has no correct digit (cos of a huge argument rounded in bf16), only
    # the class of the value must match: NaN for NaN, Inf for Inf
    better |= ~_close_mask(e, r, rtol, atol) & (a.isnan() == e.isnan()) & (
        a.isinf() == e.isinf())
    # an Inf where eager and fp64 are finite but within 16x of the dtype's maximum: the same
    # terms summed in another order overflow (matmul blocking, f32 sums)
    better |= a.isinf() & e.isfinite() & (ref.double().abs() >= torch.finfo(e.dtype).max / 16)
    return ~(ok | better)


def equals_either(expected: Any, control: Any, actual: Any, reference: Any = None) -> bool:
    """Whether every element of ``actual`` is accepted against eager (with the fp64 referee)
    or equals ``control``, PyTorch's other kernel for the same op (the math SDPA where eager
    ran the CPU flash kernel), element by element: the two kernels disagree on rows holding
    NaN or -inf scores, each in its own way, and one output can hold rows of both kinds."""
    exp, ctl, act = flat(expected), flat(control), flat(actual)
    ref = flat(reference) if reference is not None else [None] * len(exp)
    if not (len(exp) == len(ctl) == len(act) == len(ref)):
        return False
    for e, c, a, r in zip(exp, ctl, act, ref, strict=True):
        if not all(isinstance(x, torch.Tensor) for x in (e, c, a)):
            return False
        if not (a.dtype == e.dtype == c.dtype and a.shape == e.shape == c.shape):
            return False
        r = r if isinstance(r, torch.Tensor) and r.shape == e.shape else None
        if bool((unaccepted(e, a, r) & unaccepted(c, a, None)).any()):
            return False
    return True
