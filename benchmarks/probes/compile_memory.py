"""Peak resident memory while ``torch.compile(backend="fxpass_bpu")`` compiles, against the weights.

Each measurement runs in a fresh process with an empty artifact cache (``FXPASS_CACHE_DIR`` in
a new temp dir): build the model (random weights, ``fxpass.tools.zoo``), run one eager
forward, then reset the kernel's peak-RSS mark (``/proc/self/clear_refs`` = 5) and read the
baseline ``VmRSS``. Compile and make the first call, wait for any tiered region's
background build (``fxpass.backends.bpu.settle``) and make a second call, then read ``VmHWM``
(peak RSS since the reset). Reported: ``(peak - baseline) / weights`` and
``(after - baseline) / weights``, where ``weights`` is the bytes of every parameter and
buffer of the model. Linux only.

``--baseline-rev REV`` measures the same thing with the code of an earlier commit, from a
temporary ``git worktree`` put first on ``PYTHONPATH`` (the working tree is not touched), so
"before" and "after" come from one run, side by side. ``--untiered`` adds the current code
with ``tiered=False`` (host regions build their prepacked session before the first call).

    python -m benchmarks.probes.compile_memory [--model qwen3-4l-1024] [--dtypes fp32 bf16]
        [--baseline-rev 5716ab2] [--repeat 1] [--out benchmarks/probes/results/compile_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MARK = "FXPASS_COMPILE_MEMORY "
DTYPES = ("fp32", "bf16")


#: the child's tiered option (``--untiered``): "off" compiles with tiered=False
TIER_ENV = "FXPASS_MEM_TIERED"
UNTIERED = {"off": {"tiered": False}}

def _status(field: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}: Linux only")


def child(model_name: str, dtype_name: str, tokens: int) -> dict[str, Any]:
    """Measure in this process (a fresh one): returns the numbers as a dict."""
    import torch

    import fxpass
    from fxpass.tools import zoo

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    torch.manual_seed(0)
    model, kwargs = zoo.get(model_name, tokens=tokens, dtype=dtype)
    model.eval()
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    with torch.no_grad():
        expected = model(**kwargs).logits
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    base = _status("VmRSS")
    t0 = time.perf_counter()
    with torch.no_grad():
        opts = {"strict": True, **UNTIERED.get(os.environ.get(TIER_ENV, ""), {})}
        compiled = torch.compile(model, backend="fxpass_bpu", options=opts)
        got = compiled(**kwargs).logits
        seconds = time.perf_counter() - t0
        try:  # a tiered region builds its prepacked session after the call: count it too
            from fxpass.backends.bpu import settle
        except ImportError:  # a baseline revision from before tiering
            settle = None
        if settle is not None:
            settle()
        compiled(**kwargs)  # (both revisions) the call that switches to the second tier
    peak, after = _status("VmHWM"), _status("VmRSS")
    err = (got.float() - expected.float()).abs().max().item()
    report = fxpass.compile_reports()[-1]
    return {
        "model": model_name,
        "dtype": dtype_name,
        "fxpass": str(Path(fxpass.__file__).resolve().parents[1]),
        "weights_mb": weights / 2**20,
        "baseline_mb": base / 2**20,
        "peak_delta_mb": (peak - base) / 2**20,
        "after_delta_mb": (after - base) / 2**20,
        "peak_x_weights": (peak - base) / weights,
        "after_x_weights": (after - base) / weights,
        "compile_s": seconds,
        "max_abs_err": err,
        "regions": len(report.regions),
    }


def _run(model: str, dtype: str, tokens: int, src: Path | None, tiered: bool = True
         ) -> dict[str, Any]:
    env = dict(os.environ)
    env[TIER_ENV] = "on" if tiered else "off"
    with tempfile.TemporaryDirectory(prefix="fxpass-mem-cache-") as cache:
        env["FXPASS_CACHE_DIR"] = cache
        if src is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", model, dtype, str(tokens)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(MARK)]
    if out.returncode or not lines:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK) :])


def _worktree(rev: str, where: Path) -> Path:
    """``rev`` checked out at ``where``, importable as ``fxpass`` (rules/backends linked in)."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev],
        check=True,
        capture_output=True,
    )
    (where / "fxpass" / "rules").symlink_to(where / "rules")
    (where / "fxpass" / "backends").symlink_to(where / "backends")
    return where


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-4l-1024")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--baseline-rev", default=None, help="also measure this commit (before)")
    p.add_argument("--repeat", type=int, default=1, help="runs per cell; the median is kept")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--untiered", action="store_true",
                   help="also measure the current code with tiered=False")
    p.add_argument("--child", nargs=3, metavar=("MODEL", "DTYPE", "TOKENS"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(MARK + json.dumps(child(a.child[0], a.child[1], int(a.child[2]))), flush=True)
        return
    tmp = tempfile.TemporaryDirectory(prefix="fxpass-mem-rev-")
    sources: dict[str, tuple[Path | None, bool]] = {"current": (None, True)}
    if a.untiered:
        sources["untiered"] = (None, False)
    if a.baseline_rev:
        sources = {a.baseline_rev: (_worktree(a.baseline_rev, Path(tmp.name) / "src"), True),
                   **sources}
    rows = []
    try:
        for dtype in a.dtypes:
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in sources}
            for _ in range(a.repeat):  # interleaved: before, after, before, after, ...
                for label, (src, tiered) in sources.items():
                    runs[label].append(_run(a.model, dtype, a.tokens, src, tiered))
            for label, rs in runs.items():
                row = dict(rs[0], code=label)
                for k in ("peak_delta_mb", "after_delta_mb", "peak_x_weights"):
                    row[k] = statistics.median(r[k] for r in rs)
                row["after_x_weights"] = statistics.median(r["after_x_weights"] for r in rs)
                row["compile_s"] = statistics.median(r["compile_s"] for r in rs)
                rows.append(row)
                print(
                    f"{label:>10} {dtype}: weights {row['weights_mb']:.0f} MiB, peak +"
                    f"{row['peak_delta_mb']:.0f} MiB ({row['peak_x_weights']:.2f}x), after +"
                    f"{row['after_delta_mb']:.0f} MiB ({row['after_x_weights']:.2f}x), compile "
                    f"{row['compile_s']:.1f} s, err {row['max_abs_err']:.2g}, "
                    f"{row['regions']} region(s), from {row['fxpass']}",
                    flush=True,
                )
    finally:
        if a.baseline_rev:
            subprocess.run(
                [
                    "git",
                    "-C",
                    str(ROOT),
                    "worktree",
                    "remove",
                    "--force",
                    str(Path(tmp.name) / "src"),
                ],
                check=False,
                capture_output=True,
            )
        tmp.cleanup()
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
