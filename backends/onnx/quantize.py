"""Calibrated Q/DQ quantization of one region's ONNX model, with onnxruntime's own tooling.

Why: the BPU's tensor engine (conv / matmul / linear) takes int8/int16 inputs only; a float
MAC op handed to hbdk4's ``convert()`` is placed on the board's CPU (``docs/bpu-facts.md``,
"Data types"). So a region bound for the board needs QuantizeLinear/DequantizeLinear pairs on
the inputs of its MAC ops, with scales calibrated on real data. On the host, onnxruntime fuses
the same QDQ pattern into integer kernels (int8), which is how we measure accuracy and speed.

What: ``onnxruntime.quantization`` does the work (QDQ format, its calibrators for MinMax /
Percentile / Entropy, per-channel symmetric weights); nothing here quantizes by hand. We
choose *which* ops get Q/DQ: exactly the march's integer-input ops (:data:`INTEGER_INPUT_OPS`,
data next to the capability table). Everything else -- softmax, the norms, GELU, residual adds
on nash-p -- stays float, because the target runs those in float (and int8 softmax/norms are
where quantization error comes from).

Two steps with a digest in between, so the cache key can cover the calibration:
``calibrate_ranges`` (the calibrator on the recorded region inputs -> per-tensor ranges) and
``quantize_model`` (ranges -> QDQ model, via ``quantize_static`` reading the saved ranges).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import onnx

#: Ops whose inputs must be integers on each march: the tensor engine on every march
#: (docs/bpu-facts.md, "Data types": conv/matmul/linear take int8/int16; a float one is placed
#: on the CPU). On nash-e/nash-m the elementwise tables are "mostly int8/int16, with float16
#: paths in newer releases" (docs/bpu-facts.md), so we take the conservative reading and
#: quantize add/sub/mul there too.
#: nash-p/nash-h elementwise ops accept float16/float32 (docs/bpu-facts.md), so they stay float.
TENSOR_ENGINE = ("Conv", "ConvTranspose", "MatMul", "Gemm")
INTEGER_INPUT_OPS: dict[str, tuple[str, ...]] = {
    "nash-p": TENSOR_ENGINE,
    "nash-h": TENSOR_ENGINE,
    "nash-e": (*TENSOR_ENGINE, "Add", "Sub", "Mul"),
    "nash-m": (*TENSOR_ENGINE, "Add", "Sub", "Mul"),
    #: the ``ort`` device: onnxruntime's integer kernels are its MAC ops (MatMulInteger,
    #: QLinearConv, fused from QDQ); everything else stays float
    "host": TENSOR_ENGINE,
}
#: Ops that must stay float whatever the march (precision, not placement): shown by explain.
MUST_STAY_FLOAT = (
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "BatchNormalization",
    "ReduceMean",
    "Pow",
    "Sqrt",
    "Reciprocal",
    "Exp",
    "Erf",
    "Tanh",
    "Sigmoid",
)
METHODS = ("minmax", "percentile", "entropy")


class QuantizationError(ValueError):
    """Quantization cannot proceed; the message names the cause and the fix."""


class FloatMacError(RuntimeError):
    """A board-bound MAC op kept float inputs: ``convert`` would place it on the board's CPU."""


@dataclass(frozen=True)
class QuantConfig:
    """How a region is quantized. ``name`` is what the report shows."""

    name: str
    activations: str  # "int16" or "int8"
    weights: str = "int8"  # always per output channel, symmetric
    method: str = "minmax"
    percentile: float = 99.999

    def key(self) -> dict[str, Any]:
        return asdict(self)


#: The two configs of issue 11: accuracy first (the default) and speed first.
CONFIGS: dict[str, QuantConfig] = {
    "w8a16": QuantConfig("w8a16", activations="int16"),
    "w8a8": QuantConfig("w8a8", activations="int8"),
}
DEFAULT_CONFIG = "w8a16"


