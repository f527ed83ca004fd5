"""generate() through fxpass_bpu on every decoder family transformers ships that we can build.

    python -m benchmarks.architectures [--only Gemma2,Falcon] [--new-tokens 20]

Not a timing: the generation bars other than speed, on architectures no issue names. Each
family is a real ``transformers`` ``*ForCausalLM`` from a tiny random config (2 layers, hidden
64, a sliding window of 16 where the family has one), run in its own process (one bad family
cannot take the others down). A 4-token prompt and 20 new tokens cross the window, so
sliding-window caches reach their "full" regime.

Per family: greedy tokens equal to eager's (static cache, fp32), Dynamo graphs, device regions
per graph, what stays on the CPU beyond the embedding and integer index arithmetic, and which
rules fired. Writes ``benchmarks/results/architectures.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: family -> extra config (the common tiny config is in ``_build``)
FAMILIES: dict[str, dict[str, Any]] = {
    "Llama": {}, "Qwen2": {}, "Qwen3": {"head_dim": 16}, "Mistral": {"sliding_window": 16},
    "Phi3": {"pad_token_id": 0}, "Phi": {}, "Gemma": {"head_dim": 16},
    "Gemma2": {"head_dim": 16, "sliding_window": 16, "attn": "eager"},
    "Gemma3Text": {"head_dim": 16, "sliding_window": 16}, "GPTNeoX": {}, "OPT": {"ffn_dim": 128},
    "Falcon": {"new_decoder_architecture": True, "num_kv_heads": 2}, "StableLm": {},
    "Cohere": {}, "Granite": {}, "Olmo": {}, "Olmo2": {}, "Starcoder2": {},
    "GPTJ": {"n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8, "attn": "eager"},
    "CodeGen": {"n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8, "n_ctx": 256,
                "attn": "eager"},
    "Bloom": {"n_layer": 2, "n_head": 4, "attn": "eager"}, "SmolLM3": {"pad_token_id": 0},
    "Glm": {"pad_token_id": 0, "head_dim": 16}, "Helium": {"head_dim": 16},
    "Exaone4": {"sliding_window": 16},
    "Mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "Qwen2Moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                 "shared_expert_intermediate_size": 64},
}
#: what may stay on the CPU (issue 8): the embedding, integer index arithmetic, the rotary
#: tables (cos/sin depend only on positions) and the cache writes themselves
ALLOWED = ("embedding", "int64", "eq.Tensor", "index_select", "copy_", "cos", "sin",
           "symbolic scalar")
CLASSES = {"Gemma3Text": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def _build(family: str) -> tuple[Any, Any]:
    import torch
    import transformers as tf

    extra = dict(FAMILIES[family])
    attn = extra.pop("attn", "sdpa")
    cfg_name, model_name = CLASSES.get(family, (f"{family}Config", f"{family}ForCausalLM"))
    cfg = getattr(tf, cfg_name)(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **extra,
    )
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = getattr(tf, model_name)(cfg).eval()
    ids = torch.randint(3, 500, (1, 4), generator=torch.Generator().manual_seed(0))
    return model, ids


def one(family: str, new_tokens: int) -> dict[str, Any]:
    """Run one family in this process (the parent runs each in a child)."""
    import torch

    import fxpass
    from fxpass.backends.bpu import compile_for_generate

    model, ids = _build(family)

    def gen(**kw: Any) -> Any:
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, **kw)

    expected = gen(cache_implementation="static")
    before = len(fxpass.compile_reports())
    compile_for_generate(model, max_cache_len=64, options={"min_compute_macs": 0})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = gen()
    reports = fxpass.compile_reports()[before:]
    cpu = sorted({why for r in reports for why in r.cpu_reasons
                  if not any(a in why for a in ALLOWED)})
    rewrites: dict[str, int] = {}
    for r in reports:
        for k, v in r.rewrites.items():
            rewrites[k] = rewrites.get(k, 0) + v
    return {
        "family": family,
        "tokens_match": bool(torch.equal(got, expected)),
        "graphs": len(reports),
        "regions_per_graph": [len(r.regions) for r in reports],
        "fallbacks": [x.fallback for r in reports for x in r.regions if x.fallback],
        "other_cpu_ops": cpu,
        "rewrites": rewrites,
        "warnings": sorted({str(x.message)[:200] for x in w if "fxpass" in str(x.message)}),
    }


def run(families: list[str], new_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for fam in families:
        print(f"[architectures] {fam} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "benchmarks.architectures", "--child", fam,
               "--new-tokens", str(new_tokens)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
            line = [x for x in p.stdout.splitlines() if x.startswith("{")]
            if p.returncode or not line:
                tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
                rows.append({"family": fam, "error": tail[0][:300]})
            else:
                rows.append(json.loads(line[-1]))
        except subprocess.TimeoutExpired:
            rows.append({"family": fam, "error": "timed out after 600 s"})
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    from benchmarks import harness

    table = []
    for r in rows:
        if "error" in r:
            table.append({"family": r["family"], "tokens = eager": "error", "note": r["error"]})
            continue
        table.append({
            "family": r["family"],
            "tokens = eager": "yes" if r["tokens_match"] else "**NO**",
            "graphs": r["graphs"],
            "regions/graph": r["regions_per_graph"],
            "other CPU ops": "; ".join(r["other_cpu_ops"])[:160] or "-",
            "note": "; ".join(r["warnings"])[:160] or "",
        })
    cols = ["family", "tokens = eager", "graphs", "regions/graph", "other CPU ops", "note"]
    return harness.markdown_table(table, cols)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    ap.add_argument("--new-tokens", type=int, default=20)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one(args.child, args.new_tokens)))
        return
    from benchmarks import harness

    families = [f for f in args.only.split(",") if f] or list(FAMILIES)
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        ap.error(f"unknown families {unknown}; choose from {sorted(FAMILIES)}")
    rows = run(families, args.new_tokens)
    data = {"env": harness.environment(), "new_tokens": args.new_tokens, "results": rows}
    harness.write_results(args.out, "architectures", data, to_markdown(rows))


if __name__ == "__main__":
    main()
