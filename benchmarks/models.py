"""Model latency: eager vs inductor vs fxpass_bpu (onnxruntime host executor) vs whole-model ONNX.

Random weights, no downloads (``fxpass.zoo``), batch 1, ``torch.no_grad()``. Per case, every
contender is compiled/exported in this process, checked against eager, then timed side by side
(``harness.interleave``). For fxpass_bpu a second process reuses the artifact cache, to
measure what a warm cache saves. A contender that fails is recorded with its error, never fatal.

    python -m benchmarks.models [--quick] [--out benchmarks/results] [--only qwen3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CONTENDERS = ("eager", "inductor", "fxpass_bpu", "onnxruntime")
#: Medium-size HF encoders/decoders next to the 4-layer, 1024-wide presets.
MEDIUM = dict(layers=4, hidden=512, heads=8, vocab=32000)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp-128": ("mlp", dict(d=128, h=256)),
    "mlp-1024": ("mlp", dict(d=1024, h=4096)),
    "qwen3-4l-1024": ("qwen3-4l-1024", {}),
    "llama-4l-1024": ("llama-4l-1024", {}),
    "gpt2-4l-512": ("gpt2", MEDIUM),
    "bert-4l-512": ("bert", MEDIUM),
}
CHILD_MARK = "FXPASS_BENCH_CHILD "


@dataclass
class Case:
    """One model at one dtype and sequence length (batch 1)."""

    model: str  # a key of MODELS
    dtype: str  # "fp32" | "bf16"
    tokens: int

    @property
    def label(self) -> str:
        return f"{self.model} {self.dtype} t={self.tokens}"

    def build(self) -> tuple[Wrapped, tuple[torch.Tensor, ...]]:
        """The model wrapped to take positional tensors, and its inputs (batch 1)."""
        from fxpass import zoo

        name, kw = MODELS[self.model]
        model, kwargs = zoo.get(name, **kw, tokens=self.tokens, dtype=DTYPES[self.dtype])
        tensors = {k: v[:1] for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        static = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        return Wrapped(model, list(tensors), static).eval(), tuple(tensors.values())


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


def quick_cases() -> list[Case]:
    return [
        Case("qwen3-4l-1024", "fp32", 1),
        Case("qwen3-4l-1024", "fp32", 128),
        Case("mlp-128", "bf16", 1),
        Case("mlp-128", "bf16", 128),
    ]


def full_cases() -> list[Case]:
    return [Case(m, d, t) for m in MODELS for d in DTYPES for t in (1, 128)]


def _err(e: BaseException) -> str:
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
        err = ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()
        res.update(rel_err=err, ok=res["dtype_ok"] and err < 1e-3)
    else:
        cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
        res.update(cosine=cos, ok=res["dtype_ok"] and cos > 0.99)
    return res


def _configure_dynamo() -> None:
    import torch._dynamo.config as cfg

    for key in ("cache_size_limit", "recompile_limit"):
        if hasattr(cfg, key):
            setattr(cfg, key, 64)


def _compiled(
    model: torch.nn.Module, inputs: tuple, backend: str, options: dict | None = None
) -> tuple[Callable[[], Any], float, Any]:
    """Time ``torch.compile`` plus the first call (which compiles); return the callable."""
    box: list[Any] = []

    def first() -> Any:
        box.append(torch.compile(model, backend=backend, dynamic=False, options=options))
        return box[0](*inputs)

    t, out = harness.timed(first)
    c = box[0]
    return (lambda: c(*inputs)), t, out


def _bpu_options(cache_dir: str) -> dict[str, Any]:
    return {"executor": "onnxruntime", "cache_dir": cache_dir}


def _bpu_report(reports: list[Any]) -> dict[str, Any]:
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


def _onnx(
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
        res.extra["exporter"] = f"legacy (dynamo failed: {_err(e)})"
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


def _attempt(res: Result, stage: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn``; on failure record the error on ``res`` and return None."""
    res.stage = res.stage or stage
    try:
        out = fn()
        res.stage = None
        return out
    except Exception as e:  # noqa: BLE001 - a failing contender is a result, not a crash
        res.error = _err(e)
        res.traceback = "".join(traceback.format_exception(e)[-12:])
        return None


