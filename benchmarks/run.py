"""Run every benchmark and write ``benchmarks/results/latest.{json,md}`` and ``ratios.png``.

The markdown starts with the project's performance bars, each next to the number
measured in this run and a met/missed verdict computed from it (never typed in by hand).

    python -m benchmarks.run [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks import harness, models, scaling

ROOT = Path(__file__).resolve().parents[1]
US_PER_NODE_BAR = 5.0
WARM_BAR = 5.0
DECODERS = ("qwen3-4l-1024", "llama-4l-1024", "gpt2-4l-512")


def _verdict(ok: bool | None, miss: str = "") -> str:
    if ok is None:
        return "not measured"
    return "met" if ok else f"missed{' ' + miss if miss else ''}"


def scaling_bars(data: dict[str, Any]) -> list[dict[str, str]]:
    """Pass manager and partitioner at the largest size: <= 5 us/node and linear growth."""
    rows = []
    for name, graph, label in (
        ("pass_manager", "raw", "pass manager, all built-in rules to fixpoint"),
        ("partition", "rewritten", "partitioner (graph after rules, as the backend runs it)"),
        ("partition", "raw", "partitioner (raw graph, many small regions)"),
    ):
        ok = [
            r
            for r in data["rows"]
            if (r["measurement"], r["graph"]) == (name, graph) and r["status"] == "ok"
        ]
        if not ok:
            rows.append({"bar": label, "measured": "not measured", "verdict": "not measured"})
            continue
        big, small = ok[-1], ok[0]
        us = big["us_per_node"]
        growth = us / small["us_per_node"]
        rows.append(
            {
                "bar": f"{label}: <= {US_PER_NODE_BAR:g} us/node at {big['nodes']} nodes",
                "measured": f"{us:.1f} us/node",
                "verdict": _verdict(us <= US_PER_NODE_BAR, f"by {us / US_PER_NODE_BAR:.1f}x"),
            }
        )
        rows.append(
            {
                "bar": f"{label}: linear ({small['nodes']} -> {big['nodes']} nodes)",
                "measured": f"us/node grows {growth:.2f}x",
                "verdict": _verdict(growth <= 1.5, f"(grows {growth:.2f}x)"),
            }
        )
    return rows


def _res(case: dict[str, Any], name: str) -> dict[str, Any]:
    return {r["contender"]: r for r in case["results"]}[name]


def _median(r: dict[str, Any]) -> float | None:
    return r["stats"]["median"] if r["stats"] else None


def _vs(a: float | None, b: float | None, strict: bool = False) -> str:
    """Verdict for "a no more than b" (``strict``: less than), with the ratio when missed."""
    if not a or not b:
        return "not measured"
    return _verdict(a < b if strict else a <= b, f"by {a / b:.2f}x")


def _or_errors(**res: dict[str, Any]) -> str:
    return "; ".join(f"{k}: {r['error'] or 'not timed'}" for k, r in res.items())


def model_bars(data: dict[str, Any]) -> list[dict[str, str]]:
    """Decoder latency vs whole-model ONNX and inductor; then compile-time bars."""
    rows = []
    for case in data["cases"]:
        c = case["case"]
        if c["model"] not in DECODERS or c["dtype"] != "fp32":
            continue
        bpu, ort, ind = (_res(case, n) for n in ("fxpass_bpu", "onnxruntime", "inductor"))
        b, o, i = _median(bpu), _median(ort), _median(ind)
        vs_eager = f"; {1 / bpu['ratio_vs_eager']:.2f}x faster than eager" if b else ""
        ms = harness.fmt_ms
        rows.append(
            {
                "bar": f"{case['label']}: fxpass_bpu at least as fast as whole-model ONNX + ORT",
                "measured": f"bpu {ms(b)} ms vs ORT {ms(o)} ms{vs_eager}"
                if b and o
                else _or_errors(fxpass_bpu=bpu, onnxruntime=ort),
                "verdict": _vs(b, o),
            }
        )
        ortd = _res(case, "fxpass_ort")
        if _median(ortd) and o:
            rows.append({
                "bar": f"{case['label']}: fxpass_ort at least as fast as whole-model ONNX + ORT",
                "measured": f"ort device {ms(_median(ortd))} ms vs ORT {ms(o)} ms",
                "verdict": _vs(_median(ortd), o),
            })
        for r in (bpu, ortd):
            first = r["extra"].get("first_calls_ms") if r["stats"] else None
            if first and o:
                med = statistics.median(first) / 1e3
                rows.append({
                    "bar": f"{case['label']}: {r['contender']} within the first "
                           f"{len(first)} calls after compile <= 1.3x whole-model ORT",
                    "measured": f"median {ms(med)} ms (max {max(first):.3g}) vs ORT {ms(o)} ms",
                    "verdict": _vs(med, 1.3 * o),
                })
        rows.append(
            {
                "bar": f"{case['label']}: fxpass_bpu faster than inductor",
                "measured": f"bpu {ms(b)} ms vs inductor {ms(i)} ms"
                if b and i
                else _or_errors(fxpass_bpu=bpu, inductor=ind),
                "verdict": _vs(b, i, strict=True),
            }
        )
    return rows + _compile_bars(data)


def _compile_bars(data: dict[str, Any]) -> list[dict[str, str]]:
    """First call no slower than inductor's, and warm-cache compile >= 5x faster, per case."""
    rows = []
    for case in data["cases"]:
        bpu, ind = _res(case, "fxpass_bpu"), _res(case, "inductor")
        bf, inf_ = bpu["first_call_s"], ind["first_call_s"]
        rows.append(
            {
                "bar": f"{case['label']}: first call (compile) no slower than inductor's",
                "measured": f"{bf:.2f} s vs {inf_:.2f} s"
                if bf and inf_
                else _or_errors(fxpass_bpu=bpu, inductor=ind),
                "verdict": _vs(bf, inf_),
            }
        )
        x = bpu["extra"]
        cold = x.get("cold_child", {}).get("compile_first_call_s")
        warm = x.get("warm_child", {}).get("compile_first_call_s")
        ok = cold / warm >= WARM_BAR if cold and warm else None
        if not x.get("regions"):
            continue  # nothing offloaded, nothing cached: the bar does not apply
        rows.append(
            {
                "bar": f"{case['label']}: warm cache makes a new process's compile >= 5x faster",
                "measured": f"cold {cold:.2f} s / warm {warm:.2f} s = {cold / warm:.1f}x"
                f" ({x.get('regions', 0)} region(s))"
                if cold and warm
                else "not measured",
                "verdict": _verdict(ok, f"({cold / warm:.1f}x)" if ok is False else ""),
            }
        )
    return rows


