"""Calibration that fits ``torch.compile``: ``calibrate(compiled_model, batches)``.

The one documented way (docs/quantization.md)::

    fn = torch.compile(model, backend="fxpass_ort", options={"quantize": "w8a16"})
    fxpass.backends.bpu.calibrate(fn, batches)   # a few representative batches
    fn(**batch)                                   # quantized regions from here on

Why this shape: Dynamo compiles lazily and per input signature, so the regions only exist
once the model has run. Every region compiled with ``quantize`` gets a
:class:`QuantizingExecutor`, which runs the float region until calibrated. ``calibrate``
runs the batches with recording switched on (a context variable, so nothing global leaks):
each region records the inputs it actually sees -- the real activations at its boundary,
which is what onnxruntime's calibrator needs -- then every region that recorded is
calibrated, quantized, compiled (host session or ``.hbm``) and switched over, and its
accuracy against the float region on the same data lands in the compile report.
Calling ``calibrate`` again recalibrates (recording always runs the float regions).
"""

from __future__ import annotations

import contextvars
import json
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch

from fxpass.aot.batches import call, tensors
from fxpass.aot.batches import shape_of as _shape_of
from fxpass.backends.onnx import quantize as Q
from fxpass.jit.cache import ArtifactCache

_SESSION: contextvars.ContextVar[_Session | None] = contextvars.ContextVar(
    "fxpass_bpu_calibration", default=None
)


@dataclass
class QuantInfo:
    """One region's quantization, as the compile report and ``explain --quantize`` show it."""

    region: str
    config: str
    march: str
    target: str  # "onnxruntime" (host) or a device compiler's kind (the board's)
    state: str = "awaiting calibration (runs float)"
    batches: int = 0
    cosine: float | None = None  # vs the float region, on the calibration data
    max_abs_error: float | None = None
    ranges_digest: str | None = None
    key: str | None = None
    cached: bool = False
    seconds: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)  # quantize.summarize()

    def line(self) -> str:
        if self.cosine is None:
            return f"quantize {self.config}: {self.state}"
        q = _counts(self.summary, "quantized")
        return (
            f"quantize {self.config} ({self.state}{', cached' if self.cached else ''}): "
            f"cosine {self.cosine:.6f}, max abs error {self.max_abs_error:.3g} vs float on "
            f"{self.batches} calibration batch(es); Q/DQ on {q or 'nothing'}"
            + (
                f"; host integer kernels: {k}"
                if (k := _counts(self.summary, "host_integer_kernels"))
                else ""
            )
        )


def _counts(summary: dict[str, Any], key: str) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(summary.get(key, {}).items()))


class _Session:
    def __init__(self) -> None:
        self.samples: dict[QuantizingExecutor, list[list[np.ndarray]]] = {}


class QuantizingExecutor:
    """A region that runs float until calibrated, then its quantized artifact.

    ``build(ranges_digest, make_qdq) -> (executor, cached)`` is the compile step's hook
    (compile.py): it looks the quantized artifact up in the cache under a key covering the
    config and the ranges digest, else calls ``make_qdq()`` and compiles the result.
    """

    def __init__(
        self,
        info: QuantInfo,
        proto: onnx.ModelProto,
        float_executor: Any,
        cfg: Q.QuantConfig,
        build: Callable[[str, Callable[[], onnx.ModelProto]], tuple[Any, bool, dict]],
    ):
        self.info, self.proto, self.float, self.cfg = info, proto, float_executor, cfg
        self.build = build
        self.active = float_executor
        self.kind = info.target
        self.input_names = float_executor.input_names
        self._warned = False

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s = _SESSION.get()
        if s is not None:
            s.samples.setdefault(self, []).append([t.detach().numpy().copy() for t in tensors])
            return self.float(*tensors)
        if self.active is self.float and self.info.target != "onnxruntime" and not self._warned:
            self._warned = True
            warnings.warn(
                f"fxpass_bpu region {self.info.region} is bound for the board but not calibrated"
                " yet, so it runs in float on the host; call fxpass.backends.bpu.calibrate("
                "compiled_model, batches) to quantize and compile it for the BPU",
                stacklevel=3,
            )
        return self.active(*tensors)

    def finish(self, samples: list[list[np.ndarray]]) -> QuantInfo:
        t0 = time.perf_counter()
        names = [i.name for i in self.proto.graph.input]
        feeds = [dict(zip(names, s, strict=True)) for s in samples]
        march = self.info.march
        ranges = Q.calibrate_ranges(self.proto, feeds, self.cfg, march)
        digest = Q.ranges_digest(ranges, self.cfg)
        ex, cached, summary = self.build(
            digest, lambda: Q.quantize_model(self.proto, ranges, self.cfg, march)
        )
        ref = [[o.numpy() for o in self.float(*map(torch.from_numpy, s))] for s in samples]
        got = [[o.numpy() for o in ex(*map(torch.from_numpy, s))] for s in samples]
        acc = Q.accuracy(
            [np.stack(x) for x in zip(*ref, strict=True)],
            [np.stack(x) for x in zip(*got, strict=True)],
        )
        self.active = ex
        self.info.state = "calibrated"
        self.info.batches = len(samples)
        self.info.cosine, self.info.max_abs_error = acc["cosine"], acc["max_abs_error"]
        self.info.ranges_digest, self.info.cached, self.info.summary = digest, cached, summary
        self.info.seconds = time.perf_counter() - t0
        return self.info


