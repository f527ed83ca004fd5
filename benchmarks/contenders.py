"""The contenders of the model benchmark, and how each one's output is checked against eager.

Every contender runs the same ``Wrapped`` module on the same inputs: eager, ``torch.compile``
with inductor, fxpass_bpu, fxpass_ort or torch's own ``onnxrt`` (compile time =
``torch.compile`` plus the first call), and the whole model exported to ONNX and run by an
``onnxruntime.InferenceSession``.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks import harness


class Wrapped(torch.nn.Module):
    """Positional tensors in, one tensor out (logits / last_hidden_state): the same callable
    for every contender, and what ``torch.onnx.export`` needs for a HF model."""

    def __init__(self, model: torch.nn.Module, names: list[str], static: dict[str, Any]):
        super().__init__()
        self.model, self.names, self.static = model, names, static

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        out = self.model(**dict(zip(self.names, tensors, strict=True)), **self.static)
        if isinstance(out, torch.Tensor):
            return out
        for key in ("logits", "last_hidden_state"):
            if getattr(out, key, None) is not None:
                return getattr(out, key)
        raise TypeError(f"no logits/last_hidden_state in {type(out).__name__}")


@dataclass
class Result:
    """One contender on one case. ``error`` set means it failed at that ``stage``."""

    contender: str
    first_call_s: float | None = None
    stats: dict[str, float | int] | None = None
    ratio_vs_eager: float | None = None
    check: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    stage: str | None = None
    traceback: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def err(e: BaseException) -> str:
    """The error as one table-friendly line: type and first line of the message."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}"


def check(ref: torch.Tensor, out: Any) -> dict[str, Any]:
    """fp32: max abs error over the output's max abs value; bf16: cosine; plus dtype kept."""
    if not isinstance(out, torch.Tensor):
        return {"ok": False, "why": f"output is {type(out).__name__}"}
    res: dict[str, Any] = {"dtype": str(out.dtype).removeprefix("torch."), "shape_ok": True}
    res["dtype_ok"] = out.dtype == ref.dtype
    if out.shape != ref.shape:
        return {**res, "shape_ok": False, "ok": False}
    a, b = ref.detach().float().flatten(), out.detach().float().flatten()
    if ref.dtype == torch.float32:
        rel = ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()
        res.update(rel_err=rel, ok=res["dtype_ok"] and rel < 1e-3)
    else:
        cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
        res.update(cosine=cos, ok=res["dtype_ok"] and cos > 0.99)
    return res


def configure_dynamo() -> None:
    """Room for every case's recompiles: past the limit Dynamo silently runs eager."""
    import torch._dynamo.config as cfg

    for key in ("cache_size_limit", "recompile_limit"):
        if hasattr(cfg, key):
            setattr(cfg, key, 64)


#: why torch's own ``onnxrt`` backend is missing, when Dynamo says it is not registered
ONNXRT_GONE = (
    "torch {version} registers no 'onnxrt' Dynamo backend ({error}): torch removed it with "
    "DORT, its ONNX Runtime backend, in July 2025 (pytorch/pytorch#158258); "
    "torch/_dynamo/backends/onnxrt.py is a placeholder since"
)


def torch_compile(fn: Any, backend: str, **kw: Any) -> Any:
    """``torch.compile(fn, backend=backend, **kw)``; a missing ``onnxrt`` says why it is gone
    (Dynamo's own error only points at ``list_backends()``)."""
    from torch._dynamo.exc import InvalidBackend

    try:
        return torch.compile(fn, backend=backend, **kw)
    except InvalidBackend as e:
        if backend != "onnxrt":
            raise
        why = ONNXRT_GONE.format(version=torch.__version__, error=type(e).__name__)
        raise RuntimeError(why) from e