def child_compile(case: Case, cache_dir: str, timeout_s: float = 900) -> dict[str, Any]:
    """Compile ``case`` with fxpass_bpu in a fresh Python process using ``cache_dir``."""
    spec = json.dumps({"case": asdict(case), "cache_dir": cache_dir})
    try:
        p = subprocess.run(
            [sys.executable, "-m", "benchmarks.models", "--child", spec],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f}s"}
    for line in p.stdout.splitlines():
        if line.startswith(CHILD_MARK):
            return json.loads(line[len(CHILD_MARK) :])
    return {"error": f"exit {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]}"}


def _child_main(spec: str) -> None:
    """In the second process: eager once (as the parent did), then time compile + first call."""
    import fxpass

    args = json.loads(spec)
    case = Case(**args["case"])
    _configure_dynamo()
    with torch.no_grad():
        model, inputs = case.build()
        model(*inputs)
        try:
            t, _ = harness.timed(
                lambda: torch.compile(
                    model,
                    backend="fxpass_bpu",
                    dynamic=False,
                    options=_bpu_options(args["cache_dir"]),
                )(*inputs)
            )
            out = {"compile_first_call_s": t, **_bpu_report(fxpass.compile_reports())}
        except Exception as e:  # noqa: BLE001
            out = {"error": _err(e)}
    print(CHILD_MARK + json.dumps(out), flush=True)


def run_case(
    case: Case, timing: dict[str, Any], cold_child: bool = True, quiet_wait_s: float = 60.0
) -> dict[str, Any]:
    """Compile/export every contender, check against eager, then time them side by side."""
    import fxpass

    torch._dynamo.reset()
    model, inputs = case.build()
    results = {name: Result(name) for name in CONTENDERS}
    callables: dict[str, Callable[[], Any]] = {}
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="fxpass-bench-") as tmp:
        t, ref = harness.timed(lambda: model(*inputs))
        results["eager"].first_call_s = t
        results["eager"].check = check(ref, ref)
        callables["eager"] = lambda: model(*inputs)

        r = results["inductor"]
        got = _attempt(r, "compile", lambda: _compiled(model, inputs, "inductor"))
        if got:
            callables["inductor"], r.first_call_s, out = got
            r.check = check(ref, out)

        r = results["fxpass_bpu"]
        cache_dir = os.path.join(tmp, "bpu-cache")
        n0 = len(fxpass.compile_reports())
        got = _attempt(
            r, "compile", lambda: _compiled(model, inputs, "fxpass_bpu", _bpu_options(cache_dir))
        )
        r.extra.update(_bpu_report(fxpass.compile_reports()[n0:]))
        if got:
            callables["fxpass_bpu"], r.first_call_s, out = got
            r.check = check(ref, out)
            if r.extra["graphs"] == 0:
                r.error = "fxpass_bpu compiled no graph (Dynamo reused another entry?)"
            if cold_child:
                r.extra["cold_child"] = child_compile(case, os.path.join(tmp, "cold-cache"))
            r.extra["warm_child"] = child_compile(case, cache_dir)

        r = results["onnxruntime"]
        got = _attempt(r, "export", lambda: _onnx(model, inputs, tmp, r))
        if got:
            callables["onnxruntime"], r.first_call_s, out = got
            r.check = check(ref, out)

        busy = harness.wait_for_quiet(max_wait_s=quiet_wait_s)
        stats = harness.interleave(callables, **timing)
    eager = stats["eager"].median
    for name, s in stats.items():
        results[name].stats = s.to_dict()
        results[name].ratio_vs_eager = s.median / eager
    return {
        "case": asdict(case),
        "label": case.label,
        "background_busy_before_timing": busy,
        "results": [asdict(r) for r in results.values()],
    }


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.0%}"


