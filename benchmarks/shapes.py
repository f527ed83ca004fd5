"""Variable input shapes: eager, inductor and fxpass_bpu (with and without buckets), side by
side in one run.

``python -m benchmarks.shapes [--quick] [--memory-lengths 200]``

- ``bert``: a stock BERT (4 layers x 256, random weights), 16 sequence lengths from 8 to 128,
  the batch size cycling through 1-4, a padded row in every batch of two or more;
- ``convnet``: a stock transformers ResNet (four stages), 6 image sizes, batch 1-4.

Per contender: the first pass over all inputs (compiles included) and the warm pass: five
rounds, each an eager pass then the contender's (each after 0.2 s of untimed passes), so
``warm vs eager`` is the median of five ratios of passes taken side by side; Dynamo graphs,
fxpass variants compiled, recompile warnings, whether every output equals eager's (rtol =
atol = 1e-4), and ``work``: the tokens computed over the tokens given (what padding adds).
``fxpass`` is the default bound of 8 variants, ``fxpass-exact`` a bound as large as the
inputs (every shape compiled once, none padded: the executor's own speed). BERT only:
``fxpass-buckets`` is ``compile_for_encoder`` with ``{"seq": [32, 64, 96, 128], "batch":
[4]}`` (every batch padded to 4 rows), ``fxpass-rows`` the same lengths with ``"batch": [1]``
(each row run alone); 4 variants each. ``fxpass-buckets-124`` pads each batch to the next of
1, 2 or 4 rows (12 variants): fewer padded rows for three times the variants.
Memory: resident set size over ``--memory-lengths`` distinct lengths without buckets, sampled
every 20 calls, lengths in a seeded random order. Inductor's and fxpass's caches start empty
(a temporary directory each).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
TOL = {"rtol": 1e-4, "atol": 1e-4}
LENGTHS = [8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128]
SIZES = [64, 96, 128, 160, 192, 224]
# at most 4 variants for the 16 BERT inputs: pad every batch to 4 rows, or run each row alone;
# at most 12: pad each batch to the next of 1, 2 or 4 rows
SPECS = {
    "fxpass-buckets": {"seq": [32, 64, 96, 128], "batch": [4]},
    "fxpass-rows": {"seq": [32, 64, 96, 128], "batch": [1]},
    "fxpass-buckets-124": {"seq": [32, 64, 96, 128], "batch": [1, 2, 4]},
}


def _bert() -> torch.nn.Module:
    from fxpass.tools import zoo

    return zoo.get("bert", layers=4, hidden=256, heads=4, tokens=8)[0]


def _bert_inputs(i: int, n: int) -> dict[str, torch.Tensor]:
    b = 1 + i % 4
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, 500, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    if b > 1:
        mask[-1, n // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _convnet() -> torch.nn.Module:
    import transformers

    cfg = transformers.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256],
                                    depths=[1, 1, 1, 1], layer_type="basic")
    torch.manual_seed(0)
    return transformers.ResNetModel(cfg).eval()


def _conv_inputs(i: int, s: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"pixel_values": torch.randn(1 + i % 4, 3, s, s, generator=g)}


def _first(out: Any) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


#: warm passes per contender, each right after a pass of the eager model (paired ratios)
WARM_ROUNDS = 5


def _pass_s(fn: Any, inputs: list[dict]) -> float:
    """One pass over ``inputs``, timed after 0.2 s of untimed passes (``harness.interleave``'s
    re-warm: the other contender's threads stop spinning, this one's caches refill)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.2:
        for kw in inputs:
            fn(**kw)
    t0 = time.perf_counter()
    for kw in inputs:
        fn(**kw)
    return time.perf_counter() - t0


def _contender(name: str, make: Any, inputs: list[dict], refs: list[torch.Tensor],
               eager: Any) -> dict:
    from torch._dynamo.utils import counters

    from fxpass.backends.bpu import settle
    from fxpass.jit.backend import STATS

    torch._dynamo.reset()
    graphs0, variants0 = counters["stats"]["unique_graphs"], STATS["shape_variants"]
    fn = make()
    with torch.no_grad(), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        outs = [_first(fn(**kw)) for kw in inputs]
        first = time.perf_counter() - t0
        settle()  # the warm pass is steady state: no second-tier session still being built
        # each round: an eager pass, then this contender's, so every ratio is of two passes
        # taken side by side (this machine's speed drifts by more than the ratios differ)
        rounds = [(_pass_s(eager, inputs), _pass_s(fn, inputs)) for _ in range(WARM_ROUNDS)]
    equal = all(torch.allclose(a, e, **TOL) for a, e in zip(outs, refs, strict=True))
    return {
        "contender": name, "first_pass_s": first,
        "warm_pass_s": statistics.median(t for _, t in rounds),
        "warm_vs_eager": statistics.median(t / e for e, t in rounds),
        "dynamo_graphs": counters["stats"]["unique_graphs"] - graphs0,
        "fxpass_variants": STATS["shape_variants"] - variants0,
        "recompile_warnings": sum("recompile" in str(x.message).lower() for x in w),
        "equal_eager": equal,
    }