def compiled(
    model: torch.nn.Module, inputs: tuple, backend: str, options: dict | None = None
) -> tuple[Callable[[], Any], float, Any]:
    """Time ``torch.compile`` plus the first call (which compiles); return the callable."""
    box: list[Any] = []

    def first() -> Any:
        box.append(torch_compile(model, backend, dynamic=False, options=options))
        return box[0](*inputs)

    t, out = harness.timed(first)
    c = box[0]
    return (lambda: c(*inputs)), t, out


def bpu_options(cache_dir: str) -> dict[str, Any]:
    """The host executor, and a cache directory this run owns (cold on first use)."""
    return {"executor": "onnxruntime", "cache_dir": cache_dir}


def ort_options(cache_dir: str) -> dict[str, Any]:
    """fxpass_ort's defaults, and a cache directory this run owns (cold on first use)."""
    return {"cache_dir": cache_dir}


def bpu_report(reports: list[Any]) -> dict[str, Any]:
    """Regions and offloaded shares summed over the graphs one compile produced."""
    calls = sum(r.call_nodes for r in reports)
    macs = sum(r.macs for r in reports)
    regions = [g for r in reports for g in r.regions]
    return {
        "graphs": len(reports),
        "regions": len(regions),
        "fallback_regions": [f"{g.name}: {g.fallback}" for g in regions if g.fallback],
        "cached_regions": sum(1 for g in regions if g.cached),
        "call_nodes": calls,
        "offloaded_call_nodes": sum(r.offloaded_call_nodes for r in reports),
        "node_share": sum(r.offloaded_call_nodes for r in reports) / calls if calls else 0.0,
        "macs": macs,
        "mac_share": sum(r.offloaded_macs for r in reports) / macs if macs else 0.0,
        "backend_compile_s": sum(r.compile_seconds for r in reports),
        "cpu_reasons": {k: v for r in reports for k, v in r.cpu_reasons.items()},
        "dropped": [d for r in reports for d in r.dropped],
    }


def _onnx_value(t: torch.Tensor) -> Any:
    import numpy as np
    import onnx
    import onnxruntime as ort

    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        raw = t.view(torch.int16).numpy().view(np.uint16)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw, onnx.TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(t.numpy())


def _onnx_tensor(v: Any) -> torch.Tensor:
    import numpy as np

    if v.data_type() == "tensor(bfloat16)":
        return torch.from_numpy(np.asarray(v.numpy()).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.asarray(v.numpy()))


def onnx_session(
    model: torch.nn.Module, inputs: tuple, workdir: str, res: Result
) -> tuple[Callable[[], Any], float, torch.Tensor]:
    """Export the whole model (dynamo exporter, else legacy) and run it with onnxruntime."""
    import onnxruntime as ort

    path = os.path.join(workdir, "model.onnx")
    t0 = time.perf_counter()
    res.stage = "export"
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            torch.onnx.export(model, inputs, path, dynamo=True, external_data=True)
        res.extra["exporter"] = "dynamo"
    except Exception as e:  # noqa: BLE001 - fall back to the legacy exporter, and say so
        res.extra["exporter"] = f"legacy (dynamo failed: {err(e)})"
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            torch.onnx.export(model, inputs, path, dynamo=False)
    res.extra["export_s"] = time.perf_counter() - t0
    res.stage = "session"
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    if len(names) != len(inputs):
        raise RuntimeError(f"ONNX model takes {names}, expected {len(inputs)} inputs")
    feeds = {n: _onnx_value(t) for n, t in zip(names, inputs, strict=True)}
    res.stage = "run"
    run = lambda: sess.run_with_ort_values(None, feeds)  # noqa: E731
    out = _onnx_tensor(run()[0])
    return run, time.perf_counter() - t0, out


def attempt(res: Result, stage: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn``; on failure record the error on ``res`` and return None."""
    res.stage = res.stage or stage
    try:
        out = fn()
        res.stage = None
        return out
    except Exception as e:  # noqa: BLE001 - a failing contender is a result, not a crash
        res.error = err(e)
        res.traceback = "".join(traceback.format_exception(e)[-12:])
        return None
