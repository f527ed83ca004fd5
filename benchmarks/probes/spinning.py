"""onnxruntime's pool spinning after a run, A/B: what ``host.ort.STOP_SPINNING`` buys.

    python -m benchmarks.probes.spinning [--rounds 3] [--out benchmarks/results]

Session options cannot change inside a process once its sessions exist, so each sample is a
fresh process: ``stop`` (fxpass's default: ``session.force_spinning_stop=1``) and ``spin``
(onnxruntime's default: the pool keeps spinning after a run), alternating, ``--rounds`` each,
over one artifact cache (compiled once, before the timed processes). Each process times
fxpass_bpu and eager side by side (``harness.interleave``, medians); the table gives the
medians over the processes.

Cases: a mixture-of-experts forward (Qwen3-MoE 4 x 512, 8 experts, 64 tokens: the routing runs
on the CPU between the regions), single-region forwards (Qwen3 4 x 1024 at 1 and 128 tokens)
and ``generate()`` decode (Qwen3 4 x 512, static cache, ms per token over 32 new tokens).
Writes ``benchmarks/probes/results/spinning.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[2]
MARK = "FXPASS_SPINNING "
CASES = {
    "qwen3-moe-4x512 t=64": ("qwen3-moe", dict(layers=4, hidden=512, heads=8, kv_heads=4,
                                                vocab=8000, tokens=64)),
    "qwen3-4x1024 t=1": ("qwen3-4l-1024", dict(tokens=1)),
    "qwen3-4x1024 t=128": ("qwen3-4l-1024", dict(tokens=128)),
    "qwen3-4x512 decode": ("generate", {}),
}


def _forward(name: str, kw: dict[str, Any], cache: str) -> dict[str, Any]:
    import fxpass
    from fxpass.tools import zoo

    model, kwargs = zoo.get(name, **kw)
    compiled = torch.compile(model, backend="fxpass_bpu", dynamic=False,
                             options={"cache_dir": cache})
    with torch.no_grad():
        ref, got = model(**kwargs).logits, compiled(**kwargs).logits
        stats = harness.interleave({"eager": lambda: model(**kwargs),
                                    "fxpass_bpu": lambda: compiled(**kwargs)}, repeats=15)
    return {"eager_ms": stats["eager"].median * 1e3, "fxpass_ms": stats["fxpass_bpu"].median * 1e3,
            "max_abs_err": (ref - got).abs().max().item(),
            "regions": [len(r.regions) for r in fxpass.compile_reports()]}


def _decode(cache: str) -> dict[str, Any]:
    import fxpass
    from benchmarks.generate import PROMPT, _build, _compile_static, _hf_generate

    os.environ["FXPASS_CACHE_DIR"] = cache
    eager_model, ids = _build("qwen3-4x512")
    model, _ = _build("qwen3-4x512")
    _compile_static(model, "fxpass_bpu", PROMPT + 34)
    runs = {"eager": _hf_generate(eager_model, ids), "fxpass_bpu": _hf_generate(model, ids)}
    match = torch.equal(runs["eager"](32), runs["fxpass_bpu"](32))
    stats = harness.interleave({f"{k} {n}": (lambda r=r, n=n: r(n)) for k, r in runs.items()
                                for n in (1, 33)}, repeats=7, settle_s=0.05)

    def per_token(k: str) -> float:
        return (stats[f"{k} 33"].median - stats[f"{k} 1"].median) / 32 * 1e3

    return {"eager_ms": per_token("eager"), "fxpass_ms": per_token("fxpass_bpu"),
            "tokens_match": match, "regions": [len(r.regions) for r in fxpass.compile_reports()]}


def child(case: str, variant: str, cache: str) -> None:
    from fxpass.backends.onnx.host import ort as runtime

    runtime.STOP_SPINNING = variant == "stop"
    name, kw = CASES[case]
    out = _decode(cache) if name == "generate" else _forward(name, kw, cache)
    print(MARK + json.dumps(out), flush=True)


def _spawn(case: str, variant: str, cache: str) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "benchmarks.probes.spinning", "--child", case,
                        variant, cache], capture_output=True, text=True, cwd=ROOT, timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"{case} {variant} failed:\n{p.stderr[-2000:]}")


def run(rounds: int, cases: list[str]) -> dict[str, Any]:
    data: dict[str, Any] = {"env": harness.environment(), "rounds": rounds, "cases": {}}
    with tempfile.TemporaryDirectory() as cache:
        for case in cases:
            _spawn(case, "stop", cache)  # compiles into the cache: no timed process compiles
            samples: dict[str, list[dict[str, Any]]] = {"stop": [], "spin": []}
            for r in range(rounds):
                for variant in (("stop", "spin") if r % 2 == 0 else ("spin", "stop")):
                    samples[variant].append(_spawn(case, variant, cache))
                    print(case, variant, samples[variant][-1], flush=True)
            data["cases"][case] = samples
    return data


def rows(data: dict[str, Any]) -> list[dict[str, str]]:
    out = []
    for case, s in data["cases"].items():
        def med(v: str, k: str, s: dict = s) -> float:
            return statistics.median(x[k] for x in s[v])

        stop, spin = med("stop", "fxpass_ms"), med("spin", "fxpass_ms")
        # the machine's drift moves eager too: fxpass over eager in the same process
        rel = {v: statistics.median(x["fxpass_ms"] / x["eager_ms"] for x in s[v])
               for v in ("stop", "spin")}
        out.append({
            "case": case, "regions/graph": str(s["stop"][0]["regions"]),
            "fxpass stop ms": f"{stop:.2f}", "fxpass spin ms": f"{spin:.2f}",
            "stop / spin": f"{stop / spin:.2f}x",
            "eager ms (stop / spin processes)":
                f"{med('stop', 'eager_ms'):.2f} / {med('spin', 'eager_ms'):.2f}",
            "fxpass / eager in-process (stop / spin)": f"{rel['stop']:.2f}x / {rel['spin']:.2f}x",
        })
    return out


def to_markdown(data: dict[str, Any]) -> str:
    cols = ["case", "regions/graph", "fxpass stop ms", "fxpass spin ms", "stop / spin",
            "eager ms (stop / spin processes)", "fxpass / eager in-process (stop / spin)"]
    env = data["env"]
    return (f"Run {env.get('date', '')}: medians over {data['rounds']} fresh processes per "
            "variant, alternating; decode is ms per token.\n\n"
            + harness.markdown_table(rows(data), cols))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=3, metavar=("CASE", "VARIANT", "CACHE"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", action="append", choices=list(CASES))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "probes" / "results"))
    ap.add_argument("--tag", default="", help="results go to spinning-TAG.{json,md}")
    a = ap.parse_args(argv)
    if a.child:
        child(*a.child)
        return
    data = run(a.rounds, a.only or list(CASES))
    md = to_markdown(data)
    harness.write_results(a.out, "spinning" + (f"-{a.tag}" if a.tag else ""), data, md)
    print(md)


if __name__ == "__main__":
    main()
