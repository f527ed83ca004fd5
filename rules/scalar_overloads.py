"""scalar_overloads: one canonical overload per op family, so tables and rules match one form.

Before -> after:
- ``add/sub/mul/div.Scalar(x, s)`` -> ``add/sub/mul/div.Tensor(x, s)`` (Python scalar operand);
  ``div.Scalar_mode`` -> ``div.Tensor_mode``; ``rsub.Scalar`` stays (no tensor form is simpler);
- ``add/sub/mul/div.Tensor(x, c)`` with ``c`` a 0-dim constant -> the Python scalar ``c.item()``;
- ``eq/ne/lt/le/gt/ge.Tensor(x, c)`` with ``c`` a 0-dim constant -> ``.Scalar(x, c.item())``;
- ``pow.Tensor_Tensor(x, c)`` with ``c`` a 0-dim constant -> ``pow.Tensor_Scalar``;
- ``where.ScalarSelf / ScalarOther / Scalar`` -> ``where.self`` with 0-dim ``scalar_tensor``s;
- casts: ``prims.convert_element_type(x, d)``, ``to.dtype``, ``_to_copy`` with only harmless
  extras (cpu, strided) -> ``_to_copy(x, dtype=d)`` (a C++ op: cheap when left on the CPU).

Why: a capability table or a rule written for ``mul.Tensor`` should not miss ``mul.Scalar``.

Exactness: PyTorch's type promotion treats a 0-dim tensor and a Python scalar of the same
category alike (neither promotes a dimensioned operand within its category), and a 0-dim
tensor's value is exact as a Python float/int; the rule checks that the result dtype is
unchanged. Does not fire when the 0-dim operand is not a constant, or is a graph input; for
``_to_copy`` with device / layout / memory_format / pin_memory set.
"""

from __future__ import annotations

import torch

from fxpass import rule
from fxpass.rules._util import CAST, aten, cast_to, prims

_TO_TENSOR = {
    aten.add.Scalar: aten.add.Tensor,
    aten.sub.Scalar: aten.sub.Tensor,
    aten.mul.Scalar: aten.mul.Tensor,
    aten.div.Scalar: aten.div.Tensor,
    aten.div.Scalar_mode: aten.div.Tensor_mode,
}
_ARITH = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor)
_CMP = {
    aten.eq.Tensor: aten.eq.Scalar,
    aten.ne.Tensor: aten.ne.Scalar,
    aten.lt.Tensor: aten.lt.Scalar,
    aten.le.Tensor: aten.le.Scalar,
    aten.gt.Tensor: aten.gt.Scalar,
    aten.ge.Tensor: aten.ge.Scalar,
}
_WHERE = (aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
_CASTS = (aten._to_copy.default, aten.to.dtype, prims.convert_element_type.default)
_HARMLESS = {"layout": (None, torch.strided), "device": (None, torch.device("cpu"), "cpu")}


def _scalar(node, rw):
    """Python scalar of a 0-dim constant operand, or None."""
    c = rw.constant(node)
    if c is None or c.dim() != 0 or c.dtype == torch.bool or c.is_complex():
        return None
    return c.item()


def _same_result(node, rw, target, args, kwargs) -> bool:
    new_val = rw.infer(target, args, kwargs)
    old = node.meta["val"]
    return new_val.dtype == old.dtype and new_val.shape == old.shape


@rule(
    *_TO_TENSOR, *_ARITH, *_CMP, aten.pow.Tensor_Tensor, *_WHERE, *_CASTS, name="scalar_overloads"
)
def scalar_overloads(node, rw):
    """Canonicalize scalar overloads (.Scalar -> .Tensor with a Python scalar, 0-dim constants
    -> scalars, where.Scalar* -> where.self) and dtype casts (-> _to_copy(dtype=...))."""
    t, args, kwargs = node.target, node.args, dict(node.kwargs)
    if t in _TO_TENSOR:
        new = (_TO_TENSOR[t], args, kwargs)
    elif t in _ARITH or t in _CMP or t is aten.pow.Tensor_Tensor:
        s = _scalar(args[1], rw) if len(args) > 1 else None
        if s is None:
            return False
        x = args[0].meta["val"]
        c = rw.constant(args[1])
        like = torch.empty((1,), dtype=x.dtype)  # a dimensioned stand-in for x
        if torch.result_type(like, c) != torch.result_type(like, s):
            return rw.skip("the 0-dim constant sets the computation dtype; a scalar would not")
        if t is aten.pow.Tensor_Tensor and not x.dtype.is_floating_point:
            return rw.skip("integer base: pow.Tensor_Scalar rejects negative integer exponents")
        to = {aten.pow.Tensor_Tensor: aten.pow.Tensor_Scalar, **_CMP}.get(t, t)
        new = (to, (args[0], s, *args[2:]), kwargs)
        if not _same_result(node, rw, *new):  # promotion is the one thing that could differ
            return rw.skip("canonical form would change the result dtype")
    elif t in _WHERE:
        out = node.meta["val"]
        cond, a, b = args
        a = (
            a
            if isinstance(a, torch.fx.Node)
            else rw.call(aten.scalar_tensor.default, a, dtype=out.dtype)
        )
        b = (
            b
            if isinstance(b, torch.fx.Node)
            else rw.call(aten.scalar_tensor.default, b, dtype=out.dtype)
        )
        new = (aten.where.self, (cond, a, b), {})
    else:  # casts
        if cast_to(node) is not None:
            return False  # already canonical
        dtype = kwargs.pop("dtype", None) if t is aten._to_copy.default else args[1]
        if t is aten.to.dtype:
            if args[2:] and any(args[2:4]) or kwargs.get("copy") or kwargs.get("non_blocking"):
                return rw.skip("to.dtype with non_blocking/copy flags")
            kwargs = {k: v for k, v in kwargs.items() if k not in ("non_blocking", "copy")}
        extra = {k: v for k, v in kwargs.items() if v not in _HARMLESS.get(k, (None, False))}
        if dtype is None or extra:
            return rw.skip(f"cast with {sorted(extra) or 'no dtype'}: not a pure dtype cast")
        new = (CAST, (args[0],), {"dtype": dtype})
    rw.retarget(node, new[0], *new[1], **new[2])  # same value, same users: edit in place
    return True
