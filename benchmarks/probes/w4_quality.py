"""Which int4 settings buy quality, and what they cost: the ``ort`` device's weight-only options
against GenAI's int4 build of the same weights, on SmolLM2's real weights.

    python -m benchmarks.probes.w4_quality [--models smollm2] [--blocks 32,128] [--repeats 5]

Why this exists: ``quantize="w4"`` (round to nearest, symmetric, int8 activations) stores the
very blocks GenAI's builder stores (``benchmarks.probes.same_blocks``), so its quality is
GenAI's up to the float rounding around them: the teacher-forced top-1 agreement of the two
moves by a position or two in 256 either way. A user who wants more quality than that has
three options to turn; this measures each at both block sizes, side by side in one run:

- ``rtn``: the default (``accuracy_level=4``, symmetric);
- ``rtn fp32 act``: ``accuracy_level=1``, the kernel multiplies float32 activations;
- ``rtn asym``: ``symmetric=False``, a zero point per block;
- ``hqq``: ``algorithm="hqq"``, half-quadratic (asymmetric, float zero points; a tied
  embedding stays float32, as onnxruntime's ``GatherBlockQuantized`` takes no float zero
  point);
- ``genai int4``: GenAI's builder, ``-p int4`` at the same block size, accuracy level 4.

Per setting: quality against the float model over 256 positions of ``benchmarks/data/
sample.txt`` (top-1 next-token agreement, mean logit cosine, perplexity: the package's own
prefill program, GenAI's ONNX model through onnxruntime, as ``benchmarks.weight_only``), the
package size against the fp32 weights, the export time, and decode ms/token over 32 new
tokens (medians of round-robin samples). SmolLM2's weights come from Q4_1 blocks of 32 (a
minimum and a step per block, which an int4 zero point cannot hold exactly): read both block
sizes, not block 32 alone. Writes
``benchmarks/probes/results/w4_quality.{json,md}``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.probes import save
from fxpass.aot.quality import agreement

#: setting -> the ``ort`` device's options besides ``quantize`` and ``block_size``
SETTINGS: dict[str, dict[str, Any]] = {
    "rtn": {},
    "rtn fp32 act": {"accuracy_level": 1},
    "rtn asym": {"symmetric": False},
    "hqq": {"algorithm": "hqq"},
}


def measure(name: str, blocks: list[int], repeats: int) -> list[dict[str, Any]]:
    from benchmarks import weight_only as W
    from benchmarks.generate import GenAI

    torch._dynamo.reset()
    model, tok, ids, text = W.model_and_text(name)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    max_len = -(-max(ids.shape[1] + 34, W.POSITIONS) // W.CHUNK) * W.CHUNK
    with torch.no_grad():
        ref = model(text).logits[0].float()
    tmp = Path(tempfile.mkdtemp(prefix="fxpass-w4-quality-"))
    rows, runners = [], {}
    for block in blocks:
        for setting, extra in SETTINGS.items():
            options = {"quantize": "w4", "block_size": block, **extra}
            t0 = time.perf_counter()
            p = W._package(model, max_len, options, tmp, f"{name}-{block}-{setting}")
            built = time.perf_counter() - t0
            q = agreement(p["runner"].score(text)[0], ref, text)
            key = f"{setting} b{block}"
            runners[key] = (lambda n, r=p["runner"]: r.generate(ids, max_new_tokens=n,
                                                                eos_token_id=[]))
            rows.append({"model": name, "block": block, "setting": setting, **q,
                         "size": p["size"] / weights, "build_s": built, "key": key})
        t0 = time.perf_counter()
        g = GenAI(model, ids, max_len, "int4", (f"block_size={block}", "accuracy_level=4"), tok)
        built = time.perf_counter() - t0
        q = agreement(W._genai_logits(g, text), ref, text)
        size = sum(f.stat().st_size for f in g.dir.rglob("*") if f.is_file())
        key = f"genai int4 b{block}"
        runners[key] = g
        rows.append({"model": name, "block": block, "setting": "genai int4", **q,
                     "size": size / weights, "build_s": built, "key": key})
    decode, _ = harness.decode_ms_per_token(runners, (32,), repeats, budget_s=60.0)
    for r in rows:
        r["decode_ms"] = decode[r.pop("key")][32]
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        genai = next(g for g in rows if g["model"] == r["model"] and g["block"] == r["block"]
                     and g["setting"] == "genai int4")
        out.append({
            "model": r["model"], "block": str(r["block"]), "setting": r["setting"],
            "top-1": f"{r['top1']:.3f}", "cosine": f"{r['cosine']:.4f}",
            "perplexity": f"{r['perplexity']:.2f}", "size vs fp32": f"{r['size']:.3f}x",
            "export s": f"{r['build_s']:.0f}", "decode ms/token": f"{r['decode_ms']:.2f}",
            "decode vs GenAI int4": f"{r['decode_ms'] / genai['decode_ms']:.2f}x",
        })
    head = ("Weight-only int4 settings against the float model (256 teacher-forced positions) "
            "and GenAI int4, side by side in one run; decode over 32 new tokens, medians\n\n")
    return head + harness.markdown_table(out, list(out[0]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2")
    ap.add_argument("--blocks", default="32,128")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    blocks = [int(b) for b in args.blocks.split(",")]
    rows = [r for m in args.models.split(",") for r in measure(m, blocks, args.repeats)]
    save("w4_quality", {"rows": rows}, to_markdown(rows))


if __name__ == "__main__":
    main()
