"""Fuzzing at scale (issue 9): Hypothesis programs and PyTorch's OpInfo samples vs eager.

    python -m benchmarks.fuzz              # >= 10,000 programs + the OpInfo sweep (long)
    python -m benchmarks.fuzz --quick      # 300 programs + 2 samples of 80 ops (minutes)
    python -m benchmarks.fuzz --part programs --shard 0/2   # pieces, merged with --merge

Every program goes through all built-in rules (PassManager, contract checks on) and through
``torch.compile(..., backend="fxpass_bpu", options={"min_compute_macs": 0})``; every OpInfo
sample through the backend with a matmul in front (so it is offloaded), with ``aot_eager``
as the control. Results: benchmarks/results/fuzz.{json,md}. This is a benchmark, not a test:
findings are listed, and each fxpass finding gets a regression test in
tests/backends/test_fuzz_regressions.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parents[1] / "results"


def fuzz_programs(n: int, seed: int, backend: bool = True, progress: int = 100,
                  checkpoint: Path | None = None) -> dict:
    """``n`` Hypothesis programs (fixed seed, no shrinking) through rules and backend."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    from benchmarks.fuzz.programs import programs
    from benchmarks.fuzz.run import Tally, run_program
    from fxpass.rules import ALL

    t = Tally()
    cache = tempfile.mkdtemp(prefix="fxpass-fuzz-")
    options = {"min_compute_macs": 0, "cache_dir": cache}
    t0 = time.perf_counter()

    @hseed(seed)
    @settings(max_examples=n, deadline=None, database=None, derandomize=False,
              phases=(Phase.generate,), suppress_health_check=list(HealthCheck))
    @given(programs())
    def prop(prog: Any) -> None:
        run_program(prog, t, list(ALL), options, backend)
        if progress and t.tried % progress == 0:
            if checkpoint is not None:  # a long run leaves usable partial results
                checkpoint.write_text(json.dumps({"programs": snapshot()}, default=str))
            print(f"  programs {t.tried}/{n} in {time.perf_counter() - t0:.0f}s: "
                  f"{t.rules_mismatch + t.backend_mismatch} mismatches, "
                  f"{t.rules_crash + t.backend_crash} crashes, {t.regions} regions", flush=True)

    def snapshot() -> dict:
        out = {k: dict(v) if isinstance(v, dict) else v for k, v in vars(t).items()}
        out["seconds"] = time.perf_counter() - t0
        out["seed"] = seed
        return out

    prop()
    return snapshot()


