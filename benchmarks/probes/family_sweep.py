"""Which families export, save, load and serve through buckets with eager's values?

    python -m benchmarks.probes.family_sweep [--families Bert,ViT,...] [--part export,buckets]
    python -m benchmarks.probes.family_sweep --part generate    # the decoder families

Why this exists: the deploy paths are tested on a handful of models; users bring others. Over
the forward families of ``benchmarks.architectures`` (tiny random configs), each in turn:

- ``export``: ``export(model, (), inputs, device="ort", options={"min_compute_macs": 0})``
  (``use_cache=False`` for the models that take it: their default call returns a cache
  object), ``save``, ``load``, then the loaded program's floating outputs against eager's
  (rtol 1e-3, atol 1e-4);
- ``buckets`` (text encoders): ``compile_for_encoder`` and ``export_for_encoder`` with
  ``{"seq": [16, 32], "batch": [1, 4]}`` on two rows of 13 tokens (one with masked tokens),
  ``last_hidden_state`` at real tokens against eager's; or the refusal, when padding would
  change the values;
- ``generate`` (the decoder families): ``export_for_generate`` (cache 48, prefill 8, ``ort``)
  in fp32 and with ``quantize="w4"``, ``save``, ``load``, then 12 greedy tokens after prompts
  of 5 and 13 tokens: fp32 against eager's static-cache ``generate()`` (equal), w4 generated
  (its tokens are not float's).

Each row is "equal", the refusal's first words, or the error. Writes
``benchmarks/probes/results/family_sweep.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import tempfile
import warnings
from typing import Any

import torch

from benchmarks.probes import save

TOL = {"rtol": 1e-3, "atol": 1e-4}
SPEC = {"seq": [16, 32], "batch": [1, 4]}


def _model(family: str) -> tuple[torch.nn.Module, str]:
    import transformers

    from benchmarks.architectures import FORWARD

    cfg_name, model_name, cfg, kind = FORWARD[family]
    torch.manual_seed(0)
    return getattr(transformers, model_name)(getattr(transformers, cfg_name)(**cfg)).eval(), kind


def _floats(out: Any) -> list[torch.Tensor]:
    from benchmarks.architectures import _flat

    return [t for t in _flat(out) if t.is_floating_point()]


def _outcome(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:110]}"


def export_one(family: str) -> str:
    from benchmarks.architectures import _inputs
    from fxpass.backends.bpu import export, load

    model, kind = _model(family)
    kw = _inputs(kind)
    if "use_cache" in inspect.signature(model.forward).parameters:
        kw["use_cache"] = False
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = _floats(model(**kw))
            program = export(model, (), kw, device="ort", options={"min_compute_macs": 0})
            got = _floats(load(program.save(tempfile.mkdtemp() + "/p"))(**kw))
    except Exception as e:  # noqa: BLE001 - the row says what went wrong
        return _outcome(e)
    ok = len(got) == len(want) and all(
        a.shape == b.shape and torch.allclose(a, b, **TOL) for a, b in zip(got, want, strict=False))
    return "equal" if ok else "DIFFERENT"


def buckets_one(family: str) -> str:
    from fxpass.backends.bpu import load
    from fxpass.hf.encoders import compile_for_encoder, export_for_encoder

    model, _ = _model(family)
    g = torch.Generator().manual_seed(0)
    kw = {"input_ids": torch.randint(3, 500, (2, 13), generator=g),
          "attention_mask": torch.ones(2, 13, dtype=torch.long)}
    kw["attention_mask"][1, 9:] = 0
    real = kw["attention_mask"].bool()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = model(**kw).last_hidden_state[real]
            jit = compile_for_encoder(copy.deepcopy(model), buckets=SPEC, device="ort")
            got = [jit(**kw).last_hidden_state[real]]
            path = export_for_encoder(model, buckets=SPEC, device="ort").save(
                tempfile.mkdtemp() + "/p")
            got.append(load(path)(**kw).last_hidden_state[real])
    except ValueError as e:
        return "refused: " + str(e).split(": ", 1)[1][:100] if "padding changes" in str(e) \
            else _outcome(e)
    except Exception as e:  # noqa: BLE001 - the row says what went wrong
        return _outcome(e)
    return "equal" if all(torch.allclose(x, want, **TOL) for x in got) else "DIFFERENT"


def generate_one(family: str, quantize: str | None) -> str:
    from benchmarks.architectures import _build
    from fxpass.backends.bpu import export_for_generate, load

    model, _ = _build(family)
    g = torch.Generator().manual_seed(1)
    opts = {"min_compute_macs": 0, **({"quantize": quantize} if quantize else {})}
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = export_for_generate(model, max_cache_len=48, prefill_length=8,
                                          device="ort", options=opts)
            runner = load(program.save(tempfile.mkdtemp() + "/p"))
            for n in (5, 13):
                ids = torch.randint(3, 500, (1, n), generator=g)
                got = runner.generate(ids, max_new_tokens=12, eos_token_id=[])
                if quantize:
                    if got.shape != (1, n + 12):
                        return f"DIFFERENT: {tuple(got.shape)} tokens"
                    continue
                want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=12, eos_token_id=None,
                                      cache_implementation="static",
                                      cache_config={"max_cache_len": 48})
                if not torch.equal(got, want):
                    return "DIFFERENT"
    except Exception as e:  # noqa: BLE001 - the row says what went wrong
        return _outcome(e)
    return "generated" if quantize else "equal"


def main(argv: list[str] | None = None) -> None:
    from benchmarks import harness
    from benchmarks.architectures import FAMILIES, FORWARD

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=None)
    ap.add_argument("--part", default="export,buckets")
    args = ap.parse_args(argv)
    decoders = args.part == "generate"
    families = args.families.split(",") if args.families else list(
        FAMILIES if decoders else FORWARD)
    rows = []
    for f in families:
        torch._dynamo.reset()
        row = {"family": f}
        if decoders:
            row["generate, fp32"] = generate_one(f, None)
            torch._dynamo.reset()
            row["generate, w4"] = generate_one(f, "w4")
        if "export" in args.part and not decoders:
            row["export, save, load"] = export_one(f)
        if "buckets" in args.part and not decoders and FORWARD[f][3] == "text":
            torch._dynamo.reset()
            row["buckets (compiled and packaged)"] = buckets_one(f)
        print(row, flush=True)
        rows.append(row)
    cols = ["family", "export, save, load", "buckets (compiled and packaged)",
            "generate, fp32", "generate, w4"]
    md = harness.markdown_table(rows, [c for c in cols if any(c in r for r in rows)])
    save("family_sweep_generate" if decoders else "family_sweep", {"rows": rows}, md)


if __name__ == "__main__":
    main()