def check_batches(batches: Sequence[Any]) -> None:
    """Clear errors for what would otherwise calibrate the wrong thing silently."""
    if len(batches) == 0:
        raise Q.QuantizationError(
            "calibrate() got no batches; pass a few representative inputs, e.g. "
            "calibrate(fn, [{'input_ids': ids}, ...]) (dicts are keyword arguments, tuples "
            "positional, a tensor a single argument)"
        )
    first = _shape_of(batches[0])
    for k, b in enumerate(batches):
        if _shape_of(b) != first:
            raise Q.QuantizationError(
                f"calibration batch {k} has shapes/dtypes {_shape_of(b)}, batch 0 has {first}. "
                "The BPU compiles static shapes, so each shape is its own compiled graph: "
                "calibrate with batches shaped (and typed) like the calls you will serve, and "
                "calibrate each serving shape separately"
            )
        for where, t in tensors(b, f"batch {k}"):
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise Q.QuantizationError(
                    f"calibration {where} holds NaN or Inf, which would poison the ranges; "
                    "drop or clean that batch"
                )


_call = call


def calibrate(model: Callable, batches: Iterable[Any], *, strict: bool = False) -> list[QuantInfo]:
    """Calibrate and quantize every region of ``model`` (a ``torch.compile``d callable with
    ``options={"quantize": ...}``) on ``batches``; returns each region's :class:`QuantInfo`.

    A batch is a dict (keyword arguments), a tuple/list (positional) or a tensor. All batches
    must share shapes and dtypes (static shapes: one compiled graph per shape), be finite, and
    there must be at least one. Bad data raises :class:`~fxpass.backends.onnx.quantize.
    QuantizationError`. A region whose quantized artifact fails to build (hbdk4 refuses it,
    say) keeps running its float model with a warning, or raises with ``strict=True``.
    """
    batches = list(batches)
    check_batches(batches)
    with recording() as session, torch.no_grad():
        for b in batches:
            _call(model, b)
    if not session.samples:
        raise Q.QuantizationError(
            "calibrate() ran the batches but no quantizing region ran: compile with "
            "torch.compile(model, backend='fxpass_bpu', options={'quantize': 'w8a16'}) (or "
            "'w8a8'), and check with print(fxpass.compile_reports()[-1]) that regions exist "
            "(regions below min_compute_macs stay in PyTorch and need no calibration)"
        )
    return finish(session, strict=strict)


@contextmanager
def recording() -> Iterator[_Session]:
    """Inside, every quantizing region that runs records its inputs into the session."""
    session = _Session()
    token = _SESSION.set(session)
    try:
        yield session
    finally:
        _SESSION.reset(token)


def finish(session: _Session, *, strict: bool = False) -> list[QuantInfo]:
    """Calibrate, quantize and switch over every region that recorded in ``session``."""
    infos = []
    for ex, s in session.samples.items():
        try:
            infos.append(ex.finish(s))
        except Q.QuantizationError:
            raise
        except Exception as e:
            if strict:
                raise RuntimeError(
                    f"fxpass_bpu region {ex.info.region} failed to quantize: {e}"
                ) from e
            ex.info.state = f"failed, runs float: {type(e).__name__}: {e}"
            warnings.warn(
                f"fxpass_bpu region {ex.info.region} could not be quantized and keeps running "
                f"its float model on the host: {type(e).__name__}: {e}",
                stacklevel=2,
            )
            infos.append(ex.info)
    return infos


def cached_summary(cache: ArtifactCache | None, key: str) -> dict | None:
    """A quantized region's stored summary (``.quant.json``), or None."""
    raw = cache.get(key, ".quant.json") if cache is not None else None
    try:
        s = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return s if isinstance(s, dict) else None