def fuzz_kit(n: int, seed: int, progress: int = 100, checkpoint: Path | None = None) -> dict:
    """``n`` graphs of the testing kit's rule-targeted vocabulary and traced SDPA."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    from benchmarks.fuzz.kit import kit_cases, run_graph
    from benchmarks.fuzz.run import Tally
    from fxpass.rules import ALL

    t = Tally()
    options = {"min_compute_macs": 0, "cache_dir": tempfile.mkdtemp(prefix="fxpass-kit-")}
    t0 = time.perf_counter()

    def snapshot() -> dict:
        out = {k: dict(v) if isinstance(v, dict) else v for k, v in vars(t).items()}
        return {**out, "seconds": time.perf_counter() - t0, "seed": seed}

    @hseed(seed)
    @settings(max_examples=n, deadline=None, database=None, derandomize=False,
              phases=(Phase.generate,), suppress_health_check=list(HealthCheck))
    @given(kit_cases())
    def prop(case: Any) -> None:
        run_graph(case[0], case[1], t, list(ALL), options)
        if progress and t.tried % progress == 0:
            if checkpoint is not None:
                checkpoint.write_text(json.dumps({"kit": snapshot()}, default=str))
            print(f"  kit {t.tried}/{n} in {time.perf_counter() - t0:.0f}s: "
                  f"{t.rules_mismatch + t.backend_mismatch} mismatches, "
                  f"{t.rules_crash + t.backend_crash} crashes", flush=True)

    prop()
    return snapshot()


def _merge(parts: list[dict]) -> dict:
    """Sum counters of shards of one kind (programs or opinfo)."""
    total: dict[str, Any] = {}
    for p in parts:
        for k, v in p.items():
            if isinstance(v, bool) or k in ("seed", "shard"):
                continue
            if isinstance(v, (int, float)):
                total[k] = total.get(k, 0) + v
            elif isinstance(v, dict):
                d = total.setdefault(k, {})
                for kk, vv in v.items():
                    d[kk] = d.get(kk, 0) + vv if isinstance(vv, (int, float)) else vv
            elif isinstance(v, list):
                total.setdefault(k, []).extend(v)
    return total


def write(result: dict, quick: bool) -> None:
    from benchmarks.fuzz.report import markdown

    RESULTS.mkdir(exist_ok=True)
    stem = "fuzz-quick" if quick else "fuzz"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    (RESULTS / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few minutes instead of hours")
    ap.add_argument("--programs", type=int, default=None, help="how many programs")
    ap.add_argument("--samples", type=int, default=None, help="OpInfo samples per op")
    ap.add_argument("--first-sample", type=int, default=0,
                    help="skip each op's first samples (a second pass over samples k..n)")
    ap.add_argument("--part", choices=("programs", "kit", "opinfo", "all"), default="all")
    ap.add_argument("--kit", type=int, default=None, help="how many kit graphs")
    ap.add_argument("--shard", default="0/1", help="k/n: this process's share")
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--merge", action="store_true", help="merge part files into fuzz.json")
    a = ap.parse_args(argv)
    k, n = (int(x) for x in a.shard.split("/"))
    parts = RESULTS / "fuzz-parts"
    if a.merge:
        done = {f.stem for f in parts.glob("*.json")}
        # a shard still running (or cut off by a deadline) counts with its last checkpoint
        files = sorted([*parts.glob("*.json"),
                        *(f for f in parts.glob("*.partial") if f.stem not in done)])
        loaded = [json.loads(f.read_text()) for f in files]
        result = _header(a.quick, [f.name for f in files])
        for kind in ("programs", "kit", "opinfo"):
            ps = [p[kind] for p in loaded if kind in p]
            if ps:
                result[kind] = _merge(ps)
        write(result, a.quick)
        return
    torch.set_num_threads(1)  # a shared 2-core machine; also keeps runs comparable
    n_prog = a.programs if a.programs is not None else (300 if a.quick else 10_000)
    samples = a.samples if a.samples is not None else (2 if a.quick else 12)
    result = _header(a.quick, [])
    result["shard"] = a.shard
    if a.part in ("programs", "all") and n_prog:
        print(f"programs: {n_prog // n} (shard {a.shard})", flush=True)
        parts.mkdir(parents=True, exist_ok=True)
        ck = parts / f"programs-{k}of{n}.partial"
        result["programs"] = fuzz_programs(n_prog // n, a.seed + k, checkpoint=ck)
    n_kit = a.kit if a.kit is not None else (100 if a.quick else 2_000)
    if a.part in ("kit", "all") and n_kit:
        parts.mkdir(parents=True, exist_ok=True)
        ck = parts / f"kit-{k}of{n}.partial"
        result["kit"] = fuzz_kit(n_kit // n, a.seed + 100 + k, checkpoint=ck)
    if a.part in ("opinfo", "all") and samples:
        from benchmarks.fuzz.opinfo import sweep

        print(f"opinfo: up to {samples} samples per op (shard {a.shard})", flush=True)
        parts.mkdir(parents=True, exist_ok=True)
        ck = parts / f"opinfo{a.first_sample or ''}-{k}of{n}.partial"
        result["opinfo"] = sweep(samples, shard=(k, n), max_ops=80 if a.quick else None,
                                 checkpoint=ck, first_sample=a.first_sample)
    if n > 1 or a.part != "all":
        parts.mkdir(parents=True, exist_ok=True)
        tag = f"{a.part}{a.first_sample or ''}-{k}of{n}"
        (parts / f"{tag}.json").write_text(json.dumps(result, default=str))
        print(f"wrote {parts / f'{tag}.json'}")
    else:
        write(result, a.quick)


def _header(quick: bool, parts: list[str]) -> dict:
    import onnxruntime

    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": quick,
        "parts": parts,
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }
