"""Deployed generation: ``export_for_generate`` -> package -> ``load(path).generate()``, side by
side with eager HF, the JIT fxpass path and ONNX Runtime GenAI on the same weights.

``python -m benchmarks.deploy [--quick] [--models qwen3-4x512,llama-4x512] [--repeats 5]``

Per model (random weights, 32,000 words, greedy, fp32, a 32-token prompt):

- ``eager-static``: HF ``generate(cache_implementation="static")``, the token reference;
- ``fxpass-jit``: ``compile_for_generate`` (``torch.compile`` with ``backend="fxpass_bpu"``);
- ``fxpass-package``: the package loaded in this process (``Runner.generate``, prefill in
  32-token chunks);
- ``genai``: ``onnxruntime-genai`` (builder fp32 cpu + ``Generator``).

Decode ms/token = (t(1 + N) - t(1)) / N from medians of round-robin samples
(``harness.interleave``), N = 32 and 128. Also: tokens equal to eager-static at both N; the
package's time per decode step outside its device region (the step's wall time minus the
region executor's, over 128 steps, median of 5); a fresh process after ``import torch``:
importing fxpass + ``load()`` + the first generated token (median of 3; the bar is 0.6 s),
with ``load()`` to the first token apart, and which of the modules a deployed process must
not need it imported; the package's size against the fp32 weights; 4 threads x 5
generations on one loaded runner, each call on its own cache (as shipped) against the same
calls serialized by a lock, every result checked against the sequential tokens; and, for a
stock BERT and a ResNet, export -> save -> load in this process against eager (max abs
difference, forward time ratio). Then the weight-only rows (``benchmarks.weight_only``: w8
and w4 packages on the ``ort`` device beside GenAI fp32 and int4, with quality against the
float model, on these models and SmolLM2-135M-Instruct); ``--no-weight-only`` skips them.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import generate, harness, weight_only
from benchmarks.generate import PROMPT, GenAI, _build, _compile_for, _hf_generate

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 32
MODELS = {k: generate.MODELS[k] for k in ("qwen3-4x512", "llama-4x512")}


def _outside_region(runner: Any, ids: torch.Tensor, steps: int, rounds: int = 5) -> dict:
    """Per decode step: wall time, the decode region executor's time, and the rest."""
    region = runner.package.regions[-1]  # the decode program's region (opened last)
    inner = region.executor
    spent = [0.0]

    class Timed:
        input_names = inner.input_names

        def __call__(self, *a: Any) -> Any:
            t = time.perf_counter()
            out = inner(*a)
            spent[0] += time.perf_counter() - t
            return out

    region.executor = Timed()
    try:
        rows = []
        for _ in range(rounds):
            got = {}
            for n in (1, steps + 1):
                spent[0] = 0.0
                t0 = time.perf_counter()
                runner.generate(ids, max_new_tokens=n, eos_token_id=[])
                got[n] = (time.perf_counter() - t0, spent[0])
            wall = (got[steps + 1][0] - got[1][0]) / steps
            dev = (got[steps + 1][1] - got[1][1]) / steps
            rows.append((wall, dev))
    finally:
        region.executor = inner
    wall = statistics.median(r[0] for r in rows)
    dev = statistics.median(r[1] for r in rows)
    return {"step_ms": wall * 1e3, "region_ms": dev * 1e3, "outside_ms": (wall - dev) * 1e3}


_CHILD = """
import sys, time
import torch
t0 = time.perf_counter()
from fxpass.backends.bpu import load
t1 = time.perf_counter()
r = load(sys.argv[1])
r.generate(torch.load(sys.argv[2]), max_new_tokens=1)
t2 = time.perf_counter()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in (
    "transformers", "onnx", "onnxscript", "hypothesis", "sympy") or m.startswith(
    ("torch._dynamo", "torch._inductor", "fxpass.rules")))
print(f"{t1 - t0} {t2 - t1} {','.join(heavy) or '-'}")
"""


