"""Compile one region: lower to ONNX, then hbdk4 -> ``.hbm`` (board) or an onnxruntime session.

hbdk4 flow (documented Python API; x86-64 wheels from Horizon's OpenExplorer, not installable
here, tested against a contract fake): ``hbdk4.compiler.onnx.export(proto)`` ->
``hbdk4.compiler.convert(module, march)`` -> ``hbdk4.compiler.compile(module, path, march,
opt=2)``. Executor choice: ``auto`` = the board (hbdnn) when both hbdk4 and the board runtime
import, else the host (onnxruntime); ``hbdnn`` and ``onnxruntime`` force one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import onnx

from fxpass.backends.bpu.cache import ArtifactCache, region_key
from fxpass.backends.bpu.host import fuse_for_ort
from fxpass.backends.bpu.lower import lower
from fxpass.backends.bpu.region import RegionGraph
from fxpass.backends.bpu.runtime import HbmExecutor, OrtExecutor

EXECUTORS = ("auto", "hbdnn", "onnxruntime")
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


def resolve_executor(executor: str) -> str:
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    if executor == "auto":
        return "hbdnn" if has_hbdk4() and has_board() else "onnxruntime"
    if executor == "hbdnn" and not has_hbdk4():
        raise RuntimeError(HBDK4_HELP)
    return executor


@dataclass
class Compiled:
    executor: Any
    key: str
    cached: bool
    onnx_bytes: int
    fusions: dict[str, int] = field(default_factory=dict)  # host fusions that fired


def compile_region(
    rg: RegionGraph,
    name: str,
    *,
    march: str,
    executor: str,
    cache: ArtifactCache | None,
    options: dict[str, Any],
    threads: int | None = None,
) -> Compiled:
    kind = resolve_executor(executor)
    key = region_key(rg.gm, march=march, executor=kind, options=options)
    input_names = [p.name for p in rg.gm.graph.find_nodes(op="placeholder")]
    if kind == "onnxruntime":
        fuse = options.get("host_fusions", True)
        return _compile_ort(rg, name, key, input_names, cache, threads, fuse)
    return _compile_hbm(rg, name, key, input_names, march, cache)


def _compile_ort(
    rg: RegionGraph,
    name: str,
    key: str,
    input_names: list[str],
    cache: ArtifactCache | None,
    threads: int | None = None,
    fuse: bool = True,
) -> Compiled:
    if cache is not None:
        data = cache.get(key, ".ort.onnx")
        info = cache.get(key, ".fusions.json")
        if data is not None and info is not None:
            ex = OrtExecutor(data, input_names, threads=threads, preoptimized=True)
            return Compiled(ex, key, True, len(data), json.loads(info))
    proto = lower(rg.gm, name=name)
    fusions: dict[str, int] = {}
    if fuse:
        proto, fusions = fuse_for_ort(proto)
    data = proto.SerializeToString()
    if cache is None:
        ex = OrtExecutor(data, input_names, threads=threads)
        return Compiled(ex, key, False, len(data), fusions)
    # Let onnxruntime write its optimized model once; later processes load it unoptimized.
    with tempfile.TemporaryDirectory() as tmp:
        opt = os.path.join(tmp, "opt.onnx")
        ex = OrtExecutor(data, input_names, threads=threads, optimized_path=opt)
        with open(opt, "rb") as f:
            cache.put(key, ".ort.onnx", f.read())
    cache.put(key, ".fusions.json", json.dumps(fusions).encode())
    return Compiled(ex, key, False, len(data), fusions)


def _compile_hbm(
    rg: RegionGraph,
    name: str,
    key: str,
    input_names: list[str],
    march: str,
    cache: ArtifactCache | None,
) -> Compiled:
    from hbdk4 import compiler as hb

    cache = cache or ArtifactCache()
    path = cache.path(key, ".hbm")
    data = cache.get(key, ".hbm")
    cached = data is not None
    if not cached:
        proto: onnx.ModelProto = lower(rg.gm, name=name)
        module = hb.onnx.export(proto, name=name)
        module = hb.convert(module, march)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = os.path.join(tmp, f"{name}.hbm")
            hb.compile(module, out, march, opt=2)
            with open(out, "rb") as f:
                data = f.read()
        path = cache.put(key, ".hbm", data)
    return Compiled(HbmExecutor(str(path), input_names), key, cached, len(data))
