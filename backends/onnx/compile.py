"""Compile one region through ONNX: lower, then an onnxruntime session on the host, or a
device's own compiler for the QDQ model (the BPU's hbdk4, handed in as ``board``).

Quantization is opt-in on the host and required by an integer device: a quantized region
starts as the float lowering on the host (a ``QuantizingExecutor``); ``calibrate()`` records
its inputs, and only the calibrated QDQ model reaches the device's compiler (or the host
session). Its cache key adds the config and the calibration ranges' digest to the float
region's key.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import onnx

from fxpass.backends.onnx import quantize as Q
from fxpass.backends.onnx import weight_only as W
from fxpass.backends.onnx.calibration import QuantInfo, QuantizingExecutor
from fxpass.backends.onnx.host.build import _fused, build_ort, compile_ort, quantized_ort
from fxpass.backends.onnx.host.ort import OrtExecutor
from fxpass.backends.onnx.lowering import lower, lower_weightless, write_weights
from fxpass.device import Context, Region
from fxpass.jit.cache import ArtifactCache, warn_unloadable
from fxpass.jit.runtime import Compiled


class Board(Protocol):
    """A device compiler for calibrated QDQ models (the BPU's hbdk4 and its runtime)."""

    kind: str

    def quantized(self, name: str, key: str, input_names: list[str], march: str,
                  cache: ArtifactCache | None, make_qdq: Any) -> tuple[Any, bool, dict]: ...

    def exported(self, name: str, march: str, make_qdq: Any,
                 host: Any) -> tuple[Any, bool, dict]: ...


def compile_region(region: Region, ctx: Context, *, march: str = "host",
                   board: Board | None = None, quantize: Any = None) -> Compiled:
    """One region through ONNX. The device options read here are the host executor's
    (``threads``, ``host_fusions``, ``tiered``, ``prepack_one_row``, ``quantize``).

    ``board``: the QDQ model goes to it rather than to onnxruntime, always quantized (with
    ``quantize``, the device's required config, when the user chose none). ``ctx.keep``:
    for ``export``; the region must stand alone (no weight read from the caller's tensors,
    no cache, no second tier) and ``Compiled.data`` keeps what the package writes."""
    o = ctx.device_options
    rg, name, key, keep = region, region.name, region.key, ctx.keep
    cache = None if keep else ctx.cache
    wq = W.from_options(o)
    if wq is not None:
        return compile_weight_only(rg, ctx, wq)
    cfg = Q.resolve_config(o.quantize if o.quantize is not None else quantize)
    if cfg is None and board is not None:
        cfg = Q.CONFIGS[Q.DEFAULT_CONFIG]
    if cfg is not None:
        return _compile_quantizing(rg, name, key, rg.input_names, march, board, cfg, cache,
                                   o.threads, keep)
    rows = None if o.prepack_one_row else 1  # 1: one row reads in place
    if keep:
        proto, weights = lower_weightless(rg.gm, name=name, gemm=True)
        return build_ort(rg, key, rg.input_names, None, o.threads, proto, weights, {},
                         None if o.host_fusions else {}, rows=rows, keep=True)
    return compile_ort(rg, name, key, rg.input_names, cache, o.threads, o.host_fusions,
                       o.tiered, rows)


def _compile_quantizing(
    rg: Region,
    name: str,
    key: str,
    input_names: list[str],
    march: str,
    board: Board | None,
    cfg: Q.QuantConfig,
    cache: ArtifactCache | None,
    threads: int | None,
    keep: bool = False,
) -> Compiled:
    """A region that runs its float lowering on the host until ``calibrate()`` quantizes it.

    The float model is the plain lowering (no host fusions): the QDQ model must be the graph
    the board gets, and onnxruntime's own QDQ fusions turn it into integer kernels on the host.
    ``keep`` (``export``): the quantized executor keeps what a package writes (the host's
    QDQ model, or the board's ``.hbm`` built without a board, ``board.exported_hbm``).
    """
    proto = lower(rg.gm, name=name)
    data = proto.SerializeToString()
    float_ex = OrtExecutor(data, input_names, threads=threads)
    kind = board.kind if board is not None else "onnxruntime"
    info = QuantInfo(region=name, config=cfg.name, march=march, target=kind)

    # host, int16 activations: no integer CPU kernels, so dequantize the weights once
    fold = kind == "onnxruntime" and cfg.activations == "int16"

    def build(digest: str, make_qdq: Any) -> tuple[Any, bool, dict]:
        qkey = quantized_key(key, cfg, digest, "fold-weights" if fold else "")
        info.key = qkey
        if board is not None and keep:
            return board.exported(name, march, make_qdq,
                                  lambda data: OrtExecutor(data, input_names, threads=threads))
        if board is not None:
            return board.quantized(name, qkey, input_names, march, cache, make_qdq)
        return quantized_ort(qkey, input_names, march, cache, threads, make_qdq, fold, keep)

    ex = QuantizingExecutor(info, proto, float_ex, cfg, build)
    return Compiled(ex, key, False, len(data))


def quantized_key(float_key: str, cfg: Q.QuantConfig, digest: str, variant: str = "") -> str:
    """The quantized artifact's key: the float region's key (graph, weights, march, options,
    tools) plus the quantization config, the digest of the calibration ranges and the
    artifact variant (host weight folding)."""
    import hashlib

    text = json.dumps([float_key, cfg.key(), digest, variant], sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=24).hexdigest()




def compile_weight_only(rg: Region, ctx: Context, cfg: W.WeightOnly) -> Compiled:
    """A region whose large MatMuls read int8/int4 weights (``weight_only``), as one
    onnxruntime session. The lowering keeps ``MatMul`` over the transposed weight (the form
    onnxruntime's quantizer takes), the host fusions run on the weightless model, then the
    weights go in and are quantized. The cache keeps the quantized model (its weights inside,
    a quarter or an eighth of the float bytes) under the region's key, which covers the
    options. ``ctx.keep`` (export): ``Compiled.data`` is the weightless quantized model and
    its weights, which the package writes once across regions and programs."""
    o, name, key = ctx.device_options, rg.name, rg.key
    cache = None if ctx.keep else ctx.cache
    if cache is not None:
        data, meta = cache.get(key, ".wq.onnx"), cache.get(key, ".wq.json")
        if data is not None and meta is not None:
            try:
                fusions = json.loads(meta)["fusions"]
                ex = OrtExecutor(data, rg.input_names, threads=o.threads)
                return Compiled(ex, key, True, len(data), fusions)
            except Exception as e:  # noqa: BLE001 - a cached entry that does not load: rebuild
                warn_unloadable(cache.path(key, ".wq.onnx"), e)
    proto, weights = lower_weightless(rg.gm, name=name)
    fusions: dict[str, int] = {}
    if o.host_fusions:
        proto, fusions, weights = _fused(proto, weights)
    qproto, summary = W.quantize_model(write_weights(proto, weights), cfg)
    del proto, weights
    fusions = {**fusions, f"matmul_nbits_{cfg.name}": summary["matmul_nbits"],
               "matmul_nbits_kernels": summary["kernels"],
               "gather_block_quantized": summary["gather_block_quantized"],
               "shared_tables": summary["shared_tables"],
               **{f"kept_float ({why})": n for why, n in summary["kept_float"].items()}}
    kept = None
    if ctx.keep:
        external = W.split_weights(qproto)
        weightless = onnx.ModelProto()
        weightless.CopyFrom(qproto)
        for t in weightless.graph.initializer:
            if t.name in external:
                t.ClearField("raw_data")
        kept = (weightless, external)
    data = qproto.SerializeToString()
    del qproto
    ex = OrtExecutor(data, rg.input_names, threads=o.threads)
    if cache is not None and cache.put(key, ".wq.onnx", data) is not None:
        cache.put(key, ".wq.json", json.dumps({"fusions": fusions, **summary}).encode())
    return Compiled(ex, key, False, len(data), fusions, kept)
