"""The BPU backend plugin: ``torch.compile(model, backend="fxpass_bpu")`` and its helpers;
ahead of time, ``export(model, args, kwargs).save(path)`` and ``load(path)``."""

from fxpass.backends.bpu.aot.export import export, export_for_generate
from fxpass.backends.bpu.aot.package import load
from fxpass.backends.bpu.device.calibration import calibrate
from fxpass.backends.bpu.hf.generation import compile_for_generate
from fxpass.backends.bpu.host.ort import settle

__all__ = ["calibrate", "compile_for_generate", "export", "export_for_generate", "load", "settle"]
