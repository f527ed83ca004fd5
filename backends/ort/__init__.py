"""The ``ort`` device: regions as onnxruntime sessions on this machine's CPU.

``torch.compile(model, backend="fxpass_ort")``; ahead of time, ``fxpass.aot.export.export(
model, args, device="ort")`` (or ``fxpass export --device ort``) and ``load(path)``. A product
of its own, and the BPU device's host stand-in (which composes it). Everything it has is the
shared ONNX plumbing (``fxpass.backends.onnx``): the lowering, the host fusions and the
executor; this module only says so to the framework.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from torch.fx import Node

from fxpass.device import Artifact, Context, Device, DeviceError, Files, Region, check_threads

QUANTIZE_HELP = (
    "quantize regions: 'w4' / 'w8' (weight-only int4/int8 blocks, onnxruntime's MatMulNBits; "
    "no calibration: the fast decode path on the host), or calibrated Q/DQ like the board: "
    "'w8a16' (int8 per-channel weights, int16 activations), 'w8a8', True (w8a16) or "
    "{'config', 'method', 'percentile'}, calibrated with "
    "fxpass.backends.onnx.calibration.calibrate(fn, batches) (default None)")


@dataclass(frozen=True)
class OrtOptions:
    threads: int | None = None
    host_fusions: bool = True
    tiered: bool = True
    prepack_one_row: bool = True
    quantize: str | dict | bool | None = None
    block_size: int | None = None
    symmetric: bool | None = None
    accuracy_level: int | None = None
    algorithm: str | None = None


class OrtDevice(Device):
    name = "ort"
    target = "ort"
    description = "onnxruntime on the host CPU"
    Options: ClassVar[type] = OrtOptions
    OPTIONS: ClassVar[dict[str, tuple[Any, str]]] = {
        "threads": ((int, type(None)), "onnxruntime intra-op threads"),
        "host_fusions": (bool, "onnxscript's onnxruntime fusions on host regions (default "
                         "True)"),
        "tiered": (bool, "host regions that prepack large weights run an in-place-weights "
                   "session until the prepacked one is built in the background (default True); "
                   "False builds it first"),
        "prepack_one_row": (bool, "host regions that multiply one row per GEMM (a decode step, "
                            "a 1-token forward) prepack their weights too (default True: ~1.2x "
                            "faster, a packed copy of the weights per region); False reads them "
                            "in place and holds no copy"),
        "quantize": ((str, dict, bool, type(None)), QUANTIZE_HELP),
        "block_size": ((int, type(None)), "weight-only: weights per scale, a power of two >= 16 "
                       "(default 32, GenAI's; onnxruntime's own is 128)"),
        "symmetric": ((bool, type(None)), "weight-only: no zero points (default True)"),
        "accuracy_level": ((int, type(None)), "weight-only: MatMulNBits' compute type, 4 int8 "
                           "activations (default, the fast CPU path), 1 fp32, 0 the kernel's"),
        "algorithm": ((str, type(None)), "weight-only: 'rtn' (round to nearest, default) or "
                      "'hqq' (half-quadratic, w4 only)"),
    }
    unkeyed = ("tiered", "threads")
    modules = ("fxpass.backends.onnx", "fxpass.backends.ort")
    #: ``python -m benchmarks.probes.ort_overhead`` measured 4.4 us per onnxruntime call and
    #: 113 GMAC/s on this 2-core machine: break-even ~0.5M MACs
    min_macs = 500_000
    host = True

    def check_options(self, raw: dict[str, Any]) -> Any:
        from fxpass.backends.onnx import weight_only
        from fxpass.backends.onnx.quantize import CONFIGS, QuantizationError, resolve_config

        opts = Device.check_options(self, raw)
        check_threads(opts.threads, "threads", f"fxpass_{self.name}", "onnxruntime")
        try:  # a bad quantize value fails here, not per region
            if weight_only.from_options(opts) is None:
                resolve_config(opts.quantize)
        except QuantizationError as e:
            also = (f"; or weight-only {sorted(weight_only.BITS)} (blocks read by MatMulNBits, "
                    "no calibration)") if isinstance(opts.quantize, str) and (
                opts.quantize not in CONFIGS) else ""
            raise TypeError(f"fxpass_{self.name} option 'quantize': {e}{also}") from None
        return opts

    def needs_frozen_weights(self, opts: Any) -> str | None:
        from fxpass.backends.onnx import weight_only
        from fxpass.backends.onnx.quantize import resolve_config

        if weight_only.from_options(opts) is not None:
            return ("weight-only quantization (option 'quantize') needs freeze_weights=True: "
                    "the weights are quantized when the region is built, and guarded; with "
                    "freeze_weights=False they are inputs, read in float on every call. Drop "
                    "freeze_weights=False, or quantize=None")
        if resolve_config(opts.quantize) is None:
            return None
        # weights that are inputs would be calibrated as activations, once: after an update
        # the region kept the old ranges (found by a probe: cosine 0.89, no warning)
        return ("quantization (option 'quantize') needs freeze_weights=True: weights are "
                "quantized per channel when the region is built, and guarded; with "
                "freeze_weights=False they would be graph inputs quantized with calibrated "
                "activation ranges that a weight update silently outdates. Drop "
                "freeze_weights=False, or quantize=None")

    def capability(self, opts: Any) -> Any:
        from fxpass.backends.onnx.lowering import Reasons

        return Reasons(None)  # every op the lowering emits, cached per node for one run

    def reject(self, node: Node, opts: Any) -> str | None:
        return self.capability(opts)(node)

    def label(self, opts: Any) -> str:
        return "onnxruntime"

    def versions(self, opts: Any) -> dict[str, str]:
        return dict(_versions())

    def prepare(self, opts: Any) -> None:
        from fxpass.backends.onnx.preload import preload_onnxruntime

        preload_onnxruntime()

    def compile(self, region: Region, ctx: Context) -> Artifact:
        from fxpass.backends.onnx.compile import compile_region

        return compile_region(region, ctx)

    def calibrates(self, opts: Any) -> bool:
        from fxpass.backends.onnx import weight_only

        return weight_only.from_options(opts) is None and Device.calibrates(self, opts)

    def plans(self, opts: Any) -> bool:
        from fxpass.backends.onnx import weight_only

        # calibrated regions are built by calibrate(), which a plan cannot replay
        return opts.quantize is None or weight_only.from_options(opts) is not None

    def reopen(self, region: Region, weights: dict, ctx: Context) -> Artifact | None:
        from fxpass.backends.onnx.host.entry import cached_ort

        o = ctx.device_options
        return cached_ort(ctx.cache, region.key, region.input_names, o.threads, weights,
                          o.tiered, rebuild=_weights_rebuild(region, ctx))

    def save(self, region: Region, artifact: Artifact, files: Files, weights: Any) -> dict:
        """``region_<name>.onnx``: a float region's model with its weights external data in
        the package's weights file (each stored once across regions and programs); a
        quantized region's calibrated QDQ model, weights inside, and its ``quantize`` record."""
        name = f"region_{region.name}.onnx"
        if artifact.data is None:  # quantizing: its artifact exists once calibrated
            active, fields = quantized(region, artifact)
            files.path(name).write_bytes(active.source)
            return {"executor": "onnxruntime", "model": name, **fields}
        from fxpass.backends.onnx.lowering.driver import point_external

        proto, arrays = artifact.data
        layout = {w: weights.add(array(), "onnx") for w, (_, _, array) in arrays.items()}
        model = type(proto)()
        model.CopyFrom(proto)
        point_external(model, arrays, layout, weights.name)
        files.path(name).write_bytes(model.SerializeToString())
        return {"executor": "onnxruntime", "model": name}

    def can_open(self, entry: dict[str, Any]) -> str | None:
        if entry.get("executor", "onnxruntime") != "onnxruntime" or "model" not in entry:
            return (f"entry {entry.get('executor')!r} ({entry.get('model')}) is not an "
                    f"onnxruntime model, which is all device {self.name!r} runs")
        return None

    def open(self, entry: dict[str, Any], files: Files) -> Any:
        from fxpass.backends.onnx.host.ort import OrtExecutor

        return OrtExecutor(str(files.path(entry["model"])), entry["input_names"])

    def calibration(self) -> Any:
        from fxpass.backends.onnx import calibration

        return calibration

    def settle(self) -> None:
        from fxpass.backends.onnx.host.ort import settle

        settle()


