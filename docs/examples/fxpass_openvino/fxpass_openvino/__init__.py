"""OpenVINO as an fxpass device: regions of a torch graph compiled by OpenVINO.

``torch.compile(model, backend="fxpass_openvino")``; ahead of time
``fxpass.aot.export.export(model, args, device="openvino").save(path)`` and
``fxpass.aot.package.load(path)``; ``fxpass explain MODEL --device openvino``. OpenVINO reads
ONNX, so this device reuses fxpass's shared ONNX lowering: what the lowering can emit is what
the device takes, a region becomes an ONNX model, and OpenVINO compiles that for its
``device_name``. Everything else (rules, partition, splice, guards, shape variants, caches,
packages, reports, the CLI) is the framework's.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch.fx import Node

from fxpass.device import Artifact, Context, Device, Files, Region, check_threads
from fxpass.plugins import Target

INSTALL = "pip install openvino (fxpass-openvino was tested with 2026.4.1)"
HINTS = ("LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT")
PRECISIONS = ("f32", "bf16", "f16")


@dataclass(frozen=True)
class OpenVinoOptions:
    device_name: str = "CPU"
    hint: str = "LATENCY"
    precision: str = "f32"
    threads: int | None = None


class OpenVinoDevice(Device):
    name = "openvino"
    target = "openvino"
    description = "OpenVINO (CPU by default) through the shared ONNX lowering"
    Options: ClassVar[type] = OpenVinoOptions
    OPTIONS: ClassVar[dict[str, tuple[Any, str]]] = {
        "device_name": (str, "the OpenVINO device: CPU, GPU, NPU, AUTO... (default CPU)"),
        "hint": (str, f"OpenVINO's PERFORMANCE_HINT, one of {HINTS} (default LATENCY)"),
        "precision": (str, f"OpenVINO's INFERENCE_PRECISION_HINT, one of {PRECISIONS} "
                      "(default f32: eager's numbers; a CPU with BF16 would use bf16)"),
        "threads": ((int, type(None)), "OpenVINO's INFERENCE_NUM_THREADS (default: its own)"),
    }
    unkeyed = ("hint", "threads")  # they change no number a region computes
    # the shared lowering is part of what this device's artifacts are made of
    modules = ("fxpass_openvino", "fxpass.backends.onnx")
    #: a call costs ~24 us, a large matmul runs at 40-98 GMAC/s on a 2-core host: break-even
    #: at 1-2.3M MACs (docs/writing-a-backend.md, section 2)
    min_macs = 2_000_000
    host = True

    def check_options(self, raw: dict[str, Any]) -> Any:
        opts = Device.check_options(self, raw)  # the types, from OPTIONS
        for key, allowed in (("hint", HINTS), ("precision", PRECISIONS)):
            if getattr(opts, key) not in allowed:
                raise TypeError(f"fxpass_openvino option {key!r} must be one of {allowed}, "
                                f"got {getattr(opts, key)!r}")
        check_threads(opts.threads, "threads", "fxpass_openvino", "OpenVINO")
        return opts

    # -- capability: what the shared ONNX lowering can emit --------------------------------
    def capability(self, opts: Any) -> Any:
        from fxpass.backends.onnx.lowering import Reasons

        return Reasons(None)  # one per partition run: it caches its verdicts per node

    def reject(self, node: Node, opts: Any) -> str | None:
        return self.capability(opts)(node)

    def runs_on_host(self, opts: Any) -> bool:
        return opts.device_name == "CPU"

    def label(self, opts: Any) -> str:
        return f"openvino:{opts.device_name}"

    # -- identity ---------------------------------------------------------------------------
    def versions(self, opts: Any) -> dict[str, str]:
        import onnx
        import openvino

        return {"openvino": openvino.__version__, "onnx": onnx.__version__}

    def prepare(self, opts: Any) -> None:
        if why := _missing(opts.device_name):
            raise RuntimeError(f"fxpass_openvino: {why}")

    # -- compile, save, open ----------------------------------------------------------------
    def compile(self, region: Region, ctx: Context) -> Artifact:
        from fxpass.backends.onnx.lowering import lower

        data = lower(region.gm, name=region.name).SerializeToString()
        opts = ctx.device_options
        run = OpenVinoExecutor(data, region.input_names, opts)
        kept = {"onnx": data, "options": asdict(opts)} if ctx.keep else None
        return Artifact(run, size=len(data), data=kept)

    def save(self, region: Region, artifact: Artifact, files: Files,
             weights: Any) -> dict[str, Any]:
        name = f"region_{region.name}.onnx"
        files.path(name).write_bytes(artifact.data["onnx"])
        return {"model": name, "input_names": list(region.input_names),
                "options": artifact.data["options"]}

    def can_open(self, entry: dict[str, Any]) -> str | None:
        return _missing(entry.get("options", {}).get("device_name", "CPU"))

    def open(self, entry: dict[str, Any], files: Files) -> OpenVinoExecutor:
        opts = OpenVinoOptions(**entry["options"])
        return OpenVinoExecutor(str(files.path(entry["model"])), entry["input_names"], opts)


class OpenVinoExecutor:
    """A compiled region: torch tensors in (the region's inputs, in order), torch tensors out.

    One infer request per thread: a request is not thread-safe, and a package's runner may be
    shared by threads. ``model`` is the ONNX model's bytes or its path."""

    def __init__(self, model: bytes | str, input_names: list[str], opts: OpenVinoOptions):
        import openvino

        config: dict[str, Any] = {"PERFORMANCE_HINT": opts.hint,
                                  "INFERENCE_PRECISION_HINT": opts.precision}
        if opts.threads is not None:
            config["INFERENCE_NUM_THREADS"] = opts.threads
        core = _core()
        self.compiled = core.compile_model(core.read_model(model), opts.device_name, config)
        self.input_names = list(input_names)
        self.outputs = range(len(self.compiled.outputs))
        self._tensor = openvino.Tensor
        self._local = threading.local()

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        # torch's memory, read in place (copied only when strided)
        arrays = [np.ascontiguousarray(t.detach().numpy()) for t in tensors]
        for name, array in zip(self.input_names, arrays, strict=True):
            request.set_tensor(name, self._tensor(array, shared_memory=True))
        request.infer()
        # the request reuses its output buffers: copy them before the next call does
        return tuple(torch.from_numpy(request.get_output_tensor(i).data.copy())
                     for i in self.outputs)


@functools.cache
def _core() -> Any:
    import openvino

    return openvino.Core()


def _missing(device_name: str) -> str | None:
    """Why this process cannot run OpenVINO on ``device_name``, or None."""
    try:
        import openvino  # noqa: F401
    except ImportError:
        return f"OpenVINO is not installed: {INSTALL}"
    devices, base = _core().available_devices, device_name.split(":")[0].split(".")[0]
    if base not in ("AUTO", "HETERO", "MULTI") and base not in {d.split(".")[0] for d in devices}:
        return f"OpenVINO device {device_name!r} is not available here (available: {devices})"
    return None


DEVICE = OpenVinoDevice()


def fxpass_devices() -> list[Device]:
    return [DEVICE]


def fxpass_targets() -> list[Target]:
    return [Target(name="openvino", description="OpenVINO through the shared ONNX lowering")]
