"""Time fxpass_bpu's cold compile at several commits, to find a compile-time regression.

Each commit is checked out into its own ``git worktree`` under ``/tmp/fxpass-bisect`` (the
working tree you are in is never touched), and each sample is a fresh Python process with an
empty ``FXPASS_CACHE_DIR`` that imports fxpass from that worktree. The model is built here with
``transformers`` directly (same config as the zoo's ``qwen3``/``llama`` at 4 x 1024, seed 0),
so every commit compiles the same model even where the zoo moved. Samples are taken round-robin
over the commits (commit A, B, C, A, B, C, ...) so that load on a shared machine hits all of them
alike; the medians are printed as a table and written as JSON.

    python -m benchmarks.probes.bisect_compile                        # default candidates
    python -m benchmarks.probes.bisect_compile --repeats 5 bf78e4b HEAD  # any commits
    python -m benchmarks.probes.bisect_compile --bisect GOOD BAD         # by midpoints

Per sample it records the wall time of ``torch.compile`` + first call, the backend's own
``compile_seconds`` (from the compile reports), which excludes Dynamo and AOTAutograd, and the
process CPU time (user + system, all threads) of the compile. On a shared machine the CPU time
is the steadier measure: wall time there doubled from one round to the next.

Old commits (before ``fxpass.rules``/``fxpass.backends`` were installed names) import the
plugin as top-level ``rules``/``backends``; the worktree gets ``fxpass/rules`` and
``fxpass/backends`` symlinks so that both spellings resolve to that commit's code, never to the
editable install of the main working tree.
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

ROOT = Path(__file__).resolve().parents[2]
WORKTREES = Path(tempfile.gettempdir()) / "fxpass-bisect"
#: 11-30 15:32 and 16:36 runs (the reported 7.3 -> 11.4 s), then the commits of the round after
#: that touched the backend, the rules or the core (host fusions, cse, cache checks, ...).
DEFAULT_COMMITS = [
    "bf78e4b",  # state of the 15:32 run
    "34bbc72",  # state of the 16:36 run
    "5be659a",  # fxpass.rules / fxpass.backends names
    "2861eae",  # kv_cache_update rule
    "44b8353",  # onnxscript host fusions (optimize_for_ort)
    "50d7ee3",  # cse rule
    "9e9a562",  # cache manifest checks, CPU fingerprint
    "aee1a45",  # core reliability checks
    "2de796a",  # NaN/Inf-exact lowering
    "e1806de",  # cse purity per target
    "HEAD",
]

CHILD = r"""
import json, os, sys, time
wt = sys.argv[1]
sys.path.insert(0, wt)
t_import = time.perf_counter()
import torch, transformers
model_name, tokens, dtype = sys.argv[2], int(sys.argv[3]), getattr(torch, sys.argv[4])
opts = json.loads(sys.argv[5])
cfg_cls = {"qwen3": "Qwen3Config", "llama": "LlamaConfig"}[model_name]
mdl_cls = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[model_name]
extra = {"head_dim": 64} if model_name == "qwen3" else {}
cfg = getattr(transformers, cfg_cls)(vocab_size=32000, hidden_size=1024, intermediate_size=2048,
    num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
    max_position_embeddings=max(256, tokens * 2), **extra)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
model = getattr(transformers, mdl_cls)(cfg).eval().to(dtype)
ids = torch.randint(0, 32000, (1, tokens), generator=torch.Generator().manual_seed(0))
src = open(os.path.join(wt, "backends", "bpu", "backend.py")).read()
pkg = "fxpass.backends" if "from fxpass.backends" in src else "backends"
import importlib
backend = importlib.import_module(pkg + ".bpu.backend")
report = importlib.import_module(pkg + ".bpu.report")
here = (os.path.realpath(wt), wt)
assert backend.__file__.startswith(here), backend.__file__
def fx(gm, ex):
    return backend.fxpass_bpu(gm, ex, options=opts)
import resource
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
with torch.no_grad():
    t0, c0 = time.perf_counter(), cpu()
    out = torch.compile(model, backend=fx, dynamic=False)(input_ids=ids, use_cache=False)
    first, first_cpu = time.perf_counter() - t0, cpu() - c0
    ref = model(input_ids=ids, use_cache=False)
err = (out.logits.float() - ref.logits.float()).abs().max().item()
reps = list(report.REPORTS)
print(json.dumps({"first_call_s": first, "cpu_s": first_cpu,
                  "backend_s": sum(r.compile_seconds for r in reps),
                  "regions": sum(len(r.regions) for r in reps),
                  "cached": sum(bool(g.cached) for r in reps for g in r.regions), "err": err,
                  "module": backend.__file__}))
