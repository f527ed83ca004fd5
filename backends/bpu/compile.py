"""Compile one region: lower to ONNX, then hbdk4 -> ``.hbm`` (board) or an onnxruntime session.

hbdk4 flow (documented Python API; x86-64 wheels from Horizon's OpenExplorer, not installable
here, tested against a contract fake): ``hbdk4.compiler.onnx.export(proto)`` ->
``hbdk4.compiler.convert(module, march)`` -> ``hbdk4.compiler.compile(module, path, march,
opt=2)``. Executor choice: ``auto`` = the board (hbdnn) when both hbdk4 and the board runtime
import, else the host (onnxruntime); ``hbdnn`` and ``onnxruntime`` force one.

Quantization (issue 11, docs/quantization.md) is opt-in on the host and required on the
board: the tensor engine takes integer inputs only, and ``convert`` puts a float MAC op on the
board's CPU. A quantized region starts as the float lowering on the host (a
``QuantizingExecutor``); ``calibrate()`` records its inputs, and only the calibrated QDQ model
reaches hbdk4 ``export -> convert -> compile`` (or the host session). Its cache key adds the
config and the calibration ranges' digest to the float region's key.
"""

from __future__ import annotations

import json
from typing import Any

from fxpass.backends.bpu.board import (
    HBDK4_HELP,
    exported_hbm,
    has_board,
    has_hbdk4,
    quantized_hbm,
)
from fxpass.backends.onnx import quantize as Q
from fxpass.backends.onnx.calibration import QuantInfo, QuantizingExecutor
from fxpass.backends.onnx.host.build import build_ort, compile_ort, quantized_ort
from fxpass.backends.onnx.host.ort import OrtExecutor
from fxpass.backends.onnx.lowering import (
    lower,
    lower_weightless,
)
from fxpass.jit.cache import (
    ArtifactCache,
    region_key,
)
from fxpass.jit.options import EXECUTORS, Options
from fxpass.jit.runtime import Compiled
from fxpass.partition.region import RegionGraph


def resolve_executor(executor: str) -> str:
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    if executor == "auto":
        return "hbdnn" if has_hbdk4() and has_board() else "onnxruntime"
    if executor == "hbdnn" and not has_hbdk4():
        raise RuntimeError(HBDK4_HELP)
    return executor





def compile_region(
    rg: RegionGraph,
    name: str,
    *,
    march: str,
    executor: str,
    cache: ArtifactCache | None,
    options: Options,
    threads: int | None = None,
    tiered: bool = True,
    keep: bool = False,
) -> Compiled:
    """``tiered``: a host region that prepacks starts on an in-place-weights session while the
    prepacked one builds in the background (``host.ort.TieredExecutor``). ``keep``: for
    ``export``; the region must stand alone (no weight read from the caller's tensors, no
    cache, no second tier) and ``Compiled.artifact`` keeps what the package writes."""
    kind = resolve_executor(executor)
    key = region_key(rg.gm, march=march, executor=kind, options=options.region_keyed())
    input_names = [p.name for p in rg.gm.graph.find_nodes(op="placeholder")]
    cfg = Q.resolve_config(options.quantize)
    if cfg is None and kind == "hbdnn":  # the board needs integer MAC inputs (docs/bpu-facts.md)
        cfg = Q.CONFIGS[Q.DEFAULT_CONFIG]
    if cfg is not None:
        return _compile_quantizing(rg, name, key, input_names, march, kind, cfg,
                                   None if keep else cache, threads, keep)
    fuse = options.host_fusions
    rows = None if options.prepack_one_row else 1  # 1: one row reads in place
    if keep:
        proto, weights = lower_weightless(rg.gm, name=name, gemm=True)
        return build_ort(rg, key, input_names, None, threads, proto, weights, {},
                          None if fuse else {}, rows=rows, keep=True)
    return compile_ort(rg, name, key, input_names, cache, threads, fuse, tiered, rows)


def _compile_quantizing(
    rg: RegionGraph,
    name: str,
    key: str,
    input_names: list[str],
    march: str,
    kind: str,
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
    info = QuantInfo(region=name, config=cfg.name, march=march, target=kind)

    # host, int16 activations: no integer CPU kernels, so dequantize the weights once
    fold = kind == "onnxruntime" and cfg.activations == "int16"

    def build(digest: str, make_qdq: Any) -> tuple[Any, bool, dict]:
        qkey = quantized_key(key, cfg, digest, "fold-weights" if fold else "")
        info.key = qkey
        if kind == "hbdnn" and keep:
            return exported_hbm(name, march, make_qdq,
                                lambda data: OrtExecutor(data, input_names, threads=threads))
        if kind == "hbdnn":
            return quantized_hbm(name, qkey, input_names, march, cache, make_qdq)
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