def run_case(case: str) -> dict:
    from fxpass.hf.encoders import compile_for_encoder

    if case == "bert":
        base, inputs = _bert, [_bert_inputs(i, n) for i, n in enumerate(LENGTHS)]
    else:
        base, inputs = _convnet, [_conv_inputs(i, s) for i, s in enumerate(SIZES)]
    eager = base()
    with torch.no_grad():
        refs = [_first(eager(**kw)) for kw in inputs]
    makers = {
        "eager": lambda: eager,
        "inductor": lambda: torch.compile(base(), backend="inductor"),
        "fxpass": lambda: torch.compile(base(), backend="fxpass_bpu"),
    }
    makers["fxpass-exact"] = lambda: torch.compile(
        base(), backend="fxpass_bpu", options={"max_shape_variants": len(inputs)})
    if case == "bert":
        for name, spec in SPECS.items():
            makers[name] = lambda spec=spec: compile_for_encoder(base(), buckets=spec, device="bpu")
    rows = []
    for name, make in makers.items():
        print(f"[shapes] {case} {name} ...", file=sys.stderr, flush=True)
        rows.append(_contender(name, make, inputs, refs, eager))
        rows[-1]["work"] = _work(SPECS.get(name), inputs) if case == "bert" else 1.0
    return {"case": case, "inputs": len(inputs), "rows": rows}


def _work(spec: dict | None, inputs: list[dict]) -> float:
    """Tokens computed over tokens given: what bucket padding adds (1.0 without buckets).
    Counted through ``by_rows`` and ``pad_inputs`` themselves, so it is what the runs do."""
    from fxpass.hf.encoders import by_rows, pad_inputs

    if spec is None:
        return 1.0
    padded: list[int] = []
    for kw in inputs:
        by_rows(lambda kw: padded.append(pad_inputs(kw, spec, 0)[0]["input_ids"].numel()),
                kw, spec)
    return sum(padded) / sum(kw["input_ids"].numel() for kw in inputs)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def memory(lengths: int) -> dict:
    """RSS over ``lengths`` distinct lengths through plain fxpass_bpu (no buckets).

    The lengths come in a seeded random order, as a server sees them. In ascending order the
    8 variants kept are the 8 longest so far, whose sessions grow with the length: RSS would
    climb with what is kept, not with what was evicted."""
    import random

    torch._dynamo.reset()
    c = torch.compile(_bert(), backend="fxpass_bpu")
    samples = []
    order = random.Random(0).sample(range(8, 8 + lengths), lengths)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, n in enumerate(order):
            c(**_bert_inputs(0, n))  # batch 1, a new length every call
            if i % 20 == 19:
                gc.collect()
                samples.append((i + 1, _rss_mb()))
    return {"lengths": lengths, "rss_mb": samples}


def to_markdown(data: dict[str, Any]) -> str:
    parts = []
    for c in data["cases"]:
        ind = next(r for r in c["rows"] if r["contender"] == "inductor")
        rows = [{
            "case": c["case"], "contender": r["contender"],
            "first pass s": f"{r['first_pass_s']:.1f}",
            "first vs inductor": f"{r['first_pass_s'] / ind['first_pass_s']:.2f}x",
            "warm pass ms": f"{r['warm_pass_s'] * 1e3:.0f}",
            "warm vs eager": f"{r['warm_vs_eager']:.2f}x",
            "Dynamo graphs": r["dynamo_graphs"], "fxpass variants": r["fxpass_variants"],
            "recompile warnings": r["recompile_warnings"], "equal eager": r["equal_eager"],
            "work": f"{r.get('work', 1.0):.2f}x",
        } for r in c["rows"]]
        parts.append(harness.markdown_table(rows, list(rows[0])))
    if data.get("memory"):
        m = data["memory"]
        rows = [{"distinct lengths": n, "RSS MB": f"{mb:.0f}"} for n, mb in m["rss_mb"]]
        parts.append(harness.markdown_table(rows, ["distinct lengths", "RSS MB"]))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    import os
    import tempfile

    # first passes compare compiles: cold caches for both compilers, or a previous run's
    # inductor FX-graph cache and fxpass plan cache would make them warm
    cold = tempfile.mkdtemp(prefix="fxpass-shapes-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cold, "inductor")
    os.environ["FXPASS_CACHE_DIR"] = os.path.join(cold, "fxpass")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="bert only, no memory run")
    ap.add_argument("--memory-lengths", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    data: dict[str, Any] = {"env": harness.environment(), "cases": []}
    for case in (["bert"] if args.quick else ["bert", "convnet"]):
        data["cases"].append(run_case(case))
    if not args.quick and args.memory_lengths:
        print("[shapes] memory ...", file=sys.stderr, flush=True)
        data["memory"] = memory(args.memory_lengths)
    harness.write_results(args.out, "shapes-quick" if args.quick else "shapes", data,
                          to_markdown(data))


if __name__ == "__main__":
    main()
