"""The BPU as an fxpass device: only what is the BPU's.

The march tables (``capability``), the hbdk4 compile and the board executor (``board``), and
the executor choice: ``auto`` is the board when hbdk4 and the board runtime import, else the
host stand-in, which is the ``ort`` device composed (its options, compile and cache reopen),
not copied. The board needs integer MAC inputs, so its regions are always quantized
(``requires_quantization``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, ClassVar

from torch.fx import Node

from fxpass.backends.bpu.marches import DEFAULT_MARCH
from fxpass.backends.ort import OrtDevice, OrtOptions, quantized
from fxpass.device import Artifact, Context, Device, Files, Region

#: executors: ``auto`` is the board when hbdk4 and its runtime import, else the host
EXECUTORS = ("auto", "hbdnn", "onnxruntime")
#: The original pull request measured ~0.8 ms per BPU submission; 100M MACs keeps a region
#: well above that. The host stand-in takes the ``ort`` device's threshold.
BOARD_MIN_MACS = 100_000_000
#: the ``ort`` device's weight-only fields: host formats, not the board's
WEIGHT_ONLY_FIELDS = ("block_size", "symmetric", "accuracy_level", "algorithm")


@dataclass(frozen=True)
class BpuOptions(OrtOptions):
    march: str = DEFAULT_MARCH
    executor: str = "auto"


def resolve_executor(executor: str) -> str:
    from fxpass.backends.bpu.board import HBDK4_HELP, has_board, has_hbdk4

    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    if executor == "auto":
        return "hbdnn" if has_hbdk4() and has_board() else "onnxruntime"
    if executor == "hbdnn" and not has_hbdk4():
        raise RuntimeError(HBDK4_HELP)
    return executor


class _Board:
    """hbdk4 for the shared ONNX compile (``fxpass.backends.onnx.compile.Board``)."""

    kind = "hbdnn"

    def quantized(self, *args: Any) -> tuple[Any, bool, dict]:
        from fxpass.backends.bpu.board import quantized_hbm

        return quantized_hbm(*args)

    def exported(self, *args: Any) -> tuple[Any, bool, dict]:
        from fxpass.backends.bpu.board import exported_hbm

        return exported_hbm(*args)


class BpuDevice(Device):
    name = "bpu"
    target = "bpu"
    description = "Horizon/D-Robotics BPU (hbdk4); no BF16, static shapes only"
    Options: ClassVar[type] = BpuOptions
    modules = ("fxpass.backends.onnx", "fxpass.backends.ort", "fxpass.backends.bpu")
    host_device = OrtDevice()

    @property
    def OPTIONS(self) -> dict[str, tuple[Any, str]]:  # noqa: N802 - the Device attribute
        from fxpass.backends.bpu.marches import CORES

        return {"march": (str, f"target march, one of {sorted(CORES)} (default "
                          f"{DEFAULT_MARCH})"),
                "executor": (str, f"one of {EXECUTORS} (default auto)"),
                **{k: v for k, v in self.host_device.OPTIONS.items()
                   if k not in WEIGHT_ONLY_FIELDS}}

    unkeyed = OrtDevice.unkeyed

    def check_options(self, raw: dict[str, Any]) -> Any:
        from fxpass.backends.bpu.capability import march
        from fxpass.backends.onnx import weight_only

        host_only = sorted(set(raw) & set(WEIGHT_ONLY_FIELDS))
        if host_only:
            raise TypeError(
                f"fxpass_bpu option {host_only[0]!r} belongs to weight-only quantization, a "
                "host format the board does not run: drop it, or use device 'ort' "
                "(backend='fxpass_ort') for weight-only decode on the host")
        opts = OrtDevice.check_options(self, raw)  # the host's checks, on the BPU's fields
        march(opts.march)  # ValueError naming the known marches
        if isinstance(opts.quantize, str) and opts.quantize in weight_only.BITS:
            raise TypeError(
                f"fxpass_bpu option 'quantize': {opts.quantize!r} is the host's weight-only "
                "format, which the board does not run (its MAC ops take calibrated int8 weights "
                "and int8/int16 activations): use 'w8a8' or 'w8a16' here, or device 'ort' "
                "(backend='fxpass_ort') for weight-only decode on the host")
        if opts.executor not in EXECUTORS:
            raise TypeError(f"fxpass_bpu option 'executor' must be one of {EXECUTORS}, got "
                            f"{opts.executor!r}")
        return opts

    def needs_frozen_weights(self, opts: Any) -> str | None:
        why = self.host_device.needs_frozen_weights(opts)
        if why is None and opts.executor == "hbdnn":
            why = self.host_device.needs_frozen_weights(OrtOptions(quantize="w8a16"))
        return why and why.replace("(option 'quantize')",
                                   "(option 'quantize', or executor='hbdnn', which always "
                                   "quantizes)")

    def capability(self, opts: Any) -> Any:
        from fxpass.backends.bpu.capability import Capability, march

        return Capability(march(opts.march))

    def reject(self, node: Node, opts: Any) -> str | None:
        return self.capability(opts)(node)

    def label(self, opts: Any) -> str:
        return resolve_executor(opts.executor)

    def runs_on_host(self, opts: Any) -> bool:
        return self.label(opts) == "onnxruntime"

    def min_region_macs(self, opts: Any) -> int:
        return BOARD_MIN_MACS if self.label(opts) == "hbdnn" else self.host_device.min_macs

    def versions(self, opts: Any) -> dict[str, str]:
        v = self.host_device.versions(opts)
        try:  # looked up per call: it may be installed (or faked in tests) after the first
            import hbdk4.compiler  # noqa: F401

            v["hbdk4"] = getattr(__import__("hbdk4"), "__version__", "unknown")
        except ImportError:
            pass
        return v

    def prepare(self, opts: Any) -> None:
        if self.label(opts) == "onnxruntime":  # a missing hbdk4 raises in label()
            self.host_device.prepare(opts)

    def requires_quantization(self, opts: Any) -> str | None:
        return "w8a16" if self.label(opts) == "hbdnn" else None

    def compile(self, region: Region, ctx: Context) -> Artifact:
        from fxpass.backends.onnx.compile import compile_region

        o = ctx.device_options
        board = _Board() if self.label(o) == "hbdnn" else None
        return compile_region(region, ctx, march=o.march, board=board)

    def plans(self, opts: Any) -> bool:
        return self.runs_on_host(opts) and self.host_device.plans(opts)

    def reopen(self, region: Region, weights: dict, ctx: Context) -> Artifact | None:
        return self.host_device.reopen(region, weights, ctx)

    def calibration(self) -> Any:
        return self.host_device.calibration()

    def settle(self) -> None:
        self.host_device.settle()

    # -- package: a board region is its .hbm; a host region is the ort device's ----------
    def save(self, region: Region, artifact: Artifact, files: Files, weights: Any) -> dict:
        if artifact.data is None and getattr(artifact.executor, "kind", "") == "hbdnn":
            active, fields = quantized(region, artifact)  # a BoardArtifact: the hbm, compiled
            name = f"region_{region.name}.hbm"
            files.path(name).write_bytes(active.hbm)
            return {"executor": "hbdnn", "model": name, "march": fields["quantize"]["march"],
                    **fields}
        return self.host_device.save(region, artifact, files, weights)

    def can_open(self, entry: dict[str, Any]) -> str | None:
        import importlib.util

        from fxpass.backends.bpu.marches import CORES

        m, ex = entry.get("march", DEFAULT_MARCH), entry.get("executor")
        if m not in CORES:
            return f"march {m!r} is not one this fxpass knows ({sorted(CORES)})"
        # board.has_board()'s test, without importing the board module (onnx, 75 ms of a load)
        if ex == "hbdnn" and importlib.util.find_spec("hbm_runtime") is None:
            return (f"its regions are .hbm for the BPU ({m}), which only the board runtime "
                    "(`hbm_runtime`, on the RDK board image) runs: load the package on the "
                    "board, or export with executor='onnxruntime' for a host")
        if ex not in EXECUTORS[1:]:
            return (f"executor {ex!r} is not one this fxpass runs ('onnxruntime' on a host, "
                    "'hbdnn' on the board)")
        return None if ex == "hbdnn" else self.host_device.can_open(entry)

    def open(self, entry: dict[str, Any], files: Files) -> Any:
        if entry["executor"] != "hbdnn":
            return self.host_device.open(entry, files)
        from fxpass.backends.bpu.board import HbmExecutor

        with _BOARD_OPEN:  # the framework opens regions on threads; the board's one at a time
            return HbmExecutor(str(files.path(entry["model"])), entry["input_names"])


_BOARD_OPEN = threading.Lock()


DEVICE = BpuDevice()
