"""A host region's second run against its later ones, with onnxruntime's memory pattern on and
off: what ``host.ort.MEMORY_PATTERN = False`` buys.

    python -m benchmarks.probes.second_run [--rounds 3]

Why this exists: under plain ``torch.compile`` a model served at a few shapes compiles one
variant per shape on its first pass, and its second pass ran 1.08-1.10x its steady one
(``benchmarks.second_pass``) with no background build left. Timing each executor's runs
showed where: the second run of every session was the slow one. With the memory pattern on,
onnxruntime records a session's allocations on its first run and allocates the planned block
on its second, fresh pages that the kernels then fault in.

Per round and setting (alternating, in one process; the setting is read when a session
opens): ELECTRA 4 x 512 compiled fresh with ``fxpass_ort`` (empty artifact cache) and served
the 6 shapes of ``benchmarks.second_pass`` for 6 passes, each region run timed; then a Qwen3
4 x 512 package (``ort``, fp32) exported and loaded fresh, its decode ms/token over 64 new
tokens (``(t(1 + N) - t(1)) / N``, median of 7). Reported: each region's second run over the
median of its runs 3-6 (median over regions), the second pass over the median of passes 3-6,
and the decode step; medians over ``--rounds``. Writes
``benchmarks/probes/results/second_run.{json,md}``.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness

RESULTS = Path(__file__).parent / "results"
SETTINGS = {"pattern on": True, "pattern off (fxpass)": False}


def _encoder_passes() -> dict[str, float]:
    from benchmarks.second_pass import _encoder, _inputs
    from benchmarks.shapes import _first
    from fxpass.backends.onnx.host import ort as host

    runs: dict[int, list[float]] = collections.defaultdict(list)
    call = host.OrtExecutor.__call__

    def timed(self: Any, *a: Any) -> Any:
        t = time.perf_counter()
        try:
            return call(self, *a)
        finally:
            runs[id(self)].append(time.perf_counter() - t)

    torch._dynamo.reset()
    os.environ["FXPASS_CACHE_DIR"] = tempfile.mkdtemp(prefix="fxpass-second-run-")
    model, inputs = _encoder("electra"), _inputs("electra")
    compiled = torch.compile(model, backend="fxpass_ort")
    passes = []
    host.OrtExecutor.__call__ = timed
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(6):
                t = time.perf_counter()
                for kw in inputs:
                    _first(compiled(**kw))
                passes.append(time.perf_counter() - t)
    finally:
        host.OrtExecutor.__call__ = call
    ratios = [r[1] / statistics.median(r[2:]) for r in runs.values() if len(r) >= 6]
    return {"second_run_vs_later": statistics.median(ratios),
            "second_pass_vs_later": passes[1] / statistics.median(passes[2:]),
            "later_pass_ms": statistics.median(passes[2:]) * 1e3}


def _decode_ms() -> float:
    from benchmarks.generate import _build
    from fxpass.aot.export import export_for_generate
    from fxpass.aot.package import load

    model, ids = _build("qwen3-4x512")
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_for_generate(model, max_cache_len=160, prefill_length=32,
                            device="ort").save(d + "/pkg")
        runner = load(d + "/pkg")
        times = harness.decode_ms_per_token({"package": lambda n: runner.generate(
            ids, max_new_tokens=n, eos_token_id=[])}, [64], repeats=7)[0]
    return times["package"][64]


def main(argv: list[str] | None = None) -> None:
    from fxpass.backends.onnx.host import ort as host

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    got: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, on in SETTINGS.items():
            host.MEMORY_PATTERN = on
            got[name].append({**_encoder_passes(), "decode_ms": _decode_ms()})
    host.MEMORY_PATTERN = False
    rows = [{"setting": name, **{k: statistics.median(r[k] for r in rs) for k in rs[0]}}
            for name, rs in got.items()]

    def table(res: dict[str, Any]) -> str:
        cells = [{
            "setting": r["setting"],
            "region 2nd run / later": f"{r['second_run_vs_later']:.3f}x",
            "ELECTRA 2nd pass / later": f"{r['second_pass_vs_later']:.3f}x",
            "ELECTRA later pass ms": f"{r['later_pass_ms']:.1f}",
            "Qwen3 4x512 package decode ms/token": f"{r['decode_ms']:.3f}",
        } for r in res["rows"]]
        return harness.markdown_table(cells, list(cells[0]))

    harness.publish(args.out, "second_run", {"rows": rows, "rounds": args.rounds}, table)


if __name__ == "__main__":
    main()
