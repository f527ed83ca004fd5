"""Model latency: eager, inductor, fxpass_bpu, fxpass_ort, torch's onnxrt, whole-model ONNX.

Random weights, no downloads (``fxpass.tools.zoo``), batch 1, ``torch.no_grad()``. fxpass_bpu
runs on its onnxruntime host executor; fxpass_ort is the ``ort`` device (onnxruntime on the
host as a product of its own); ``onnxrt`` is torch's own Dynamo backend of that name, beside
them. Per case, every contender is compiled/exported in this process, checked against eager,
then timed side by side (``harness.interleave``). For fxpass_bpu a second process reuses the
artifact cache, to measure what a warm cache saves. A contender that fails is recorded with its
error, never fatal.

    python -m benchmarks.models [--quick] [--out benchmarks/results] [--only qwen3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.contenders import (
    Result,
    Wrapped,
    attempt,
    bpu_options,
    bpu_report,
    check,
    compiled,
    configure_dynamo,
    err,
    onnx_session,
    ort_options,
)

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CONTENDERS = ("eager", "inductor", "fxpass_bpu", "fxpass_ort", "openvino", "onnxrt",
              "onnxruntime")
#: calls timed one by one right after the compiling call, before anything settles: what a user
#: sees first (background builds still running, caches cold)
FIRST_CALLS = 20
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
        from fxpass.tools import zoo

        name, kw = MODELS[self.model]
        model, kwargs = zoo.get(name, **kw, tokens=self.tokens, dtype=DTYPES[self.dtype])
        tensors = {k: v[:1] for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        static = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        return Wrapped(model, list(tensors), static).eval(), tuple(tensors.values())


def quick_cases() -> list[Case]:
    return [
        Case("qwen3-4l-1024", "fp32", 1),
        Case("qwen3-4l-1024", "fp32", 128),
        Case("mlp-128", "bf16", 1),
        Case("mlp-128", "bf16", 128),
    ]


def full_cases() -> list[Case]:
    return [Case(m, d, t) for m in MODELS for d in DTYPES for t in (1, 128)]


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
    configure_dynamo()
    with torch.no_grad():
        model, inputs = case.build()
        model(*inputs)
        try:
            t, _ = harness.timed(
                lambda: torch.compile(
                    model,
                    backend="fxpass_bpu",
                    dynamic=False,
                    options=bpu_options(args["cache_dir"]),
                )(*inputs)
            )
            out = {"compile_first_call_s": t, **bpu_report(fxpass.compile_reports())}
        except Exception as e:  # noqa: BLE001
            out = {"error": err(e)}
    print(CHILD_MARK + json.dumps(out), flush=True)


def time_quietly(
    callables: dict[str, Callable[[], Any]],
    timing: dict[str, Any],
    quiet_wait_s: float,
    attempts: int = 3,
    threshold: float = 0.15,
) -> tuple[dict[str, harness.Stats], float | None, int]:
    """Interleaved timing, retried (after waiting for quiet) while other processes used more
    than ``threshold`` of the CPUs; keeps the attempt with the least outside load."""
    tried: list[tuple[float, dict[str, harness.Stats], float | None]] = []
    while len(tried) < attempts:
        harness.wait_for_quiet(threshold, max_wait_s=quiet_wait_s)
        with harness.OtherLoad() as load:
            stats = harness.interleave(callables, **timing)
        tried.append((load.share or 0.0, stats, load.share))
        if load.share is None or load.share < threshold:
            break
    _, stats, share = min(tried, key=lambda t: t[0])
    return stats, share, len(tried)


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
        got = attempt(r, "compile", lambda: compiled(model, inputs, "inductor"))
        if got:
            callables["inductor"], r.first_call_s, out = got
            r.check = check(ref, out)

        cache_dir = os.path.join(tmp, "bpu-cache")
        for name, options in (("fxpass_bpu", bpu_options(cache_dir)),
                              ("fxpass_ort", ort_options(f"{tmp}/ort-cache"))):
            r = results[name]
            n0 = len(fxpass.compile_reports())
            got = attempt(r, "compile",
                          lambda name=name, options=options: compiled(model, inputs, name, options))
            r.extra.update(bpu_report(fxpass.compile_reports()[n0:]))
            if not got:
                continue
            callables[name], r.first_call_s, out = got
            r.extra["first_calls_ms"] = _first_calls(callables[name])
            r.check = check(ref, out)
            if r.extra["graphs"] == 0:
                r.error = f"{name} compiled no graph (Dynamo reused another entry?)"
            if name == "fxpass_bpu":  # the cache's cold and warm starts, measured once
                if cold_child:
                    r.extra["cold_child"] = child_compile(case, os.path.join(tmp, "cold-cache"))
                r.extra["warm_child"] = child_compile(case, cache_dir)

        r = results["openvino"]  # OpenVINO's torch.compile backend
        got = attempt(r, "compile", lambda: compiled(model, inputs, "openvino",
                                                     openvino_options()))
        if got:
            callables["openvino"], r.first_call_s, out = got
            r.extra["first_calls_ms"] = _first_calls(callables["openvino"])
            r.check = check(ref, out)

        r = results["onnxrt"]  # torch's own Dynamo backend
        got = attempt(r, "compile", lambda: compiled(model, inputs, "onnxrt"))
        if got:
            callables["onnxrt"], r.first_call_s, out = got
            r.check = check(ref, out)

        r = results["onnxruntime"]
        got = attempt(r, "export", lambda: onnx_session(model, inputs, tmp, r))
        if got:
            callables["onnxruntime"], r.first_call_s, out = got
            r.check = check(ref, out)

        from fxpass.backends.bpu import settle

        settle()  # fxpass's prepacked second tiers are built: time the steady state
        stats, busy, tries = time_quietly(callables, timing, quiet_wait_s)
    eager = stats["eager"].median
    for name, s in stats.items():
        results[name].stats = s.to_dict()
        results[name].ratio_vs_eager = s.median / eager
    return {
        "case": asdict(case),
        "label": case.label,
        "background_busy_during_timing": busy,
        "timing_attempts": tries,
        "results": [asdict(r) for r in results.values()],
    }


def _first_calls(fn: Callable[[], Any]) -> list[float]:
    """The ``FIRST_CALLS`` calls right after compile, each timed alone (ms)."""
    return [harness.timed(fn)[0] * 1e3 for _ in range(FIRST_CALLS)]


def openvino_options() -> dict[str, Any]:
    """OpenVINO's ``torch.compile`` backend as it runs with torch 2.13: through AOTAutograd
    (its default path fails on this torch), and in f32 (CPUs with bf16 units default to it)."""
    import openvino.torch  # noqa: F401 - registers the "openvino" backend

    return {"device": "CPU", "aot_autograd": True,
            "config": {"INFERENCE_PRECISION_HINT": "f32"}}


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


def _first_cell(res: dict[str, Any]) -> str:
    """Median (and max) of the calls right after compile."""
    t = res["extra"].get("first_calls_ms")
    if not t:
        return ""
    return f"{statistics.median(t):.3g} (max {max(t):.3g})"


def latency_rows(cases: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One markdown row per (case, contender)."""
    rows = []
    for c in cases:
        for r in c["results"]:
            s = r["stats"]
            note = r["error"] and f"failed at {r['stage']}: {r['error']}"
            if r["contender"] == "onnxruntime" and r["extra"].get("exporter"):
                note = "; ".join(x for x in (f"exporter: {r['extra']['exporter']}", note) if x)
            if r["contender"] == "fxpass_ort" and r["extra"].get("graphs"):
                x = r["extra"]
                where = f"{x['regions']} region(s), {x['mac_share']:.1%} of MACs"
                note = "; ".join(y for y in (where, note) if y)
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
                    "next 20 calls ms": _first_cell(r),
                    "check vs eager": _check_cell(r),
                    "note": note or "",
                    "bg busy": _pct(c.get("background_busy_during_timing")),
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
    "next 20 calls ms",
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
                "warm new proc s": f"{wt:.2f} (backend {warm['backend_compile_s']:.2f})"
                if wt
                else warm.get("error", ""),
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
        opts = {**bpu_options(tmp), "min_compute_macs": 0}
        torch.compile(lin, backend="fxpass_bpu", dynamic=False, options=opts)(x)
        opts = {**ort_options(tmp), "min_compute_macs": 0}
        torch.compile(lin, backend="fxpass_ort", dynamic=False, options=opts)(x)
    torch._dynamo.reset()


def run(
    quick: bool = False,
    only: str | None = None,
    cold_child: bool = True,
    quiet_wait_s: float | None = None,
    partial: Path | None = None,
) -> dict[str, Any]:
    """Run the model benchmarks; returns the JSON-able record (also written to ``partial``
    after every case, so an interrupted full run keeps what it measured)."""
    inductor_cache = tempfile.mkdtemp(prefix="fxpass-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache  # no warm cache from earlier runs
    configure_dynamo()
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
        wait = quiet_wait_s if quiet_wait_s is not None else (10.0 if quick else 60.0)
        out["cases"].append(run_case(case, timing, cold_child, wait))
        if partial:
            harness.write_json(partial, out)
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
    ap.add_argument("--quiet-wait", type=float, help="max seconds to wait for a quiet machine")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child_main(args.child)
        return
    out = Path(args.out)
    data = run(args.quick, args.only, args.cold_child, args.quiet_wait, out / "models.json")
    harness.write_json(out / "models.json", data)
    md = to_markdown(data)
    (out / "models.md").write_text(md + "\n")
    harness.ratio_chart(*chart_data(data), out / "models.png")
    print(md)


if __name__ == "__main__":
    main()
