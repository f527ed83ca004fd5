"""Where a fxpass_bpu forward's time goes, next to whole-model onnxruntime.

    python -m benchmarks.probes.forward_split [--model qwen3-4l-1024] [--tokens 1,128] \
        [--repeats 20]

Why this exists: issue 8 asks the fxpass_bpu forward to reach whole-model onnxruntime, and
``benchmarks.models`` measures it 5-16% behind. A whole call cannot say whether the region or
the host around it is slower. Five contenders, timed side by side in one process
(``harness.interleave``: rotating order, each sample after a settle):

- ``fxpass_bpu``: the compiled model, called as a user calls it;
- ``caller_threads``: the same, compiled with ``cpu_threads`` set to torch's thread count:
  the graph's torch ops on every thread, as before the backend ran light ones on one
  (``runtime.TorchThreads``), an A/B of that choice;
- ``region``: the graph's one device region's executor on the inputs captured from such a
  call (the onnxruntime run plus fxpass's zero-copy conversions);
- ``around``: the same compiled call with that region replaying its captured outputs:
  Dynamo's guards, AOTAutograd's wrapper, the weight guard, the graph's CPU ops and the
  region's own checks, all on warm caches;
- ``onnxruntime``: the whole model exported (``contenders.onnx_session``) and run.

``fxpass - region - around`` is what running the host code right after the region costs
beyond running it warm: the caches the region's weights evicted. The outputs are checked
against eager first. Writes ``benchmarks/probes/results/forward_split.{json,md}``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.contenders import Result, check, onnx_session
from benchmarks.models import Case

RESULTS = Path(__file__).parent / "results"


def split(model: str, tokens: int, repeats: int) -> dict[str, Any]:
    """Time the four contenders on ``model`` at ``tokens`` tokens (fp32, batch 1)."""
    import fxpass.jit.runtime as rt

    torch._dynamo.reset()
    wrapped, inputs = Case(model, "fp32", tokens).build()
    with torch.no_grad():
        expected = wrapped(*inputs)
        compiled = torch.compile(wrapped, backend="fxpass_bpu", dynamic=False,
                                 options={"cache": False})
        got = compiled(*inputs)
        # the A/B: torch's ops on the caller's thread count, as before cpu_threads existed
        threads = torch.get_num_threads()
        caller_threads = torch.compile(wrapped, backend="fxpass_bpu", dynamic=False,
                                       options={"cache": False, "cpu_threads": threads})
        caller_threads(*inputs)
    seen: list[tuple[Any, tuple, tuple]] = []
    replay = [False]
    real = rt.RegionCall.forward

    def recording(self: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if replay[0]:
            return seen[0][2]
        outs = real(self, *tensors)
        if len(seen) < 2:
            seen.append((self, tensors, outs))
        return outs

    rt.RegionCall.forward = recording
    try:
        with torch.no_grad():
            compiled(*inputs)
        if len(seen) != 1:
            raise RuntimeError(f"expected one region per call, saw {len(seen)}")
        region, tensors, _ = seen[0]

        def around() -> Any:
            replay[0] = True
            try:
                return compiled(*inputs)
            finally:
                replay[0] = False

        with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
            res = Result("onnxruntime")
            ort_run, _, ort_out = onnx_session(wrapped, inputs, tmp, res)
            checks = {"fxpass_bpu": check(expected, got), "onnxruntime": check(expected, ort_out)}
            stats = harness.interleave(
                {
                    "fxpass_bpu": lambda: compiled(*inputs),
                    "caller_threads": lambda: caller_threads(*inputs),
                    "region": lambda: region.executor(*tensors),
                    "around": around,
                    "onnxruntime": ort_run,
                },
                repeats=repeats, budget_s=30.0,
            )
    finally:
        rt.RegionCall.forward = real
    ms = {k: s.median * 1e3 for k, s in stats.items()}
    return {
        "model": model, "tokens": tokens, "exporter": res.extra.get("exporter"),
        "torch_threads": threads,
        "checks": checks, "stats": {k: s.to_dict() for k, s in stats.items()}, "ms": ms,
        "cache_refill_ms": ms["fxpass_bpu"] - ms["region"] - ms["around"],
    }


def to_markdown(rows: list[dict[str, Any]]) -> str:
    cols = ["case", "fxpass_bpu ms", "torch ops on N threads ms", "region ms",
            "around ms (warm)", "cache refill ms",
            "whole-model onnxruntime ms", "fxpass / onnxruntime", "region / onnxruntime",
            "rel err fxpass / ort"]
    table = []
    for r in rows:
        m = r["ms"]
        table.append({
            "case": f"{r['model']} fp32 t={r['tokens']}",
            "fxpass_bpu ms": f"{m['fxpass_bpu']:.2f}",
            "torch ops on N threads ms": f"{m['caller_threads']:.2f} (N={r['torch_threads']})",
            "region ms": f"{m['region']:.2f}",
            "around ms (warm)": f"{m['around']:.2f}",
            "cache refill ms": f"{r['cache_refill_ms']:.2f}",
            "whole-model onnxruntime ms": f"{m['onnxruntime']:.2f}",
            "fxpass / onnxruntime": f"{m['fxpass_bpu'] / m['onnxruntime']:.2f}x",
            "region / onnxruntime": f"{m['region'] / m['onnxruntime']:.2f}x",
            "rel err fxpass / ort": " / ".join(
                f"{r['checks'][k].get('rel_err', float('nan')):.1e}"
                for k in ("fxpass_bpu", "onnxruntime")),
        })
    return harness.markdown_table(table, cols)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-4l-1024")
    ap.add_argument("--tokens", default="1,128")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--stem", default="forward_split")
    args = ap.parse_args(argv)
    rows = [split(args.model, int(t), args.repeats) for t in args.tokens.split(",")]
    data = {"env": harness.environment(), "runs": rows}
    harness.write_results(RESULTS, args.stem, data, to_markdown(rows))


if __name__ == "__main__":
    main()
