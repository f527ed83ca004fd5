"""The BPU backend plugin: ``torch.compile(model, backend="fxpass_bpu")`` and its helpers;
ahead of time, ``export(model, args, kwargs).save(path)`` and ``load(path)``.

Each name below is imported on first use (a module ``__getattr__``): a deployed process that
only calls ``load(path)`` never pays for the export, calibration or HF helpers (transformers,
onnx, Dynamo), about a second of a fresh process's start."""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs; at run time, module __getattr__ below
    from fxpass.aot.export import export, export_for_generate
    from fxpass.aot.package import load
    from fxpass.backends.onnx.calibration import calibrate
    from fxpass.backends.onnx.host.ort import settle
    from fxpass.hf.generation import compile_for_generate

#: public name -> the module that defines it
_LAZY = {
    "calibrate": "fxpass.backends.onnx.calibration",
    "compile_for_generate": "fxpass.hf.generation",
    "compile_for_encoder": "fxpass.hf.encoders",
    "export_for_encoder": "fxpass.hf.encoders",
    "export": "fxpass.aot.export",
    "export_for_generate": "fxpass.aot.export",
    "load": "fxpass.aot.package",
    "settle": "fxpass.backends.onnx.host.ort",
}

__all__ = ["calibrate", "compile_for_encoder", "compile_for_generate", "export",
           "export_for_encoder", "export_for_generate", "load", "settle"]


#: the helpers that take a device: here bound to this one
_BOUND = {"export", "export_for_generate", "compile_for_generate", "compile_for_encoder",
          "export_for_encoder"}
DEVICE = "bpu"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    if name in _BOUND:
        value = functools.partial(value, device=DEVICE)
        functools.update_wrapper(value, value.func)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
