"""Compile time of fxpass_bpu against inductor: cold first call and warm new process.

    python -m benchmarks.compile_time                    # the matrix below, median of 3
    python -m benchmarks.compile_time --repeats 5 --tokens 1,128
    python -m benchmarks.compile_time --profile          # cProfile of the backend's own time
    python -m benchmarks.compile_time --profile --tokens 128 --dtype bfloat16
    python -m benchmarks.compile_time --hash             # hash throughput (digest.py's choice)
    python -m benchmarks.compile_time --remote           # Qwen3 4x512 on a warm Redis (fleet),
                                                         # torch.compile and fxpass.precompile

Every sample is a fresh Python process (imports and model construction are not timed; the
timed span is ``torch.compile(...)`` plus the first call). How each cache is set:

- cold: fxpass_bpu gets a new empty ``FXPASS_CACHE_DIR`` (its ``cache_dir``); inductor gets
  ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` and a new empty ``TORCHINDUCTOR_CACHE_DIR``.
- fill (inductor only): caches on, a new empty directory; what inductor's first compile costs
  when it writes its caches (fxpass's cold sample fills its directory anyway).
- warm: a second process over the directory its cold (fxpass) or fill (inductor) sample
  filled; inductor then reuses its FX graph and AOTAutograd caches.

The contenders are interleaved (fxpass cold, inductor cold, inductor fill, fxpass warm,
inductor warm, then the next repeat), so load on a shared machine hits both alike. Results go
to ``benchmarks/results/compile_time.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "results"
TAG = ""  # --tag: results go to compile_time-<tag>.{json,md}
MODELS = {
    "qwen3-4x1024 fp32": ("qwen3", "float32"),
    "llama-4x1024 fp32": ("llama", "float32"),
    "qwen3-4x1024 bf16": ("qwen3", "bfloat16"),
}

CHILD = r"""
import json, os, resource, sys, time
spec = json.loads(sys.argv[1])
import torch
import fxpass.tools.zoo as zoo
model, kw = zoo.get(spec["model"], layers=4, hidden=spec.get("hidden", 1024),
                    heads=spec.get("heads", 16), kv_heads=spec.get("kv_heads", 8), vocab=32000,
                    tokens=spec["tokens"], dtype=getattr(torch, spec["dtype"]))
if spec["backend"] == "fxpass_bpu":
    opts = {"options": {"executor": "onnxruntime", "cache_dir": os.environ["FXPASS_CACHE_DIR"]}}
else:
    opts = {}
prof = None
if spec.get("profile"):
    import cProfile
    from fxpass.jit import backend as B
    prof, inner = cProfile.Profile(), B.compile_graph
    def compile_graph(gm, o):
        prof.enable()
        try:
            return inner(gm, o)
        finally:
            prof.disable()
    B.compile_graph = compile_graph
with torch.no_grad():
    t0 = time.perf_counter()
    if spec.get("precompile"):  # fxpass.precompile: the trace itself comes from the cache
        import fxpass
        out = fxpass.precompile(model, spec["backend"].removeprefix("fxpass_"),
                                opts["options"])(**kw)
    else:
        out = torch.compile(model, backend=spec["backend"], dynamic=False, **opts)(**kw)
    first = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