"""


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def worktree(commit: str) -> Path:
    """A detached worktree of ``commit`` (created once, reused), with the import symlinks."""
    sha = _git("rev-parse", commit)
    wt = WORKTREES / sha[:12]
    if not wt.exists():
        WORKTREES.mkdir(parents=True, exist_ok=True)
        _git("worktree", "add", "--detach", str(wt), sha)
    for name in ("rules", "backends"):
        link = wt / "fxpass" / name
        if not link.exists():
            link.symlink_to(Path("..") / name)
    return wt


def sample(wt: Path, model: str, tokens: int, dtype: str, opts: dict) -> dict:
    """One cold first call in a fresh process with an empty fxpass cache."""
    with tempfile.TemporaryDirectory(prefix="fxpass-bisect-cache-") as cache:
        env = {**os.environ, "FXPASS_CACHE_DIR": cache, "PYTHONPATH": str(wt)}
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")  # unused, kept private
        p = subprocess.run(
            [sys.executable, "-c", CHILD, str(wt), model, str(tokens), dtype, json.dumps(opts)],
            env=env,
            cwd=wt,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    if p.returncode != 0:
        return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "failed"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure(commits: list[str], repeats: int, model: str, tokens: int, dtype: str) -> dict:
    """Round-robin samples over ``commits``; returns {commit: {samples, medians}}."""
    opts = {"executor": "onnxruntime"}
    commits = [_git("rev-parse", "--short=12", c) if c == "HEAD" else c for c in commits]
    wts = {c: worktree(c) for c in commits}
    res: dict[str, dict] = {c: {"sha": wts[c].name, "samples": []} for c in commits}
    for rep in range(repeats):
        for c in commits:
            s = sample(wts[c], model, tokens, dtype, opts)
            res[c]["samples"].append(s)
            print(f"[bisect] round {rep + 1} {c}: {s}", file=sys.stderr, flush=True)
    for r in res.values():
        ok = [s for s in r["samples"] if "error" not in s]
        for k in ("first_call_s", "backend_s", "cpu_s"):
            r[k] = statistics.median(s[k] for s in ok) if ok else None
        r["subject"] = _git("log", "-1", "--format=%ad %s", "--date=format:%m-%d %H:%M", r["sha"])
    return res


def table(res: dict) -> str:
    rows = [
        "| commit | first call s (median) | backend s (median) | CPU s (median) | n | subject |",
        "|---|---|---|---|---|---|",
    ]
    for c, r in res.items():
        f = f"{r['first_call_s']:.2f}" if r["first_call_s"] else "failed"
        b = f"{r['backend_s']:.2f}" if r["backend_s"] else ""
        n = sum(1 for s in r["samples"] if "error" not in s)
        u = f"{r['cpu_s']:.2f}" if r.get("cpu_s") else ""
        rows.append(f"| {r['sha'][:8]} ({c}) | {f} | {b} | {u} | {n} | {r['subject'][:90]} |")
    return "\n".join(rows)


def bisect(good: str, bad: str, repeats: int, model: str, tokens: int, dtype: str) -> dict:
    """Midpoint search between ``good`` and ``bad``: a commit is bad when its median backend
    time is nearer the bad end's than the good end's."""
    revs = _git("rev-list", "--reverse", f"{good}..{bad}").split()
    ends = measure([good, bad], repeats, model, tokens, dtype)
    g, b = ends[good]["backend_s"], ends[bad]["backend_s"]
    lo, hi, seen = 0, len(revs) - 1, dict(ends)
    while lo < hi:
        mid = (lo + hi) // 2
        r = measure([revs[mid]], repeats, model, tokens, dtype)[revs[mid]]
        seen[revs[mid]] = r
        if abs(r["backend_s"] - b) < abs(r["backend_s"] - g):
            hi = mid
        else:
            lo = mid + 1
    print(f"[bisect] first bad commit: {revs[lo]}", file=sys.stderr)
    return seen


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("commits", nargs="*", help=f"commits to time (default: {DEFAULT_COMMITS})")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="qwen3", choices=["qwen3", "llama"])
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--bisect", nargs=2, metavar=("GOOD", "BAD"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "probes" / "results"
                                         / "bisect_compile.json"))
    a = ap.parse_args(argv)
    if a.bisect:
        res = bisect(*a.bisect, a.repeats, a.model, a.tokens, a.dtype)
    else:
        res = measure(a.commits or DEFAULT_COMMITS, a.repeats, a.model, a.tokens, a.dtype)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))


if __name__ == "__main__":
    main()
