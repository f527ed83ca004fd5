"""The board: a region's calibrated QDQ model through hbdk4 to a ``.hbm``, run by the board
runtime (``hbm_runtime``), which binds inputs by name.

hbdk4 flow (documented Python API; x86-64 wheels from Horizon's OpenExplorer, not installable
here, tested against a contract fake): ``hbdk4.compiler.onnx.export(proto)`` ->
``hbdk4.compiler.convert(module, march)`` -> ``hbdk4.compiler.compile(module, path, march,
opt=2)``. The board's tensor engine takes integer inputs only, so every region the board gets
is quantized (``device.quantize``) and checked to have no float MAC op left.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from typing import Any

import onnx
import torch

from fxpass.backends.onnx import quantize as Q
from fxpass.backends.onnx.calibration import cached_summary
from fxpass.jit.cache import ArtifactCache, warn_unloadable
from fxpass.jit.runtime import Compiled
from fxpass.jit.runtime import as_numpy as _np
from fxpass.jit.runtime import as_tensor as _tensor


class HbmExecutor:
    kind = "hbdnn"

    def __init__(self, hbm_path: str, input_names: list[str]):
        try:
            from hbm_runtime import HB_HBMRuntime
        except ImportError as e:
            raise RuntimeError(
                "executor='hbdnn' needs the board runtime (`hbm_runtime`), which is only on the "
                "RDK board image; run on the board or use executor='onnxruntime' on a host"
            ) from e
        self.rt = HB_HBMRuntime(hbm_path)
        self.path = hbm_path
        self.model = self.rt.model_names[0]
        self.input_names = input_names

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        feeds = {name: _np(t) for name, t in zip(self.input_names, tensors, strict=True)}
        outs = self.rt.run(feeds, model_name=self.model)[self.model]
        return tuple(
            _tensor(outs[k])
            for k in sorted(outs, key=lambda s: int(s[3:]) if s[3:].isdigit() else 0)
        )


HBDK4_HELP = (
    "executor='hbdnn' needs hbdk4 to compile: install the hbdk4-compiler wheel from Horizon's "
    "OpenExplorer toolchain (x86-64 Linux), and run on an RDK board image that ships the "
    "`hbm_runtime` Python module; or use executor='onnxruntime' to run on the host"
)


def has_hbdk4() -> bool:
    return importlib.util.find_spec("hbdk4") is not None and _find("hbdk4.compiler")


def has_board() -> bool:
    return importlib.util.find_spec("hbm_runtime") is not None


def _find(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def quantized_hbm(
    name: str,
    key: str,
    input_names: list[str],
    march: str,
    cache: ArtifactCache | None,
    make_qdq: Any,
) -> tuple[Any, bool, dict]:
    """The calibrated QDQ model through hbdk4, after checking every MAC op is dequantized."""
    summary = cached_summary(cache, key)
    if summary is not None:
        c = compile_hbm(None, name, key, input_names, march, cache, lookup_only=True)
        if c is not None:
            return c.executor, True, summary
    qdq = make_qdq()
    summary = _board_ready(qdq, name, march)
    c = compile_hbm(qdq, name, key, input_names, march, cache)
    if cache is not None:
        cache.put(key, ".quant.json", json.dumps(summary).encode())
    return c.executor, False, summary


def _board_ready(qdq: onnx.ModelProto, name: str, march: str) -> dict:
    """``quantize.summarize`` of a QDQ model bound for hbdk4, after checking that every MAC op
    is dequantized (a float one would run on the board's CPU)."""
    summary = Q.summarize(qdq, march)
    if summary["float_mac"]:
        raise Q.FloatMacError(
            f"region {name}: these MAC ops have float inputs after quantization and would run "
            f"on the board's CPU: {summary['float_mac'][:5]}; this is a bug in the "
            "integer-input table (quantize.INTEGER_INPUT_OPS) for this op"
        )
    return summary


def compile_hbm(
    proto: onnx.ModelProto | None,
    name: str,
    key: str,
    input_names: list[str],
    march: str,
    cache: ArtifactCache | None,
    lookup_only: bool = False,
) -> Compiled | None:
    """Compile (or load) a quantized region's ``.hbm``; the board runtime loads it from a path.

    With the cache disabled (``cache=False``) or unwritable, the ``.hbm`` lives in a private
    temporary directory owned by the executor, removed when the executor is collected; the
    user cache is never written then. ``lookup_only``: a verified cache hit, or None.
    """
    if cache is not None and cache.get(key, ".hbm") is not None:
        path = cache.path(key, ".hbm")
        try:
            return Compiled(HbmExecutor(str(path), input_names), key, True, path.stat().st_size)
        except Exception as e:  # noqa: BLE001 - e.g. evicted meanwhile: rebuild it
            warn_unloadable(path, e)
    if lookup_only or proto is None:
        return None
    tmp = tempfile.TemporaryDirectory(prefix=f"fxpass-{name}-")
    try:
        out = os.path.join(tmp.name, f"{name}.hbm")
        _hbdk4(proto, name, march, out)
        with open(out, "rb") as f:
            data = f.read()
        path = cache.put(key, ".hbm", data) if cache is not None else None
        if path is None:
            ex = HbmExecutor(out, input_names)
            ex._fxpass_hbm_dir = tmp  # the directory lives as long as the executor
            return Compiled(ex, key, False, len(data))
    except BaseException:
        tmp.cleanup()
        raise
    tmp.cleanup()
    return Compiled(HbmExecutor(str(path), input_names), key, False, len(data))


def _hbdk4(proto: onnx.ModelProto, name: str, march: str, out: str) -> None:
    """hbdk4's documented flow: ``onnx.export`` -> ``convert(march)`` -> ``compile(opt=2)``."""
    from hbdk4 import compiler as hb

    module = hb.onnx.export(proto, name=name)
    module = hb.convert(module, march)
    hb.compile(module, out, march, opt=2)


class BoardArtifact:
    """A board region built ahead of time (``export``): its ``.hbm`` bytes for the package.

    A workstation that exports has hbdk4 but no board runtime, so until the package is
    loaded on a board the region runs here as the very QDQ model hbdk4 compiled, on
    onnxruntime (the calibration's accuracy check and the exported program's own calls);
    the board's integer kernels may round differently in the last bit."""

    kind = "hbdnn"

    def __init__(self, hbm: bytes, host: Any):
        self.hbm, self.host = hbm, host
        self.input_names = host.input_names

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.host(*tensors)


def exported_hbm(name: str, march: str, make_qdq: Any, host: Any) -> tuple[Any, bool, dict]:
    """``quantized_hbm`` for ``export``: the ``.hbm`` compiled to bytes (nothing cached, no
    board runtime needed), run meanwhile by ``host(qdq_bytes)``, a host executor of its QDQ
    model (``BoardArtifact``)."""
    qdq = make_qdq()
    summary = _board_ready(qdq, name, march)
    with tempfile.TemporaryDirectory(prefix=f"fxpass-{name}-") as tmp:
        out = os.path.join(tmp, f"{name}.hbm")
        _hbdk4(qdq, name, march, out)
        with open(out, "rb") as f:
            data = f.read()
    return BoardArtifact(data, host(qdq.SerializeToString())), False, summary