res = {"first_call_s": first, "maxrss_mb": rss}
if spec["backend"] == "fxpass_bpu":
    import fxpass
    reps = fxpass.compile_reports()
    res["backend_s"] = sum(r.compile_seconds for r in reps)
    res["regions"] = sum(len(r.regions) for r in reps)
    res["cached_regions"] = sum(g.cached for r in reps for g in r.regions)
    res["plan_hit"] = any("plan loaded" in n for r in reps for n in r.notes)
    res["sources"] = [g.source for r in reps for g in r.regions]
    if spec.get("precompile"):
        from fxpass.jit.precompile import STATS
        res["entry"] = sorted(k for k, v in STATS.items() if v)
    res["weights_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
if spec.get("settle"):  # the background tier built and its entry stored, before exit
    from fxpass.backends.bpu import settle
    settle()
if prof is not None:
    prof.dump_stats(spec["profile"])
print("RESULT " + json.dumps(res))
"""


def child(spec: dict, env: dict[str, str]) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(lines[-1][len("RESULT ") :])


def one_round(model: str, dtype: str, tokens: int, tmp: Path) -> dict[str, dict]:
    """One interleaved round of every (contender, cache state) for one case."""
    spec = {"model": model, "dtype": dtype, "tokens": tokens}
    fx_dir, ind_cold, ind_warm = (Path(tempfile.mkdtemp(dir=tmp)) for _ in range(3))
    fx = {**spec, "backend": "fxpass_bpu"}
    ind = {**spec, "backend": "inductor"}
    off = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "TORCHINDUCTOR_CACHE_DIR": str(ind_cold)}
    on = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "0", "TORCHINDUCTOR_CACHE_DIR": str(ind_warm)}
    r = {
        "fxpass_bpu cold": child(fx, {"FXPASS_CACHE_DIR": str(fx_dir)}),
        "inductor cold": child(ind, off),
        "inductor fill": child(ind, on),
        "fxpass_bpu warm": child(fx, {"FXPASS_CACHE_DIR": str(fx_dir)}),
        "inductor warm": child(ind, on),
    }
    for d in (fx_dir, ind_cold, ind_warm):
        shutil.rmtree(d, ignore_errors=True)
    return r


def _median(samples: list[dict], key: str) -> float | None:
    vals = [s[key] for s in samples if key in s and s[key] is not None]
    return statistics.median(vals) if vals else None


def run(cases: list[tuple[str, int]], repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "repeats": repeats}
    out["loadavg_start"] = os.getloadavg()
    res: dict[str, dict[str, list]] = {}
    with tempfile.TemporaryDirectory(prefix="fxpass-compile-time-") as tmp:
        for rep in range(repeats):
            for label, tokens in cases:
                model, dtype = MODELS[label]
                case = f"{label} t={tokens}"
                r = one_round(model, dtype, tokens, Path(tmp))
                for k, v in r.items():
                    res.setdefault(case, {}).setdefault(k, []).append(v)
                print(
                    f"[compile_time] {rep + 1}/{repeats} {case}: {json.dumps(r)}", file=sys.stderr
                )
                _save(out, res)
    out["loadavg_end"] = os.getloadavg()
    return _save(out, res)


def _save(out: dict, res: dict) -> dict:
    out["cases"] = {
        case: {
            k: {
                "samples": v,
                "first_call_s": _median(v, "first_call_s"),
                "backend_s": _median(v, "backend_s"),
                "maxrss_mb": _median(v, "maxrss_mb"),
            }
            for k, v in per.items()
        }
        for case, per in res.items()
    }
    OUT.mkdir(parents=True, exist_ok=True)
    stem = f"compile_time-{TAG}" if TAG else "compile_time"  # a subset never replaces the matrix
    (OUT / f"{stem}.json").write_text(json.dumps(out, indent=1) + "\n")
    (OUT / f"{stem}.md").write_text(markdown(out) + "\n")
    return out


def markdown(out: dict) -> str:
    rows = [
        f"Run {out['date']}, median of {out['repeats']} fresh processes per cell, interleaved; "
        f"load average at start {tuple(round(x, 1) for x in out['loadavg_start'])}.",
        "",
        "| case | fxpass cold s | inductor cold s | cold ratio (bar <= 0.5) | fxpass warm s "
        "| inductor warm s | warm ratio (bar <= 1.0) | fxpass backend cold / warm s "
        "(bar 2 / 0.25) | inductor fill s | peak RSS cold MB fxpass / inductor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: float | None) -> str:
        return f"{x:.2f}" if x is not None else "n/a"

    for case, c in out["cases"].items():
        g = {k: c.get(k, {}) for k in c}
        fc, ic = g["fxpass_bpu cold"].get("first_call_s"), g["inductor cold"].get("first_call_s")
        fw, iw = g["fxpass_bpu warm"].get("first_call_s"), g["inductor warm"].get("first_call_s")
        cr = f"{fc / ic:.2f}x" if fc and ic else "n/a"
        wr = f"{fw / iw:.2f}x" if fw and iw else "n/a"
        fcold, fwarm = g["fxpass_bpu cold"], g["fxpass_bpu warm"]
        be = f"{f(fcold.get('backend_s'))} / {f(fwarm.get('backend_s'))}"
        rss = (
            f"{f(g['fxpass_bpu cold'].get('maxrss_mb'))} / {f(g['inductor cold'].get('maxrss_mb'))}"
        )
        rows.append(
            f"| {case} | {f(fc)} | {f(ic)} | {cr} | {f(fw)} | {f(iw)} | {wr} | {be} | "
            f"{f(g['inductor fill'].get('first_call_s'))} | {rss} |"
        )
    return "\n".join(rows)


# -- the remote tier (issue 48): a fresh machine against a warm Redis ----------------------------

SECRET = "benchmark-fleet-secret"
REMOTE_MODEL = {"model": "qwen3", "dtype": "float32", "hidden": 512, "heads": 8, "kv_heads": 4,
                "backend": "fxpass_bpu", "settle": True}


def remote_round(tokens: int, tmp: Path, url: str, client: Any) -> dict[str, dict]:
    """One interleaved round on Qwen3 4 x 512, under ``torch.compile`` and under
    ``fxpass.precompile``: a cold compile (empty local cache, no Redis); a local-warm process
    over its directory; a cold compile that publishes to an empty Redis; and a fresh process
    with an empty local cache against that warm Redis (the fleet's case). The store signs its
    entries (``FXPASS_REMOTE_CACHE_SECRET``), as precompiled entries require."""
    r: dict[str, dict] = {}
    published = {}
    for pre in (False, True):
        spec = {**REMOTE_MODEL, "tokens": tokens, "precompile": pre}
        local, pub, fresh = (Path(tempfile.mkdtemp(dir=tmp)) for _ in range(3))
        client.flushall()
        tag = "precompile: " if pre else ""
        r[tag + "cold"] = child(spec, {"FXPASS_CACHE_DIR": str(local)})
        r[tag + "local warm"] = child(spec, {"FXPASS_CACHE_DIR": str(local)})
        remote = {"FXPASS_REMOTE_CACHE": url, "FXPASS_REMOTE_CACHE_SECRET": SECRET}
        r[tag + "cold, publishing"] = child(spec, {"FXPASS_CACHE_DIR": str(pub), **remote})
        r[tag + "remote warm"] = child(spec, {"FXPASS_CACHE_DIR": str(fresh), **remote})
        # what the fleet's store holds for the model, against its weights
        published[tag] = sum(client.strlen(k) for k in client.scan_iter("fxpass:a:*"))
        r[tag + "remote warm"]["published_bytes"] = published[tag]
        for d in (local, pub, fresh):
            shutil.rmtree(d, ignore_errors=True)
    return r


def remote_run(repeats: int, tokens: int = 1) -> dict[str, Any]:
    """``--remote``: :func:`remote_round` ``repeats`` times on a throwaway redis-server;
    medians to ``compile_time-remote.{json,md}``."""
    from fxpass.testing.redis_server import RedisServer

    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "repeats": repeats,
                           "loadavg_start": os.getloadavg(), "tokens": tokens}
    res: dict[str, list] = {}
    with RedisServer() as server, tempfile.TemporaryDirectory(prefix="fxpass-remote-") as tmp:
        client = server.client()
        for rep in range(repeats):
            r = remote_round(tokens, Path(tmp), server.url, client)
            for k, v in r.items():
                res.setdefault(k, []).append(v)
            print(f"[compile_time --remote] {rep + 1}/{repeats}: {json.dumps(r)}",
                  file=sys.stderr)
    out["loadavg_end"] = os.getloadavg()
    # a warm sample that compiled saw another key: the source changed between the processes
    # (the key covers it; an editable install edited meanwhile). Its median would measure a
    # cold compile, so such rounds are left out of the medians and counted.
    expect = {"local warm": "local hit", "remote warm": "remote hit"}
    expect |= {"precompile: " + k: v for k, v in expect.items()}
    entries = {"precompile: cold": ["traced"], "precompile: local warm": ["local_hit"],
               "precompile: remote warm": ["remote_hit"]}
    valid = [i for i in range(repeats)
             if all(set(res[k][i].get("sources", [])) == {v} for k, v in expect.items())
             and all(res[k][i].get("entry") == v for k, v in entries.items())]
    out["rounds_left_out"] = repeats - len(valid)
    out["cases"] = {k: {"samples": v, "first_call_s": _median([v[i] for i in valid],
                                                              "first_call_s"),
                        "backend_s": _median([v[i] for i in valid], "backend_s")}
                    for k, v in res.items()}
    warm = [res["remote warm"][i] for i in valid] or [{}]
    out["published_bytes"] = _median(warm, "published_bytes")
    out["published_bytes_precompile"] = _median(
        [res["precompile: remote warm"][i] for i in valid] or [{}], "published_bytes")
    out["weights_bytes"] = _median(warm, "weights_bytes")
    out["markdown"] = remote_markdown(out)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "compile_time-remote.json").write_text(json.dumps(out, indent=1) + "\n")
    (OUT / "compile_time-remote.md").write_text(out["markdown"] + "\n")
    return out


def remote_markdown(out: dict) -> str:
    c = out["cases"]

    def g(k: str, f: str = "first_call_s") -> float | None:
        return c.get(k, {}).get(f)

    rows = [
        f"Qwen3 4 x 512, {out['tokens']} token(s), fp32; run {out['date']}, median of "
        f"{out['repeats']} fresh processes per cell, interleaved; load average at start "
        f"{tuple(round(x, 1) for x in out['loadavg_start'])}; rounds left out (a warm process "
        f"saw another key: source edited mid-run): {out['rounds_left_out']}.",
        "",
        "| process | first call s | backend s | regions from |",
        "|---|---|---|---|",
    ]
    for pre in ("", "precompile: "):
        for k in ("cold", "local warm", "cold, publishing", "remote warm"):
            k = pre + k
            src = ", ".join(sorted({x for smp in c.get(k, {}).get("samples", [])
                                    for x in smp.get("sources", [])}))
            label = k.replace("precompile: ", "fxpass.precompile, ") if pre else (
                "torch.compile, " + k)
            rows.append(f"| {label} | {_f(g(k))} | {_f(g(k, 'backend_s'))} | {src} |")
    cold = g("cold")
    rows.append("")
    for pre, what in (("", "torch.compile"), ("precompile: ", "fxpass.precompile")):
        rw, lw = g(pre + "remote warm"), g(pre + "local warm")
        rows += [
            f"- {what}: remote warm / local warm, first call: {_ratio(rw, lw)} (bar <= 1.2x); "
            f"remote warm / cold torch.compile: {_ratio(rw, cold)} (bar <= 0.3x)",
        ]
    rows += [
        f"- the fleet's store holds {(out['published_bytes'] or 0) / 1e3:.0f} kB for the model "
        f"under torch.compile (models and plan), "
        f"{(out.get('published_bytes_precompile') or 0) / 1e3:.0f} kB with the precompiled "
        f"entry; the weights ({(out['weights_bytes'] or 0) / 1e6:.0f} MB) stay with each "
        "client",
    ]
    return "\n".join(rows)


def _f(x: float | None) -> str:
    return f"{x:.2f}" if x is not None else "n/a"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


# -- cProfile of the backend's own time ----------------------------------------------------------

STEPS = [  # (label, path substring, function name) of a pstats entry
    ("plan key (graph + weight digests)", "bpu/plan.py", "key_for"),
    ("plan load (artifacts, ORT sessions, graph)", "bpu/plan.py", "apply"),
    ("  of which ORT session", "bpu/host/ort.py", "__init__"),
    ("  of which cache read + verify", "bpu/cache.py", "_verified"),
    ("tool versions (imports onnxruntime; in the keys)", "bpu/cache.py", "tool_versions"),
    ("rules (pass manager)", "fxpass/passmanager.py", "run"),
    ("  of which bf16_promotion", "rules/bf16_promotion.py", "bf16_promotion"),
    ("partition", "bpu/device/partition.py", "partition"),
    ("extract regions", "bpu/device/region.py", "extract"),
    ("region key (weight digests)", "bpu/cache.py", "region_key"),
    ("lower to ONNX", "bpu/device/lowering/driver.py", "lower"),
    ("host fusions (onnxscript)", "bpu/host/prepare.py", "fuse_for_ort"),
    # on a worker thread where the region prepacks (cProfile sees only the wait for it)
    ("weights file (external data)", "lowering/driver.py", "write_weights_file"),
    ("cache write", "bpu/cache.py", "put"),
    ("plan store", "bpu/plan.py", "store"),
    ("splice", "bpu/device/region.py", "splice"),
    ("recompile (FX codegen)", "fx/graph_module.py", "recompile"),
]


def profile_table(path: str) -> list[tuple[str, float]]:
    """(step, cumulative seconds) of the backend's own time, from a cProfile dump."""
    import pstats

    st = pstats.Stats(path)
    total = max(v[3] for v in st.stats.values())  # the wrapper's cumulative time
    rows = [("backend total (compile_graph)", total)]
    for label, sub, fn in STEPS:
        cum = sum(v[3] for (f, _, name), v in st.stats.items() if name == fn and sub in f)
        if cum:
            rows.append((label, cum))
    return rows


def profile(tokens: int, dtype: str = "float32") -> dict[str, Any]:
    """cProfile of one cold and one warm process (Qwen3 4 x 1024); written to
    ``compile_profile.json`` (1 token, float32) or ``compile_profile-t<tokens>-<dtype>.json``."""
    res: dict[str, Any] = {"tokens": tokens, "dtype": dtype}
    with tempfile.TemporaryDirectory(prefix="fxpass-profile-") as tmp:
        spec = {"model": "qwen3", "dtype": dtype, "tokens": tokens, "backend": "fxpass_bpu"}
        env = {"FXPASS_CACHE_DIR": str(Path(tmp) / "cache")}
        for state in ("cold", "warm"):
            prof = str(Path(tmp) / f"{state}.prof")
            r = child({**spec, "profile": prof}, env)
            res[state] = {"result": r, "steps": profile_table(prof) if "error" not in r else []}
            print(f"[profile] {state}: {r}", file=sys.stderr)
    OUT.mkdir(parents=True, exist_ok=True)
    lines = ["| step | cold s | warm s |", "|---|---|---|"]
    cold, warm = dict(res["cold"]["steps"]), dict(res["warm"]["steps"])
    for label in dict.fromkeys([*cold, *warm]):
        c, w = cold.get(label), warm.get(label)
        lines.append(f"| {label} | {c:.3f} |" if c is not None else f"| {label} | |")
        lines[-1] += f" {w:.3f} |" if w is not None else " |"
    res["markdown"] = "\n".join(lines)
    stem = "compile_profile" + ("" if (tokens, dtype) == (1, "float32") else f"-t{tokens}-{dtype}")
    (OUT / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    print(res["markdown"])
    return res


def hash_speed(mb: int = 64, repeats: int = 5) -> dict[str, float]:
    """GB/s of each candidate hash over a ``mb`` MB float32 tensor, through a memoryview."""
    import hashlib
    import zlib

    import torch

    t = torch.randn(mb * 1024 * 1024 // 4)
    mv = memoryview(t.numpy()).cast("B")
    cands = {
        "blake2b": lambda: hashlib.blake2b(mv, digest_size=16).digest(),
        "blake2b over tobytes (old key)": lambda: hashlib.blake2b(t.numpy().tobytes()).digest(),
        "sha1": lambda: hashlib.sha1(mv).digest(),
        "sha256": lambda: hashlib.sha256(mv).digest(),
        "crc32": lambda: zlib.crc32(mv),
    }
    try:
        import xxhash

        cands["xxh3_128"] = lambda: xxhash.xxh3_128(mv).digest()
        cands["xxh64"] = lambda: xxhash.xxh64(mv).digest()
    except ImportError:
        pass
    out = {}
    for name, fn in cands.items():
        ts = []
        for _ in range(repeats):
            a = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - a)
        out[name] = mb / 1024 / statistics.median(ts)
        print(f"{name:32s} {out[name]:.2f} GB/s")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", default="1", help="comma-separated, e.g. 1,128")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated of {list(MODELS)}")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="--profile only (the matrix takes its dtypes from --models)")
    ap.add_argument("--hash", action="store_true")
    ap.add_argument("--remote", action="store_true",
                    help="Qwen3 4x512: cold, local warm, and a fresh process on a warm Redis")
    ap.add_argument("--tag", default="", help="write compile_time-<tag>.{json,md}")
    a = ap.parse_args(argv)
    global TAG
    TAG = a.tag
    if a.hash:
        hash_speed()
        return
    if a.remote:
        print(remote_run(a.repeats, int(a.tokens.split(",")[0]))["markdown"])
        return
    tokens = [int(t) for t in a.tokens.split(",")]
    if a.profile:
        profile(tokens[0], a.dtype)
        return
    models = [m.strip() for m in a.models.split(",")]
    cases = [(m, t) for t in tokens for m in models]
    out = run(cases, a.repeats)
    print(markdown(out))


if __name__ == "__main__":
    main()
