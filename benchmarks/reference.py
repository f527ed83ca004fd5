"""Write docs/benchmarks.md: per benchmark, the question, the command, the latest table, how to
read it, from ``benchmarks/results/<stem>.md`` as each benchmark last wrote it.

    python -m benchmarks.reference

Why generated: the page is a reference, not a diary. A benchmark run replaces its results
file; this rebuilds the page from the latest ones, so a table is never typed in by hand and no
dated history piles up (git keeps it).
"""

from __future__ import annotations

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

#: (module, results stem, max table lines, how to read it[, the command's arguments])
SUITE: list[tuple[str, ...]] = [
    ("deploy", "deploy", 40,
     "Decode ms/token is (t(1 + N) - t(1)) / N from medians of round-robin samples. The "
     "package (`export_for_generate`, loaded in the same process) against eager HF "
     "`generate(cache_implementation=\"static\")`, the JIT path (`compile_for_generate`) and "
     "ONNX Runtime GenAI on the same weights; every contender's tokens are checked against "
     "eager's. Each makes exactly N tokens with the end token off (HF: `eos_token_id=None`, "
     "the runner: `eos_token_id=[]`; not `min_new_tokens`, whose end-token masking cost HF's "
     "loop 0.65 ms/token). \"outside ms\" is a decode step's wall time minus its region "
     "executor's. \"load -> 1st token\" is measured in a fresh process after the imports."),
    ("weight_only", "weight_only", 40,
     "Weight-only int8/int4 packages (and the JIT path) on the `ort` device beside the fp32 "
     "package and GenAI's fp32 and int4 builds of the same weights. \"vs its fp32\" divides by "
     "the same runner's fp32 row. Quality is against the float model over 256 teacher-forced "
     "positions (random ids; SmolLM2: `benchmarks/data/sample.txt`); \"greedy tokens = eager\" "
     "is the share of free-running greedy tokens equal to eager's up to the first end token. "
     "On random weights near-flat logits make w4's agreement low for every runner alike; "
     "SmolLM2 (real weights, from its Q4_1 GGUF, so int4 at block 32 nearly re-quantizes "
     "it) is the model to read quality on. See docs/quantization.md."),
    ("weight_only", "weight_only-executorch", 30,
     "The same suite run by an interpreter that has ExecuTorch (its own environment: "
     "`python -m venv --system-site-packages .et && .et/bin/pip install executorch==1.5.1 "
     "\"torchao>=0.18,<0.19\" -c constraints.txt`, then the command above with "
     "`.et/bin/python`; `benchmarks/executorch.py`), on the two 4 x 512 models: ExecuTorch "
     "XNNPACK fp32 and 8da4w (torchao's int8 dynamic activations, int4 weights in groups of "
     "32) beside the packages and GenAI, in one run. \"vs executorch\" divides package-fp32 "
     "by et-fp32 and package-w4 by et-8da4w.",
     "--models qwen3-4x512,llama-4x512 --tag executorch"),
    ("generate", "generate", 40,
     "The JIT path: `generate()` with a static cache through eager, inductor, fxpass_bpu, "
     "fxpass_ort and GenAI, beside the `ort` package of the same weights (\"package\": "
     "`export_for_generate` -> `load`, its lean runner; \"vs package\" is the JIT's bar, "
     "1.2x). Graphs and regions per graph come from `fxpass.compile_reports()`; the step "
     "breakdown splits a fxpass decode step into region, wrappers and HF's loop."),
    ("shapes", "shapes", 40,
     "16 BERT inputs (lengths 8-128, batch 1-4) and 6 ResNet image sizes: first pass with "
     "compiles, warm pass after the background builds settle (five rounds of an eager pass "
     "then the contender's; warm vs eager is the median of the five ratios), Dynamo graphs, "
     "fxpass variants compiled, recompile warnings, values against eager, and work (tokens "
     "computed over tokens given: what padding adds). fxpass-exact is fxpass with a variant "
     "bound as large as the inputs (no padding, no eviction); fxpass-buckets-124 pads batches "
     "to 1, 2 or 4 rows. The memory table is RSS over "
     "distinct lengths past the variant bound. See docs/shapes.md."),
    ("chat", "chat", 20,
     "SmolLM2-135M-Instruct (real weights) answering three chat prompts, greedy to its end "
     "token: HF's `generate()` eager against `compile_for_generate` on both devices and the "
     "`ort` package, each warmed on every prompt first (compiles excluded), timed side by "
     "side (medians). Tokens are checked against eager's. Issue 47's bar: every JIT row "
     "below 1.0x, short answers included."),
    ("second_pass", "second_pass", 20,
     "A model served at 6 shapes under plain `torch.compile`: the eager pass, the first pass "
     "(every variant compiled, cold cache), the second pass right after it (nothing waited "
     "for), and the steady pass after `settle()` (median of 3); every output checked against "
     "eager. Issue 47's bars: second pass at most 1.2x the steady one, and at most 0.8x eager "
     "on the transformer encoders."),
    ("prompt_lengths", "prompt_lengths", 20,
     "generate() over twelve prompt lengths as a chat sends them: graphs compiled and the first "
     "pass with compiles, chunked prefill against one compile per exact length."),
    ("run", "latest", 60,
     "The single-forward and scaling suite (`benchmarks.models`, `benchmarks.scaling`) with "
     "each performance bar next to its measurement and a verdict computed from it."),
    ("compile_time", "compile_time", 20,
     "Cold first call and warm new process, fxpass_bpu against inductor, fresh processes; "
     "the backend's own time apart from Dynamo's and AOTAutograd's."),
    ("compile_time", "compile_time-remote", 20,
     "A fresh process with an empty local cache against a warm Redis (the remote tier, "
     "docs/bpu-backend.md, \"Fleet\"), beside a cold compile and a local-warm process, under "
     "`torch.compile` and under `fxpass.precompile` (whose entry holds the trace, so a new "
     "process skips Dynamo and AOTAutograd); \"backend\" is fxpass's own share of the first "
     "call. The store holds the compiled models, the plan and the precompiled entry, not the "
     "weights.",
     "--remote"),
    ("architectures", "architectures", 30,
     "Every model family transformers ships that builds from a small config: generate() "
     "tokens against eager, graphs, regions per graph, and what stays on the CPU. Full table: "
     "`benchmarks/results/architectures.md`."),
    ("quantize", "quantize", 20,
     "Calibrated w8a16 and w8a8 regions: cosine and max error against eager float, host "
     "latency next to float."),
    ("scaling", "scaling", 20,
     "Pass manager and partitioner time per node from 1k to 100k nodes, next to torch.fx's "
     "own tools: linear is the bar."),
    ("fuzz", "fuzz", 30,
     "Hypothesis programs, testing-kit graphs and PyTorch's OpInfo samples through the rules "
     "and the backend against eager, with an fp64 referee for what eager itself gets wrong. "
     "Full report: `benchmarks/results/fuzz.md`."),
]

