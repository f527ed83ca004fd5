"""Quantized and board regions, ahead of time: ``export(..., calibration=batches)``.

Why here and not at load: calibration needs the model's real activations at each region's
boundary, and a package must load with nothing left to compile. So ``export`` compiles each
quantizing region as the JIT path does (its float model on the host until calibrated),
runs the exported program itself over the calibration data with recording on, then
calibrates, quantizes and compiles every region (strictly: a region that fails to quantize
fails the export, never a package that silently runs float). The package then holds each
region's quantized artifact: the QDQ model for the host executor, or the board's ``.hbm``
(compiled by hbdk4, which a workstation has; the board runtime it does not need).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxpass.aot.runtime import ExportError
from fxpass.jit.options import Options


def quantizes(opts: Options) -> bool:
    """Whether ``opts`` make calibrated regions (``quantize``, or a device that always does;
    ``Device.calibrates``)."""
    return opts.get_device().calibrates(opts.dev)


def check_calibration(opts: Options, calibration: Any, what: str) -> list[Any] | None:
    """The calibration data as a list, or a clear error when it is missing or not needed."""
    if not quantizes(opts):
        if calibration is not None:
            raise ExportError(
                f"{what}: calibration data was given but nothing is quantized; pass "
                "options={'quantize': 'w8a16'} (or a device that always quantizes), or drop "
                "calibration=")
        return None
    batches = list(calibration) if calibration is not None else []
    if not batches:
        raise ExportError(
            f"{what}: quantized regions (option 'quantize', or a device that always "
            "quantizes) need calibration data at export time, as a package loads with nothing "
            "left to compile: pass calibration=[...] (a few representative inputs)")
    return batches


def check_like(batches: list[Any], args: tuple, kwargs: dict[str, Any], device: Any) -> None:
    """Calibration batches shaped like the exported call, else a clear error."""
    from fxpass.aot.batches import call_args, shape_of

    device.calibration().check_batches(batches)
    call = call_args(batches[0])
    if shape_of(call) != shape_of((args, kwargs)):
        raise ExportError(
            f"calibration batches are {shape_of(call)}, the model is exported for "
            f"{shape_of((args, kwargs))}: calibrate with inputs of the exported shapes")


def calibrate(lowered: Sequence[Any], run: Callable[[Any], Any], batches: list[Any],
              say: Callable[[str], None]) -> list[Any]:
    """Run ``run(batch)`` for each batch with recording on, then quantize every region of
    ``lowered`` (``aot.export.Lowered``); every quantizing region must have seen data."""
    from fxpass.plugins import get_device

    waiting = [r for low in lowered for r in low.regions if r.quantizing is not None]
    if not waiting:
        return []
    say(f"calibrating {len(waiting)} region(s) on {len(batches)} input(s)")
    calib = get_device(lowered[0].report.device).calibration()
    with calib.recording() as session, torch.no_grad():
        for b in batches:
            run(b)
    unseen = [r.name for r in waiting if r.quantizing not in session.samples]
    if unseen:
        raise ExportError(
            f"regions {unseen} saw none of the calibration data; give inputs that reach "
            "them (for bucketed encoders: inputs of every bucket's size)")
    return calib.finish(session, strict=True)


class _Held:
    """An exported program as ``aot.runner.Runner`` calls a loaded one, over shared state."""

    def __init__(self, low: Any, state: dict[str, torch.Tensor]):
        self._low = low
        self._run = low.runner()
        self._prefix = (*low.weights.values(), *[state[k] for k in low.state])
        self.spec = {"cpu_threads": low.cpu_threads}

    def step(self, *inputs: Any) -> tuple[Any, ...]:
        return tuple(self._run(*self._prefix, *inputs))

    def bind(self, state: dict[str, torch.Tensor]) -> Callable[..., tuple[Any, ...]]:
        """``step`` over ``state`` (``package.LoadedProgram.bind``)."""
        run, low = self._run, self._low
        prefix = (*low.weights.values(), *[state[k] for k in low.state])
        return lambda *inputs: tuple(run(*prefix, *inputs))


class HeldPackage:
    """Exported (not yet saved) programs in the shape a loaded ``package.Package`` has, so the
    loaded package's runners (``Runner``, ``EncoderRunner``) drive the calibration runs."""

    def __init__(self, what: str, manifest: dict[str, Any], programs: dict[str, Any],
                 state: dict[str, torch.Tensor] | None = None):
        self.path, self.manifest, self.programs = f"<{what}>", manifest, programs
        self.state = state or {}


def generate_runner(prefill: Any, decode: Any, meta: dict[str, Any]) -> Any:
    """A ``Runner`` over the exported (not yet saved) prefill and decode programs."""
    from fxpass.aot.runner import Runner

    state = {k: torch.zeros_like(t) for k, t in prefill.state.items()}
    programs = {"prefill": _Held(prefill, state), "decode": _Held(decode, state)}
    return Runner(HeldPackage("export_for_generate", {"generate": meta}, programs, state))