def _check_cell(res: dict[str, Any]) -> str:
    c = res["check"]
    if not c:
        return ""
    if not c.get("shape_ok", True):
        return "shape mismatch"
    txt = f"err {c['rel_err']:.1e}" if "rel_err" in c else f"cos {c.get('cosine', 0):.5f}"
    if not c.get("dtype_ok", True):
        txt += f" (dtype {c['dtype']}!)"
    return txt + ("" if c.get("ok") else " FAIL")


def latency_rows(cases: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One markdown row per (case, contender)."""
    rows = []
    for c in cases:
        for r in c["results"]:
            s = r["stats"]
            note = r["error"] and f"failed at {r['stage']}: {r['error']}"
            if r["contender"] == "onnxruntime" and r["extra"].get("exporter"):
                note = "; ".join(x for x in (f"exporter: {r['extra']['exporter']}", note) if x)
            rows.append(
                {
                    "case": c["label"],
                    "contender": r["contender"],
                    "median ms": harness.fmt_ms(s["median"]) if s else "failed",
                    "min-max ms": f"{harness.fmt_ms(s['min'])}-{harness.fmt_ms(s['max'])}"
                    if s
                    else "",
                    "n": f"{s['n']}x{s['number']}" if s else "",
                    "vs eager": f"{r['ratio_vs_eager']:.2f}x" if s else "",
                    "first call s": f"{r['first_call_s']:.2f}" if r["first_call_s"] else "",
                    "check vs eager": _check_cell(r),
                    "note": note or "",
                    "bg busy": _pct(c.get("background_busy_before_timing")),
                }
            )
    return rows


LATENCY_COLUMNS = [
    "case",
    "contender",
    "median ms",
    "min-max ms",
    "n",
    "vs eager",
    "first call s",
    "check vs eager",
    "bg busy",
    "note",
]
COMPILE_COLUMNS = [
    "case",
    "regions",
    "call nodes offloaded",
    "MACs offloaded",
    "bpu first call s",
    "inductor first call s",
    "bpu/inductor",
    "cold new proc s",
    "warm new proc s",
    "cold/warm",
    "cached in warm proc",
    "why on CPU",
]


def _by_name(case: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["contender"]: r for r in case["results"]}


def _why_cpu(x: dict[str, Any]) -> str:
    """The most common reasons nodes stayed on the CPU, and dropped regions."""
    top = sorted(x.get("cpu_reasons", {}).items(), key=lambda kv: -kv[1])[:2]
    parts = [f"{k}x {why}" for why, k in top] + [f"dropped {d}" for d in x.get("dropped", [])]
    return "; ".join(parts)[:300]


def compile_rows(cases: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One markdown row per case: fxpass_bpu partition shares and compile times."""
    rows = []
    for c in cases:
        res = _by_name(c)
        b, ind = res["fxpass_bpu"], res["inductor"]
        x = b["extra"]
        warm, cold = x.get("warm_child", {}), x.get("cold_child", {})
        bf, inf_ = b["first_call_s"], ind["first_call_s"]
        wt, ct = warm.get("compile_first_call_s"), cold.get("compile_first_call_s")
        fb = x.get("fallback_regions") or []
        rows.append(
            {
                "case": c["label"],
                "regions": f"{x.get('regions', 0)}" + (f" ({len(fb)} fell back)" if fb else ""),
                "call nodes offloaded": f"{x.get('offloaded_call_nodes', 0)}/"
                f"{x.get('call_nodes', 0)} ({x.get('node_share', 0):.0%})",
                "MACs offloaded": f"{x.get('mac_share', 0):.1%}",
                "bpu first call s": f"{bf:.2f}" if bf else b["error"] or "",
                "inductor first call s": f"{inf_:.2f}" if inf_ else ind["error"] or "",
                "bpu/inductor": f"{bf / inf_:.2f}x" if bf and inf_ else "",
                "warm new proc s": f"{wt:.2f}" if wt else warm.get("error", ""),
                "cold/warm": f"{ct / wt:.1f}x" if ct and wt else "",
                "cold new proc s": f"{ct:.2f}" if ct else cold.get("error", ""),
                "cached in warm proc": f"{warm.get('cached_regions')}/{warm.get('regions')}"
                if wt
                else "",
                "why on CPU": _why_cpu(x),
            }
        )
    return rows


def to_markdown(data: dict[str, Any]) -> str:
    cases = data["cases"]
    return "\n\n".join(
        [
            "### Latency (batch 1, median of interleaved samples)",
            harness.markdown_table(latency_rows(cases), LATENCY_COLUMNS),
            "### fxpass_bpu partition and compile time",
            harness.markdown_table(compile_rows(cases), COMPILE_COLUMNS),
        ]
    )


def chart_data(data: dict[str, Any]) -> tuple[list[str], dict[str, list[float | None]]]:
    """Case labels and, per non-eager contender, latency ratios vs eager (None if failed)."""
    labels = [c["label"] for c in data["cases"]]
    ratios = {
        name: [_by_name(c)[name]["ratio_vs_eager"] for c in data["cases"]]
        for name in CONTENDERS
        if name != "eager"
    }
    return labels, ratios


def warm_up_process() -> None:
    """Pay one-time costs (inductor's C++ toolchain probe, onnx/onnxruntime imports, Dynamo
    itself) on a throwaway function, so the first case's compile times are not inflated."""
    lin = torch.nn.Linear(64, 64).eval()
    x = torch.randn(4, 64)
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="fxpass-bench-") as tmp:
        torch.compile(lin, backend="inductor", dynamic=False)(x)
        opts = {**_bpu_options(tmp), "min_compute_macs": 0}
        torch.compile(lin, backend="fxpass_bpu", dynamic=False, options=opts)(x)
    torch._dynamo.reset()