def env_line(env: dict[str, Any]) -> str:
    keys = ("date", "torch", "transformers", "onnxruntime", "onnxscript", "cpu_count")
    parts = [f"{k} {env.get(k)}" for k in keys]
    parts.append(f"torch threads {env.get('torch_num_threads')}")
    parts.append(f"load avg {', '.join(f'{x:.2f}' for x in env.get('loadavg_1_5_15min', ()))}")
    return "; ".join(parts)


def to_markdown(data: dict[str, Any]) -> str:
    m, s = data["models"], data["scaling"]
    bars = data["bars"]
    return "\n\n".join(
        [
            f"## Benchmark results ({data['mode']} run)",
            f"Environment: {env_line(m['env'])}.",
            "### The performance bars",
            harness.markdown_table(bars, ["bar", "measured", "verdict"]),
            "## Models",
            models.to_markdown(m),
            "## Graph-size scaling",
            scaling.to_markdown(s),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the quick subset of both benchmarks")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--quiet-wait", type=float, help="max seconds to wait for a quiet machine")
    ap.add_argument(
        "--render-only", action="store_true", help="re-render md/png from DIR/latest.json"
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.render_only:
        render(json.loads((out / "latest.json").read_text()), out)
        return
    print("[run] models ...", file=sys.stderr, flush=True)
    # the parts are saved as they finish, so an interrupted run keeps what it measured
    partials = [out / "partial-models.json", out / "partial-scaling.json"]
    m = models.run(quick=args.quick, quiet_wait_s=args.quiet_wait, partial=partials[0])
    print("[run] scaling ...", file=sys.stderr, flush=True)
    s = scaling.run(quick=args.quick, partial=partials[1])
    data = {"mode": "quick" if args.quick else "full", "models": m, "scaling": s}
    harness.write_json(out / "latest.json", data)
    for p in partials:
        p.unlink(missing_ok=True)
    render(data, out)


def render(data: dict[str, Any], out: Path) -> None:
    """Bars (recomputed from the numbers), latest.md and ratios.png."""
    data["bars"] = scaling_bars(data["scaling"]) + model_bars(data["models"])
    harness.write_json(out / "latest.json", data)
    md = to_markdown(data)
    (out / "latest.md").write_text(md + "\n")
    harness.ratio_chart(*models.chart_data(data["models"]), out / "ratios.png")
    print(md)


if __name__ == "__main__":
    main()