@functools.cache
def _versions() -> tuple[tuple[str, str], ...]:
    """onnxscript's version from its metadata: importing it costs ~1 s, and a warm process
    that loads its plan never needs the module itself."""
    import contextlib
    import importlib.metadata

    import onnx
    import onnxruntime

    v = {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        v["onnxscript"] = importlib.metadata.version("onnxscript")  # shapes the host fusions
    return tuple(v.items())


def quantized(region: Region, artifact: Artifact) -> tuple[Any, dict[str, Any]]:
    """A calibrated region's artifact (the executor it runs) and its ``quantize`` record; a
    ``DeviceError`` for one never calibrated (a package holds no float stand-in for it)."""
    q = artifact.executor
    if getattr(q, "active", None) is None or q.active is q.float:
        raise DeviceError(
            f"region {region.name} is not calibrated, and a package holds no float stand-in "
            "for a quantized region: export with calibration=[...] (export() does this itself)")
    i = q.info
    return q.active, {"quantize": {
        "config": i.config, "march": i.march, "batches": i.batches, "cosine": i.cosine,
        "max_abs_error": i.max_abs_error, "ranges_digest": i.ranges_digest}}


DEVICE = OrtDevice()


def fxpass_devices() -> list[Device]:
    return [DEVICE]


def fxpass_targets() -> list[Any]:
    from fxpass.plugins import Target

    # onnxruntime's CPU kernels have no BF16 GEMM: regions compute BF16 models in float32
    return [Target(name="ort", description="onnxruntime on the host CPU; no BF16 kernels",
                   enable=("bf16_promotion", "bf16_cast_cancel"))]


__all__ = ["DEVICE", "OrtDevice", "OrtOptions", "quantized"]


def _weights_rebuild(region: Region, ctx: Context) -> Callable[[], Any] | None:
    """For a plan hit whose entry lacks its weights file (a remote tier keeps none): the
    prepacked session rebuilt from the region's graph, made again (``Region.rebuild``)."""
    if region.rebuild is None:
        return None

    def rebuild(untiered: bool = False) -> Any:
        from fxpass.backends.onnx.host.build import rebuild_weights, unchanged_check

        o = ctx.device_options
        rg = Region(region.rebuild(), region.name, region.key, region.input_names,
                    region.sources)
        # the graph made again must have the entry's inputs and weights, or its weights file
        # would be built for another graph (the rules and partition are deterministic; this
        # is the check that they were)
        phs = [p.name for p in rg.gm.graph.find_nodes(op="placeholder")]
        attrs = {n.target for n in rg.gm.graph.find_nodes(op="get_attr")}
        if phs != list(region.input_names) or not set(region.sources) <= attrs:
            raise RuntimeError(f"region {region.name} rebuilt as another graph (inputs "
                               f"{phs[:4]}..., not {list(region.input_names)[:4]}...)")
        buffers = {c: getattr(rg.gm, c) for c in rg.sources}
        return rebuild_weights(rg, rg.name, rg.key, rg.input_names, ctx.cache, o.threads,
                               o.host_fusions, None if o.prepack_one_row else 1, buffers,
                               unchanged_check(rg, buffers), untiered)
    return rebuild