#: one-question probes: the question, answered once; rerun them when what they measure moves
#: (every module of ``benchmarks/probes/``, so a new one is listed without editing this)
PROBES = sorted(p.stem for p in (ROOT / "benchmarks" / "probes").glob("*.py")
                if not p.stem.startswith("_"))


def _question(module: str) -> str:
    doc = importlib.import_module(f"benchmarks.{module}").__doc__ or ""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    return text


def _table(stem: str, limit: int) -> str:
    f = RESULTS / f"{stem}.md"
    if not f.exists():
        return f"_No results yet: run the command above (`{f.relative_to(ROOT)}`)._"
    lines = [ln for ln in f.read_text().strip().splitlines() if not ln.startswith("# ")]
    if len(lines) > limit:
        lines = lines[:limit] + [f"\n_({len(lines) - limit} more lines in "
                                 f"`benchmarks/results/{stem}.md`)_"]
    return "\n".join(lines)


def render() -> str:
    out = [
        "# Benchmarks",
        "",
        "Every number is measured on this project's machines (2 cores, CPU only), side by side "
        "in one run (round-robin samples, `benchmarks/harness.py`), as medians; ratios, not "
        "absolute times, are what carry over. Benchmarks are not tests: nothing here is "
        "asserted. Each section is the latest run's table, copied from "
        "`benchmarks/results/<name>.md` by `python -m benchmarks.reference`; history is in git.",
        "",
    ]
    for module, stem, limit, how, *args in SUITE:
        cmd = " ".join([f"python -m benchmarks.{module}", *args])
        out += [f"## {' '.join([module, *args])}", "", _question(module), "", "```bash", cmd,
                "```", "",
                _table(stem, limit), "", f"How to read it: {how}", ""]
    out += ["## Probes", "",
            "One-question benchmarks in `benchmarks/probes/`, kept for when what they measure "
            "moves (each writes `benchmarks/probes/results/<name>.md`):", ""]
    for module in PROBES:
        name = f"probes.{module}"
        out.append(f"- `python -m benchmarks.{name}`: {_question(name)}")
    return "\n".join(out) + "\n"


def main() -> None:
    path = ROOT / "docs" / "benchmarks.md"
    path.write_text(render())
    print(f"wrote {path} ({len(path.read_text().splitlines())} lines)")


if __name__ == "__main__":
    main()
