"""What a node's values and arguments must look like to run in a region, and why not.

Two kinds of checks, both read by the one reason function in :mod:`.table`:

* ``tensor_reason``: a value the region reads or writes (dtype, static shape, rank), with the
  march's limits when there is a march and the lowering's own limits always;
* per-op argument checks (``check_*``): argument combinations that have no exact ONNX
  equivalent (a rounding mode, a ceil-mode pool whose windows ONNX cannot reproduce, ...).

They inspect ``meta["val"]`` and arguments only, so partitioning a 100k-node graph stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from fxpass.backends.onnx.lowering.builder import _DATA_DTYPES, _dtype, _pair, _shape
from fxpass.backends.onnx.lowering.nn import _pool_attrs
from fxpass.graph import bind_args

if TYPE_CHECKING:
    from fxpass.backends.onnx.lowering.builder import Limits as March

aten = torch.ops.aten


def tensor_reason(v: Any, march: March | None = None) -> str | None:
    """Why one value cannot live in a region (None if it can), for ``march`` if given."""
    if not isinstance(v, torch.Tensor):
        return f"value is a {type(v).__name__}, not a tensor"
    if not all(isinstance(d, int) for d in v.shape):
        return "symbolic shape (the BPU needs every dimension at compile time)"
    if v.dtype == torch.bfloat16:
        return ("bfloat16 (no BF16 on the BPU; enable bf16_promotion, which computes in "
                "float32 but leaves table lookups such as embedding on their BF16 table)")
    if v.dtype == torch.int64:
        return "int64 tensor: the BPU has no int64 data path; cast to int32 outside the region"
    if v.dtype == torch.float64:
        return "float64 tensor: the BPU has no float64; cast to float32 outside the region"
    if v.dtype not in _DATA_DTYPES:
        return f"dtype {v.dtype} is not supported (float32/float16/int32/int16/int8/uint8/bool are)"
    if march is not None:
        if v.dtype not in march.dtypes:
            return f"dtype {v.dtype} not supported on {march.name}"
        if v.dim() > march.max_rank:
            return f"rank {v.dim()} > {march.max_rank}"
    return None


def check_rounding(n: fx.Node) -> str | None:
    mode = bind_args(n)["rounding_mode"]
    return None if mode is None else f"rounding_mode={mode!r} has no lowering (true division only)"


def check_float_pow(n: fx.Node) -> str | None:
    """aten's integer pow wraps on overflow (two's complement: ``(-16) ** 9 == 0`` in int32);
    onnxruntime's integer Pow does not (found by a probe: -3.67e9 for 0)."""
    dt = _dtype(n)
    if dt is not None and not dt.is_floating_point:
        return f"{str(dt).removeprefix('torch.')} pow: onnxruntime's Pow does not wrap on overflow"
    return None


def check_bool_arith(n: fx.Node) -> str | None:
    return "arithmetic on bool tensors has no ONNX kernel" if _dtype(n) == torch.bool else None


def check_conv(n: fx.Node) -> str | None:
    return "transposed convolution is not supported" if bind_args(n)["transposed"] else None


def check_batch_norm(n: fx.Node) -> str | None:
    a = bind_args(n)
    if a.get("training"):
        return "batch norm in training mode; call model.eval() before compiling"
    if a["running_mean"] is None or a["running_var"] is None:
        return "batch norm without running statistics"
    return None


def check_pool(n: fx.Node) -> str | None:
    a = bind_args(n)
    if len(_shape(a["self"])) != 4:
        return "unbatched (3-d) pooling input; only NCHW is lowered"
    if a.get("divisor_override") is not None:
        return "avg_pool2d divisor_override has no ONNX equivalent"
    if a.get("ceil_mode") and _pool_attrs(n, a)["ceil_mode"] is None:
        return "ceil_mode windows differ between PyTorch and ONNX per spatial dim"
    dilated = _pair(a.get("dilation", 1), 2) != [1, 1]
    f32 = _dtype(a["self"]) == torch.float32
    if n.target == aten.max_pool2d_with_indices.default and dilated and f32:
        # _max_pool's float32 NaN / -inf check pools with AveragePool, which has no dilations
        # before opset 19, and onnxruntime's MaxPool alone drops NaN: keep these on the host
        return (
            "dilated float32 max_pool2d: onnxruntime's MaxPool skips NaN and the NaN check "
            "needs AveragePool dilations (opset 19)"
        )
    if n.target == aten._adaptive_avg_pool2d.default:
        (h, w), (oh, ow) = _shape(a["self"])[-2:], _shape(n)[-2:]
        if h % oh or w % ow:
            return f"adaptive pool {h}x{w} -> {oh}x{ow} needs output sizes dividing the input"
    return None


def check_to_copy(n: fx.Node) -> str | None:
    a = bind_args(n)
    if a["layout"] not in (None, torch.strided):
        return f"layout {a['layout']} is not supported"
    if a["device"] is not None and torch.device(a["device"]).type != "cpu":
        return f"device transfer to {a['device']} cannot be lowered"
    return None


def check_bitwise(n: fx.Node) -> str | None:
    return None if _dtype(n) == torch.bool else "bitwise ops are lowered for bool tensors only"