def _fresh_first_token(path: str, ids: torch.Tensor, rounds: int = 3) -> dict:
    """In a fresh process after ``import torch``: fxpass's import, then ``load()`` to the
    first generated token; medians of ``rounds`` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "ids.pt"
        torch.save(ids, f)
        imports, firsts, totals, heavy = [], [], [], set()
        for _ in range(rounds):
            r = subprocess.run([sys.executable, "-c", _CHILD, path, str(f)], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
            if r.returncode:
                raise RuntimeError(r.stderr[-2000:])
            a, b, mods = r.stdout.split()[-3:]
            imports.append(float(a))
            firsts.append(float(b))
            totals.append(float(a) + float(b))
            heavy |= set(mods.split(",")) - {"-"}
    return {"fxpass_import_s": statistics.median(imports),
            "load_to_first_token_s": statistics.median(firsts),
            "after_torch_s": statistics.median(totals), "heavy_modules": sorted(heavy)}


class _FirstToken:
    """A streamer that stamps the first generated token (the first put is the prompt)."""

    def __init__(self) -> None:
        self.puts: list[float] = []

    def put(self, _tokens: torch.Tensor) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass


def _concurrency(runner: Any, prompt: torch.Tensor, threads: int = 4, calls: int = 5,
                 new_tokens: int = 32, rounds: int = 3) -> dict:
    """``threads`` threads x ``calls`` generations on one runner: each call on a cache of its
    own (the runner as shipped) against the same calls serialized by a lock. Every result is
    checked against the same call made alone. Wall seconds for all calls and the worst wait
    from a call to its first token, medians of ``rounds``."""
    import threading

    jobs = {(t, c): prompt[:, : prompt.shape[1] - (t + c) % 8] for t in range(threads)
            for c in range(calls)}
    alone = {k: runner.generate(ids, max_new_tokens=new_tokens) for k, ids in jobs.items()}
    lock = threading.Lock()

    def serialized(ids: torch.Tensor, streamer: Any) -> torch.Tensor:
        with lock:
            return runner.generate(ids, max_new_tokens=new_tokens, streamer=streamer)

    def concurrent(ids: torch.Tensor, streamer: Any) -> torch.Tensor:
        return runner.generate(ids, max_new_tokens=new_tokens, streamer=streamer)

    out: dict[str, Any] = {"threads": threads, "calls": calls, "new_tokens": new_tokens}
    for name, gen in (("per_call_state", concurrent), ("serialized", serialized)) * rounds:
        got: dict[tuple[int, int], torch.Tensor] = {}
        waits: list[float] = []
        start = threading.Barrier(threads + 1)

        def work(t: int, gen: Any = gen, got: dict = got, waits: list = waits,
                 start: Any = start) -> None:
            start.wait()
            for c in range(calls):
                clock, asked = _FirstToken(), time.perf_counter()
                got[t, c] = gen(jobs[t, c], clock)
                waits.append(clock.puts[1] - asked)

        pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for th in pool:
            th.start()
        start.wait()
        t0 = time.perf_counter()
        for th in pool:
            th.join()
        out.setdefault(name + "_s", []).append(time.perf_counter() - t0)
        out.setdefault(name + "_first_token_max_s", []).append(max(waits))
        out[name + "_tokens_ok"] = out.get(name + "_tokens_ok", True) and all(
            torch.equal(got[k], alone[k]) for k in jobs)
    for name in ("per_call_state", "serialized"):
        for key in ("_s", "_first_token_max_s"):
            out[name + key] = statistics.median(out[name + key])
    out["slots"] = runner.slots
    return out


def run_model(name: str, new_tokens: tuple[int, ...], repeats: int, tmp: Path) -> dict:
    from fxpass.backends.bpu import export_for_generate, load

    model, ids = _build(name)
    max_len = PROMPT + max(new_tokens) + 1
    t0 = time.perf_counter()
    program = export_for_generate(model, max_cache_len=max_len, prefill_length=CHUNK)
    export_s = time.perf_counter() - t0
    path = program.save(str(tmp / name))
    size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    weights = sum(p.numel() * 4 for p in model.parameters())
    runner = load(path)
    jit_model, _ = _build(name)
    _compile_for(jit_model, "fxpass_bpu", max_len)
    runners = {
        "eager-static": _hf_generate(model, ids, cache_implementation="static"),
        "fxpass-jit": _hf_generate(jit_model, ids),
        "fxpass-package": lambda n: runner.generate(ids, max_new_tokens=n, eos_token_id=[]),
        "genai": GenAI(model, ids, max_len),
    }
    ref = {n: runners["eager-static"](n) for n in new_tokens}
    match = {c: {n: bool(torch.equal(f(n), ref[n])) for n in new_tokens}
             for c, f in runners.items()}
    decode, first_ms = harness.decode_ms_per_token(runners, new_tokens, repeats, budget_s=30.0)
    return {
        "model": name, "new_tokens": list(new_tokens), "export_s": export_s,
        "package_mb": size / 1e6, "size_vs_weights": size / weights,
        "regions": [len(program.prefill.report.regions), len(program.decode.report.regions)],
        "tokens_match": match, "decode_ms_per_token": decode,
        "prefill_ms": first_ms,
        "package_step": _outside_region(runner, ids, max(new_tokens)),
        "fresh": _fresh_first_token(path, ids),
        "threads": _concurrency(runner, ids),
    }


def encoders(tmp: Path, repeats: int) -> list[dict]:
    """BERT and a ResNet: export, save, load, against eager."""
    import transformers

    from fxpass.backends.bpu import export, load
    from fxpass.tools import zoo

    cases = []
    bert, kw = zoo.get("bert", layers=4, hidden=256, heads=4, tokens=128)
    cases.append(("bert-4x256", bert, (), kw))
    cfg = transformers.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256],
                                    depths=[2, 2, 2, 2], layer_type="basic")
    torch.manual_seed(0)
    resnet = transformers.ResNetModel(cfg).eval()
    cases.append(("resnet-18ish", resnet, (torch.randn(1, 3, 224, 224),), {}))
    rows = []
    for name, model, args, kwargs in cases:
        loaded = load(export(model, args, kwargs).save(str(tmp / name)))
        with torch.no_grad():
            ref = model(*args, **kwargs)[0]
            got = loaded(*args, **kwargs)[0]
            stats = harness.interleave(
                {"eager": lambda m=model, a=args, k=kwargs: m(*a, **k),
                 "package": lambda m=loaded, a=args, k=kwargs: m(*a, **k)},
                                       repeats=repeats, budget_s=10.0)
        rows.append({"model": name, "max_abs_diff": float((got - ref).abs().max()),
                     "eager_ms": stats["eager"].median * 1e3,
                     "package_ms": stats["package"].median * 1e3})
    return rows


def to_markdown(data: dict[str, Any]) -> str:
    rows = []
    for r in data["runs"]:
        for n in r["new_tokens"]:
            g = r["decode_ms_per_token"]["genai"][n]
            e = r["decode_ms_per_token"]["eager-static"][n]
            for c, per in r["decode_ms_per_token"].items():
                rows.append({"model": r["model"], "new tokens": n, "contender": c,
                             "decode ms/token": f"{per[n]:.2f}", "vs genai": f"{per[n] / g:.2f}x",
                             "vs eager": f"{per[n] / e:.2f}x",
                             "tokens = eager": r["tokens_match"][c][n]})
    out = [harness.markdown_table(rows, ["model", "new tokens", "contender", "decode ms/token",
                                         "vs genai", "vs eager", "tokens = eager"])]
    pkg = [{"model": r["model"], "step ms": f"{r['package_step']['step_ms']:.2f}",
            "region ms": f"{r['package_step']['region_ms']:.2f}",
            "outside ms": f"{r['package_step']['outside_ms']:.2f}",
            "import + load + 1st token s": f"{r['fresh']['after_torch_s']:.2f}",
            "load -> 1st token s": f"{r['fresh']['load_to_first_token_s']:.2f}",
            "heavy imports": ", ".join(r["fresh"]["heavy_modules"]) or "none",
            "size vs weights": f"{r['size_vs_weights']:.4f}x",
            "regions (prefill, decode)": r["regions"], "export s": f"{r['export_s']:.1f}"}
           for r in data["runs"]]
    out.append(harness.markdown_table(pkg, list(pkg[0]) if pkg else []))
    conc = []
    for r in data["runs"]:
        c = r["threads"]
        conc.append({
            "model": r["model"], "threads x calls": f"{c['threads']} x {c['calls']}",
            "new tokens": c["new_tokens"], "per-call state s": f"{c['per_call_state_s']:.2f}",
            "serialized s": f"{c['serialized_s']:.2f}",
            "serialized / per-call": f"{c['serialized_s'] / c['per_call_state_s']:.2f}x",
            "worst wait for a 1st token s (per-call, serialized)":
                f"{c['per_call_state_first_token_max_s']:.2f}, "
                f"{c['serialized_first_token_max_s']:.2f}",
            "tokens = alone": c["per_call_state_tokens_ok"] and c["serialized_tokens_ok"],
            "caches": c["slots"]})
    out.append(harness.markdown_table(conc, list(conc[0]) if conc else []))
    if data.get("encoders"):
        enc = [{"model": e["model"], "max |package - eager|": f"{e['max_abs_diff']:.2e}",
                "eager ms": f"{e['eager_ms']:.2f}", "package ms": f"{e['package_ms']:.2f}",
                "vs eager": f"{e['package_ms'] / e['eager_ms']:.2f}x"} for e in data["encoders"]]
        out.append(harness.markdown_table(enc, list(enc[0])))
    if data.get("weight_only"):
        out.append(weight_only.to_markdown({"runs": data["weight_only"]}))
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="qwen3-4x512 only, 32 new tokens")
    ap.add_argument("--models", default=None, help=f"comma-separated subset of {list(MODELS)}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--no-weight-only", action="store_true",
                    help="skip the weight-only rows (benchmarks.weight_only: w8/w4 packages, "
                         "GenAI int4, SmolLM2)")
    args = ap.parse_args(argv)
    names = args.models.split(",") if args.models else (
        ["qwen3-4x512"] if args.quick else list(MODELS))
    new_tokens = (32,) if args.quick else (32, 128)
    data: dict[str, Any] = {"env": harness.environment(), "runs": []}
    stem = "deploy-quick" if args.quick else "deploy"
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            print(f"[deploy] {name} ...", file=sys.stderr, flush=True)
            data["runs"].append(run_model(name, new_tokens, args.repeats, Path(tmp)))
        if not args.quick:
            print("[deploy] encoders ...", file=sys.stderr, flush=True)
            data["encoders"] = encoders(Path(tmp), args.repeats)
    if not args.no_weight_only:  # its own temporary directory: packages of four variants
        wq = weight_only.run(None, args.quick, args.repeats, None)
        data["weight_only"] = wq["runs"]
    harness.write_results(args.out, stem, data, to_markdown(data))


if __name__ == "__main__":
    main()