def resolve_config(value: Any) -> QuantConfig | None:
    """The ``quantize`` option -> a config: None/False (float), True (the default), a name, or
    a dict ``{"config": "w8a8", "method": "percentile", "percentile": 99.99}``."""
    if value is None or value is False:
        return None
    if value is True:
        return CONFIGS[DEFAULT_CONFIG]
    if isinstance(value, QuantConfig):
        return value
    if isinstance(value, str):
        if value not in CONFIGS:
            raise QuantizationError(
                f"unknown quantize config {value!r}; use one of {sorted(CONFIGS)} (w8a16: int8 "
                "per-channel weights, int16 activations, the accurate default; w8a8: int8 both)"
            )
        return CONFIGS[value]
    if isinstance(value, dict):
        extra = set(value) - {"config", "method", "percentile"}
        if extra:
            raise QuantizationError(
                f"unknown quantize keys {sorted(extra)}; valid: config, method, percentile"
            )
        base = resolve_config(value.get("config", DEFAULT_CONFIG))
        method = value.get("method", base.method)
        if method not in METHODS:
            raise QuantizationError(f"calibration method {method!r} is not one of {METHODS}")
        pct = float(value.get("percentile", base.percentile))
        if not 50.0 < pct <= 100.0:
            raise QuantizationError(f"percentile must be in (50, 100], got {pct}")
        name = base.name if method == "minmax" else f"{base.name}-{method}"
        return QuantConfig(name, base.activations, base.weights, method, pct)
    raise QuantizationError(
        f"quantize must be None, True, one of {sorted(CONFIGS)} or a dict, got {value!r}"
    )


def integer_input_ops(march: str) -> tuple[str, ...]:
    if march not in INTEGER_INPUT_OPS:
        raise QuantizationError(
            f"no integer-input table for march {march!r}; known: {sorted(INTEGER_INPUT_OPS)}"
        )
    return INTEGER_INPUT_OPS[march]


class _QuietOrt(logging.Filter):
    """onnxruntime's quantizer logs advice to the root logger on every call ("consider
    pre-processing", "updating to opset 21" for int16): expected here, so not shown."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "quantization" not in record.pathname.replace("\\", "/")


@contextlib.contextmanager
def _quiet() -> Any:
    f = _QuietOrt()
    root = logging.getLogger()
    root.addFilter(f)
    try:
        yield
    finally:
        root.removeFilter(f)


class _Reader:
    """onnxruntime's CalibrationDataReader protocol over recorded region inputs."""

    def __init__(self, feeds: Sequence[dict[str, np.ndarray]]):
        self.feeds, self.i = list(feeds), 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.i >= len(self.feeds):
            return None
        self.i += 1
        return self.feeds[self.i - 1]

    def __len__(self) -> int:
        return len(self.feeds)

    def set_range(self, start_index: int, end_index: int) -> None:
        self.feeds, self.i = self.feeds[start_index:end_index], 0


def _ort_types(cfg: QuantConfig) -> tuple[Any, Any, Any]:
    from onnxruntime.quantization import CalibrationMethod, QuantType

    act = QuantType.QInt16 if cfg.activations == "int16" else QuantType.QInt8
    method = {
        "minmax": CalibrationMethod.MinMax,
        "percentile": CalibrationMethod.Percentile,
        "entropy": CalibrationMethod.Entropy,
    }[cfg.method]
    return act, QuantType.QInt8, method


def _calib_options(cfg: QuantConfig) -> dict[str, Any]:
    # The BPU's scales are symmetric (zero point 0); calibrate symmetric ranges to match.
    opts: dict[str, Any] = {"symmetric": True}
    if cfg.method == "percentile":
        opts["percentile"] = cfg.percentile
    return opts


def check_feeds(proto: onnx.ModelProto, feeds: Sequence[dict[str, np.ndarray]], where: str) -> None:
    """Calibration feeds must exist, match the model's inputs, and be finite."""
    if not feeds:
        raise QuantizationError(
            f"{where}: no calibration batches; pass at least one representative batch to "
            "fxpass.backends.bpu.calibrate(model, batches)"
        )
    want = {i.name: i for i in proto.graph.input}
    for k, feed in enumerate(feeds):
        if set(feed) != set(want):
            raise QuantizationError(f"{where}: batch {k} feeds {sorted(feed)}, want {sorted(want)}")
        for name, a in feed.items():
            tt = want[name].type.tensor_type
            shape = [d.dim_value for d in tt.shape.dim]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
            if list(a.shape) != shape or a.dtype != dtype:
                raise QuantizationError(
                    f"{where}: batch {k} gives input {name} as {a.dtype}{list(a.shape)}, the "
                    f"region was compiled for {np.dtype(dtype)}{shape}; calibrate with batches "
                    "shaped like the calls the model will serve (static shapes)"
                )
            if a.dtype.kind == "f" and not np.isfinite(a).all():
                raise QuantizationError(
                    f"{where}: batch {k} input {name} holds NaN or Inf, which would poison the "
                    "calibration ranges; drop or clean that batch"
                )
    floats = [n for n, a in feeds[0].items() if a.dtype.kind == "f"]
    constant = [n for n in floats
                if all(a[n].size == 0 or a[n].min() == a[n].max() == feeds[0][n].flat[0]
                       for a in feeds)]
    if floats and len(constant) == len(floats):
        # every activation range would be a point: the first real input saturates (found by
        # a probe: all-zero batches reported cosine 1.0, then a normal input got 0.62)
        raise QuantizationError(
            f"{where}: every floating-point input holds one value in every calibration batch "
            f"({', '.join(constant)}), so each activation range is empty and real inputs "
            "would saturate; calibrate with representative data, not zeros or a constant"
        )


