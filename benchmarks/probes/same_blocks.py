"""Are the w4 package's int4 weights GenAI int4's, block for block?

    python -m benchmarks.probes.same_blocks [--models smollm2,qwen3-4x512] [--blocks 32,128]

For each model: a ``quantize="w4"`` package (``benchmarks.weight_only``'s export) and GenAI's
``-p int4`` build of the same weights. Every output column of every ``MatMulNBits`` in each
(its packed codes, its scales and its zero points, if any) is hashed; reported are the
columns of each and how many are matched in the other, duplicates counted (the two multisets'
intersection). Columns, not matrices: the package packs a layer's q/k/v and gate/up side by
side, which changes no column.

Why: the teacher-forced top-1 agreement of the two (``benchmarks.weight_only``) differs by one
position in 256 either way from run to run. When every column is the same, that difference
is the float rounding of the activations around the same int4 weights, not the quantization.
Writes ``benchmarks/probes/results/same_blocks.{json,md}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import onnx

ROOT = Path(__file__).resolve().parents[2]


def columns(model: onnx.ModelProto) -> Counter[str]:
    """One digest per output column of every ``MatMulNBits`` (codes, scales, zero points)."""
    inits = {t.name: t for t in model.graph.initializer}
    out: Counter[str] = Counter()
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        parts = [onnx.numpy_helper.to_array(inits[i]) for i in node.input[1:4] if i]
        n = parts[0].shape[0]
        for row in zip(*(p.reshape(n, -1) for p in parts), strict=True):
            out[hashlib.blake2b(b"|".join(r.tobytes() for r in row)).hexdigest()] += 1
    return out


def _package_columns(path: Path) -> Counter[str]:
    out: Counter[str] = Counter()
    for f in sorted(path.glob("region_*.onnx")):
        m = onnx.load(str(f), load_external_data=False)
        onnx.external_data_helper.load_external_data_for_model(m, str(path))
        out |= columns(m)  # prefill and decode regions hold the same matrices: count once
    return out


def compare(name: str, block: int) -> dict[str, Any]:
    from benchmarks.generate import GenAI, _build
    from benchmarks.weight_only import _package, smollm2

    tok = None
    if name == "smollm2":
        model, tok, ids = smollm2()
    else:
        model, ids = _build(name)
    with tempfile.TemporaryDirectory() as tmp:
        pkg = _package(model, 256, {"quantize": "w4", "block_size": block}, Path(tmp), "pkg")
        ours = _package_columns(pkg["path"])
        g = GenAI(model, ids, 256, "int4", (f"block_size={block}", "accuracy_level=4"), tok)
        theirs = columns(onnx.load(str(g.dir / "model.onnx")))
    return {"model": name, "block": block, "genai_columns": sum(theirs.values()),
            "package_columns": sum(ours.values()), "identical": sum((ours & theirs).values())}


def to_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | block | GenAI columns | package columns | in both (codes, scales, "
             "zero points) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['block']} | {r['genai_columns']} | {r['package_columns']} "
              f"| {r['identical']} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,qwen3-4x512,llama-4x512")
    ap.add_argument("--blocks", default="32,128")
    args = ap.parse_args(argv)
    rows = [compare(m, int(b)) for b in args.blocks.split(",") for m in args.models.split(",")]
    out = ROOT / "benchmarks" / "probes" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "same_blocks.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "same_blocks.md").write_text(to_markdown(rows))
    print(to_markdown(rows))


if __name__ == "__main__":
    main()