def run(quick: bool = False, only: str | None = None, cold_child: bool = True) -> dict[str, Any]:
    """Run the model benchmarks; returns the JSON-able record."""
    inductor_cache = tempfile.mkdtemp(prefix="fxpass-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache  # no warm cache from earlier runs
    _configure_dynamo()
    cases = quick_cases() if quick else full_cases()
    if only:
        cases = [c for c in cases if re.search(only, c.label)]
    timing = (
        dict(warmup=2, repeats=10, budget_s=3.0, min_repeats=3)
        if quick
        else dict(warmup=3, repeats=30, budget_s=10.0, min_repeats=5)
    )
    out: dict[str, Any] = {
        "env": {**harness.environment(), "inductor_cache_dir": "fresh temp dir per run"},
        "mode": "quick" if quick else "full",
        "timing": timing,
        "cases": [],
    }
    warm_up_process()
    for case in cases:
        t0 = time.perf_counter()
        print(f"[models] {case.label} ...", file=sys.stderr, flush=True)
        out["cases"].append(run_case(case, timing, cold_child, 20.0 if quick else 120.0))
        print(f"[models] {case.label} done in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a subset that runs in a few minutes")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--only", help="regex on case labels, e.g. 'qwen3.*fp32'")
    ap.add_argument(
        "--cold-child",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also compile in a fresh process with an empty cache (the cold/warm baseline)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child_main(args.child)
        return
    data = run(args.quick, args.only, args.cold_child)
    out = Path(args.out)
    harness.write_json(out / "models.json", data)
    md = to_markdown(data)
    (out / "models.md").write_text(md + "\n")
    harness.ratio_chart(*chart_data(data), out / "models.png")
    print(md)


if __name__ == "__main__":
    main()