def calibrate_ranges(
    proto: onnx.ModelProto,
    feeds: Sequence[dict[str, np.ndarray]],
    cfg: QuantConfig,
    march: str,
) -> dict[str, Any]:
    """Run onnxruntime's calibrator on the recorded feeds; return the ranges as JSON data
    (``save_tensors_data``'s format, so ``quantize_static`` can read them back)."""
    from onnxruntime.quantization.calibrate import create_calibrator, save_tensors_data

    check_feeds(proto, feeds, proto.graph.name or "region")
    floats = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)
    halves = [i.name for i in proto.graph.input if i.type.tensor_type.elem_type in floats]
    if halves:  # (onnxruntime's own type error said nothing of why; found by a probe)
        raise NotImplementedError(
            f"region with float inputs other than float32 ({', '.join(halves)}): "
            "onnxruntime's static quantizer takes float32 models, so it stays float; "
            "quantize the float32 model instead"
        )
    _, _, method = _ort_types(cfg)
    with tempfile.TemporaryDirectory(prefix="fxpass-calib-") as tmp:
        path = os.path.join(tmp, "float.onnx")
        onnx.save_model(proto, path)
        cal = create_calibrator(
            path,
            list(integer_input_ops(march)),
            augmented_model_path=os.path.join(tmp, "augmented.onnx"),
            calibrate_method=method,
            providers=["CPUExecutionProvider"],
            extra_options=_calib_options(cfg),
        )
        with _quiet():
            cal.collect_data(_Reader(feeds))
            ranges = cal.compute_data()
        out = os.path.join(tmp, "ranges.json")
        save_tensors_data(ranges, out)
        with open(out) as f:
            return json.load(f)


