"""Emitters for normalization, convolution, pooling and factory ops.

Pooling carries the subtle parts: PyTorch's and ONNX's ceil-mode window counts differ
(``_onnx_ceil_mode`` picks the ONNX mode that reproduces PyTorch's output size, or says there
is none, which :mod:`.checks` turns into a CPU reason), and onnxruntime's MaxPool skips NaN.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import fx

from fxpass.backends.onnx.lowering.builder import (
    _Builder,
    _dtype,
    _getitems,
    _pair,
    _shape,
    _val,
)
from fxpass.backends.onnx.lowering.emitters import _nan_flags, _nan_where

aten = torch.ops.aten


def _layer_norm(b: _Builder, n: fx.Node, a: dict[str, Any]) -> list[str]:
    x, ns = a["input"], list(a["normalized_shape"])
    dt = _dtype(x)
    scale = b.t(a["weight"], dt) if a["weight"] is not None else b.const(np.ones(ns), dt)
    used = {i for i, u in _getitems(n).items() if u.users}
    n_out = 3 if 2 in used else 2 if 1 in used else 1
    outs = b.op(
        "LayerNormalization",
        b.t(x),
        scale,
        b.t(a["bias"], dt),
        n_out=n_out,
        axis=len(_shape(x)) - len(ns),
        epsilon=float(a["eps"]),
    )
    outs = [outs] if isinstance(outs, str) else outs
    stats = [b.cast(o, torch.float32, v.dtype) for o, v in zip(outs[1:], _val(n)[1:], strict=False)]
    return ([outs[0], *stats] + ["", ""])[:3]


def _batch_norm(b: _Builder, n: fx.Node, a: dict[str, Any]) -> list[str]:
    x = a["input"]
    dt, channels = _dtype(x), _shape(x)[1]
    w = b.t(a["weight"], dt) if a["weight"] is not None else b.const(np.ones(channels), dt)
    bias = b.t(a["bias"], dt) if a["bias"] is not None else b.const(np.zeros(channels), dt)
    mean, var = b.t(a["running_mean"], dt), b.t(a["running_var"], dt)
    return [b.op("BatchNormalization", b.t(x), w, bias, mean, var, epsilon=float(a["eps"])), "", ""]


def _conv(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    dt, k = _dtype(n), len(_shape(a["input"])) - 2
    pads = _pair(a["padding"], k)
    return b.op(
        "Conv",
        b.t(a["input"], dt),
        b.t(a["weight"], dt),
        b.t(a["bias"], dt),
        strides=_pair(a["stride"], k),
        pads=pads + pads,
        dilations=_pair(a["dilation"], k),
        group=int(a["groups"]),
    )


def _pool_attrs(n: fx.Node, a: dict[str, Any]) -> dict[str, Any]:
    kernel = _pair(a["kernel_size"], 2)
    strides = _pair(a["stride"], 2) if a["stride"] else kernel
    pads = _pair(a["padding"], 2)
    attrs = {"kernel_shape": kernel, "strides": strides, "pads": pads + pads}
    if "dilation" in a:
        attrs["dilations"] = _pair(a["dilation"], 2)
    if a["ceil_mode"]:
        out = _val(n)[0] if isinstance(_val(n), tuple | list) else _val(n)
        sizes = zip(
            _shape(a["self"])[2:],
            out.shape[2:],
            kernel,
            strides,
            pads,
            attrs.get("dilations", [1, 1]),
            strict=True,
        )
        attrs["ceil_mode"] = _onnx_ceil_mode(sizes)
    return attrs


def _onnx_ceil_mode(sizes: Any) -> int | None:
    """ONNX ceil_mode giving PyTorch's output size, or None if no single mode does.

    PyTorch drops a last ceil-mode window that would start inside the right padding; ONNX
    does not. Where PyTorch dropped it, its size equals the floor-mode size, so ceil_mode=0.
    """
    modes = {0, 1}
    for size, out, k, s, p, d in sizes:
        span = size + 2 * p - (k - 1) * d - 1
        modes &= {m for m, o in ((0, span // s + 1), (1, -(-span // s) + 1)) if o == out}
    return max(modes) if modes else None


def _max_pool(b: _Builder, n: fx.Node, a: dict[str, Any]) -> list[str]:
    """MaxPool, plus a cheap second pool over the same windows that finds NaN (and -inf).

    onnxruntime's MaxPool skips NaN where aten returns NaN for every window holding one, and
    some of its float32 paths start from -FLT_MAX, so a window of only -inf gives -FLT_MAX.

    float32: pool ``code = clip(x * 2**-64, -2**66, 2**64)`` with AveragePool. The code keeps
    NaN, maps every finite value and +inf into [-2**64, 2**64] (no overflow in the sum, and no
    subnormals unless |x| < 2**-62) and only -inf to -2**66, so a window's average is NaN
    exactly when it holds a NaN, and -2**66 exactly when it is all -inf; anything else lies at
    least 3 * 2**64 / area above that, far beyond float32 rounding for any real kernel size.
    float16 (whose MaxPool gets -inf right, and whose Clip kernel is slow): max-pool an
    IsNaN mask. Either way ~three extra passes over the input; finite inputs are unchanged.
    """
    attrs = _pool_attrs(n, a)
    x, dt = b.t(a["self"]), _dtype(a["self"])
    out = b.op("MaxPool", x, **attrs)
    if not dt.is_floating_point:
        return [out, ""]
    if dt != torch.float32:
        return [_nan_where(b, b.op("MaxPool", _nan_flags(b, x, dt), **attrs), out, dt), ""]
    scaled = b.op("Mul", x, b.const(2.0**-64, dt))
    code = b.op("Clip", scaled, b.const(-(2.0**66), dt), b.const(2.0**64, dt))
    windows = {k: v for k, v in attrs.items() if k != "dilations"}  # _check_pool: dilation 1
    avg = b.op("AveragePool", code, count_include_pad=0, **windows)
    area = math.prod(attrs["kernel_shape"])
    all_neg_inf = b.op("Less", avg, b.const(-(2.0**64) * (4 - 1.5 / area), dt))
    out = b.op("Where", all_neg_inf, b.const(-math.inf, dt), out)
    # ``out`` as Where's second branch: onnxruntime keeps the sign of a -0 there
    return [b.op("Where", b.op("IsNaN", avg), avg, out), ""]


def _avg_pool(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    attrs = _pool_attrs(n, a) | {"count_include_pad": int(bool(a["count_include_pad"]))}
    return b.op("AveragePool", b.t(a["self"]), **attrs)


def _adaptive_avg_pool(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    x = a["self"]
    (h, w), (oh, ow) = _shape(x)[-2:], _shape(n)[-2:]
    if (oh, ow) == (1, 1):
        return b.op("GlobalAveragePool", b.t(x))
    kernel = [h // oh, w // ow]
    return b.op("AveragePool", b.t(x), kernel_shape=kernel, strides=kernel)


def _full_like(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    fill = {aten.zeros_like.default: 0, aten.ones_like.default: 1}.get(n.target)
    value = b.const(a["fill_value"] if fill is None else fill, _dtype(n))
    return b.op("Expand", value, b.ints(_shape(n)))


def _scalar_tensor(b: _Builder, n: fx.Node, a: dict[str, Any]) -> str:
    return b.const(a["s"], _dtype(n))
