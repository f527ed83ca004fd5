"""A host region right after eager torch ops: what torch's spinning OpenMP workers cost it.

    python -m benchmarks.probes.omp_spin [--samples 40]

After every parallel op, torch's OpenMP workers (libgomp) keep spinning for milliseconds
before they sleep; a region that starts then runs onnxruntime's pool on cores they hold.
fxpass keeps its own graphs' torch ops on one thread (``jit.runtime.TorchThreads``) and HF's
loop between decode steps too (``compile_for_generate(loop_threads=1)``), but not the caller's
code. libgomp reads its wait policy once, when torch loads it, so each policy is a fresh
process: ``OMP_WAIT_POLICY`` unset (libgomp's default: spin) and ``PASSIVE`` (sleep at once).

Case: a stock BERT (4 layers x 256, random weights), batch 4 x 64 tokens with a padded row,
under ``torch.compile(backend="fxpass_ort")``. Timed, medians of ``--samples``: the compiled
call in a block of its own calls; right after one eager forward of the same model (untimed);
right after one 512 x 512 matmul (untimed); the eager forward in a block of its own.
Writes ``benchmarks/probes/results/omp_spin.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.probes import save

ROOT = Path(__file__).resolve().parents[2]
MARK = "FXPASS_OMP_SPIN "
POLICIES = ("unset", "PASSIVE")


def measure(samples: int) -> dict[str, float]:
    """The four timings of the module docstring, in this process (ms)."""
    import copy
    import warnings

    import torch

    from fxpass.backends.bpu import settle
    from fxpass.tools import zoo

    warnings.filterwarnings("ignore")
    model = zoo.get("bert", layers=4, hidden=256, heads=4, tokens=8)[0].eval()
    compiled = torch.compile(copy.deepcopy(model), backend="fxpass_ort", dynamic=False)
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 64, dtype=torch.long)
    mask[-1, 32:] = 0
    x = {"input_ids": torch.randint(0, 500, (4, 64), generator=g), "attention_mask": mask}
    a, b = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)

    def eager() -> None:
        model(**x)

    def matmul() -> None:
        a @ b

    def fx() -> None:
        compiled(**x)

    def timed(fn, before=None) -> float:
        out = []
        for _ in range(samples):
            if before is None:
                fn()  # the block's call before this one
            else:
                time.sleep(0.02)  # every worker asleep
                before()
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        return statistics.median(out)

    with torch.no_grad():
        for _ in range(3):
            fx()
            eager()
        settle()
        return {"fx_alone_ms": timed(fx), "fx_after_eager_ms": timed(fx, eager),
                "fx_after_matmul_ms": timed(fx, matmul), "eager_alone_ms": timed(eager)}


def run(samples: int) -> dict:
    rows = []
    for policy in POLICIES:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("OMP_WAIT_POLICY", None)
        if policy != "unset":
            env["OMP_WAIT_POLICY"] = policy
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.probes.omp_spin", "--child", str(samples)],
            env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout
        line = next(ln for ln in out.splitlines() if ln.startswith(MARK))
        rows.append({"OMP_WAIT_POLICY": policy, **json.loads(line[len(MARK):])})
    return {"case": "bert 4x256, batch 4 x 64, fxpass_ort", "samples": samples, "rows": rows}


def markdown(r: dict) -> str:
    head = ("| OMP_WAIT_POLICY | compiled alone ms | right after an eager forward ms | right "
            "after one matmul ms | eager alone ms | compiled / eager (alone) |\n"
            "|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {w['OMP_WAIT_POLICY']} | {w['fx_alone_ms']:.2f} | {w['fx_after_eager_ms']:.2f} | "
        f"{w['fx_after_matmul_ms']:.2f} | {w['eager_alone_ms']:.2f} | "
        f"{w['fx_alone_ms'] / w['eager_alone_ms']:.2f}x |\n" for w in r["rows"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(MARK + json.dumps(measure(args.child)), flush=True)
        return
    r = run(args.samples)
    save("omp_spin", r, markdown(r))


if __name__ == "__main__":
    main()