def ranges_digest(ranges: dict[str, Any], cfg: QuantConfig) -> str:
    """A digest of the calibration ranges and the config: part of the artifact's cache key."""
    text = json.dumps({"ranges": ranges, "config": cfg.key()}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def quantize_model(
    proto: onnx.ModelProto, ranges: dict[str, Any], cfg: QuantConfig, march: str
) -> onnx.ModelProto:
    """The QDQ model: Q/DQ on the inputs of the march's integer-input ops, per-channel int8
    weights, everything else float. Shapes are inferred so every value has ``value_info``."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    act, wt, method = _ort_types(cfg)
    with tempfile.TemporaryDirectory(prefix="fxpass-quant-") as tmp:
        cache = os.path.join(tmp, "ranges.json")
        with open(cache, "w") as f:
            json.dump(ranges, f)
        out = os.path.join(tmp, "qdq.onnx")
        with _quiet():
            quantize_static(
                proto,
                out,
                calibration_data_reader=None,
                calibration_cache_path=cache,
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=list(integer_input_ops(march)),
                per_channel=True,
                activation_type=act,
                weight_type=wt,
                calibrate_method=method,
                extra_options={
                    "ActivationSymmetric": True,
                    "WeightSymmetric": True,
                    # MatMul weights are [K, N]: one scale per output column N
                    "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1},
                },
            )
        q = onnx.load(out)
    q = onnx.shape_inference.infer_shapes(q, strict_mode=True)
    q.graph.name = proto.graph.name
    return q


def fold_weight_dequantize(model: onnx.ModelProto) -> onnx.ModelProto:
    """Host only: each DequantizeLinear of a constant (int8 weight) becomes its float result.

    Why: onnxruntime has no int16 integer kernels, so a w8a16 region runs float matmuls on
    dequantized weights anyway, and would dequantize every weight at every call. The folded
    value is computed as onnxruntime computes it, ``float(int32(x) - zero_point) * scale``,
    so the numbers do not change; the activations keep their Q/DQ (the board's rounding).
    The board never gets this model.
    """
    from onnx import numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    keep, folded = [], []
    for n in g.node:
        consts = [i for i in n.input if i]
        if n.op_type != "DequantizeLinear" or not all(i in inits for i in consts):
            keep.append(n)
            continue
        x = numpy_helper.to_array(inits[n.input[0]]).astype(np.int32)
        scale = numpy_helper.to_array(inits[n.input[1]]).astype(np.float32)
        zp = (
            numpy_helper.to_array(inits[n.input[2]]).astype(np.int32)
            if len(n.input) > 2 and n.input[2]
            else np.zeros_like(scale, np.int32)
        )
        if scale.ndim == 1 and x.ndim > 1:  # per-channel along ``axis``
            axis = next((a.i for a in n.attribute if a.name == "axis"), 1) % x.ndim
            shape = [1] * x.ndim
            shape[axis] = -1
            scale, zp = scale.reshape(shape), zp.reshape(shape)
        y = ((x - zp).astype(np.float32) * scale).astype(np.float32)
        folded.append(numpy_helper.from_array(y, n.output[0]))
    if not folded:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(keep)
    used = {i for n in keep for i in n.input} | {o.name for o in g.output}
    del out.graph.initializer[:]
    out.graph.initializer.extend([i for i in g.initializer if i.name in used] + folded)
    return out


def _producers(g: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in g.node for o in n.output}


def float_mac_inputs(proto: onnx.ModelProto, march: str) -> list[str]:
    """Integer-input ops whose data inputs are not dequantized: on a board, ``convert`` would
    place these on the CPU. Empty means every MAC op reaches the tensor engine."""
    g = proto.graph
    prod = _producers(g)
    bad = []
    for n in g.node:
        if n.op_type not in TENSOR_ENGINE:
            continue
        data = n.input[:2]  # activation and weight; a bias (input 2) may stay int32/float
        for i in data:
            p = prod.get(i)
            if p is None or p.op_type != "DequantizeLinear":
                bad.append(f"{n.op_type} {n.name or n.output[0]} input {i}")
    return bad


def summarize(proto: onnx.ModelProto, march: str) -> dict[str, Any]:
    """Where Q/DQ went and what stayed float (for explain and the compile report)."""
    g = proto.graph
    prod = _producers(g)
    integer = set(integer_input_ops(march))
    quantized: Counter[str] = Counter()
    names: list[str] = []
    float_ops: Counter[str] = Counter()
    qdq_bits: Counter[str] = Counter()
    for n in g.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            if n.op_type == "QuantizeLinear":
                zp = n.input[2] if len(n.input) > 2 else ""
                qdq_bits[_zp_type(g, zp)] += 1
            continue
        fed = [prod.get(i) for i in n.input if i]
        if n.op_type in integer and any(
            p is not None and p.op_type == "DequantizeLinear" for p in fed
        ):
            quantized[n.op_type] += 1
            names.append(n.name or n.output[0])
        else:
            float_ops[n.op_type] += 1
    inits = {i.name for i in g.initializer}
    weights_q = sum(1 for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in inits)
    return {
        "quantized": dict(quantized),
        "quantized_nodes": names,
        "float": dict(float_ops),
        "q_nodes": dict(qdq_bits),
        "quantized_weights": weights_q,
        "float_mac": float_mac_inputs(proto, march),
    }


#: onnxruntime CPU kernels that compute in integers (what its QDQ fusions produce).
INTEGER_KERNELS = (
    "QLinearMatMul",
    "MatMulInteger",
    "MatMulIntegerToFloat",
    "QLinearConv",
    "ConvInteger",
    "QGemm",
    "DynamicQuantizeMatMul",
)


def integer_kernels(optimized: onnx.ModelProto) -> dict[str, int]:
    """Integer kernels in onnxruntime's optimized model, by op type (the host's real work)."""
    c = Counter(n.op_type for n in optimized.graph.node if n.op_type in INTEGER_KERNELS)
    return dict(c)


def _zp_type(g: onnx.GraphProto, name: str) -> str:
    for i in g.initializer:
        if i.name == name:
            return onnx.helper.tensor_dtype_to_np_dtype(i.data_type).name
    return "?"


def accuracy(ref: Sequence[np.ndarray], got: Sequence[np.ndarray]) -> dict[str, float]:
    """Cosine (worst output) and max absolute error of ``got`` against ``ref``, over the
    positions finite in both; a NaN or infinity in one that the other does not have at the
    same place makes the error inf. (``min(1.0, nan)`` is 1.0: a masked ``-inf`` output once
    reported cosine 1 and error 0 for a region 0.013 off; found by a probe.)"""
    cos, err = 1.0, 0.0
    for r, q in zip(ref, got, strict=True):
        if r.dtype.kind != "f":
            continue
        a, b = r.astype(np.float64).ravel(), q.astype(np.float64).ravel()
        finite = np.isfinite(a) & np.isfinite(b)
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        if not (finite | same).all():
            err = math.inf
        a, b = a[finite], b[finite]
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        c = 1.0 if na == nb == 0 else float(a @ b / (na * nb)) if na and nb else 0.0
        cos = min(cos, c)
        err = max(err, float(np.abs(a - b).max()) if a.size else 0.0)
    return {"cosine": cos, "max_abs_error": err}
