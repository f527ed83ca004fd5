"""Markdown for the fuzz results (benchmarks/results/fuzz.md)."""

from __future__ import annotations

from typing import Any


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# Fuzz results ({r['date']}{', quick' if r.get('quick') else ''})", "",
             f"torch {r['torch']}, onnxruntime {r['onnxruntime']}, {r['machine']}.", ""]
    for part, title in (("programs", "Hypothesis programs"),
                        ("kit", "Rule-targeted graphs (testing kit vocabulary, traced SDPA)")):
        p = r.get(part)
        if not p:
            continue
        lines += [
            f"## {title}: all rules and fxpass_bpu vs eager", "",
            "| graphs | rules mismatches | rules crashes | backend mismatches | backend crashes "
            "| graphs offloaded | regions | region fallbacks | fp64 referee | eager inconsistent "
            "| overflow order | ill-conditioned | time |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            f"| {p['tried']} | {p['rules_mismatch']} | {p['rules_crash']} | "
            f"{p['backend_mismatch']} | {p['backend_crash']} | {p['graphs_with_regions']} | "
            f"{p['regions']} | {p['fallbacks']} | {p['precision']} | "
            f"{p.get('eager_inconsistent', 0)} | {p.get('overflow_order', 0)} | "
            f"{p.get('ill_conditioned', 0)} | {p['seconds']:.0f} s |",
            "", "Rewrites by rule: " + (", ".join(
                f"{k} {v}" for k, v in sorted(p["rewrites"].items(), key=lambda kv: -kv[1]))
                or "none"), "",
        ]
        if p["fallback_reasons"]:
            lines += ["Region fallbacks (root cause, count):", ""]
            lines += [f"- {k} ({v})" for k, v in p["fallback_reasons"].items()] + [""]
    o = r.get("opinfo")
    if o:
        lines += [
            "## OpInfo sweep (matmul in front, aot_eager control)", "",
            "| ops | samples | offloaded samples | regions | fxpass mismatches | fxpass crashes "
            "| PyTorch's (also under aot_eager) | skipped | region fallbacks | time |",
            "|---|---|---|---|---|---|---|---|---|---|",
            f"| {o['ops']} | {o['samples']} | {o['offloaded']} | {o['regions']} | "
            f"{o['mismatch']} | {o['crash']} | {o['pytorch']} | {o['skipped']} | "
            f"{o['fallbacks']} | {o['seconds']:.0f} s |", "",
        ]
        if o.get("ops_total"):
            lines += [f"Ops reached: {o.get('ops_done')} of {o['ops_total']} "
                      "(cut off before the end).", ""]
        if o.get("pytorch_ops"):
            lines += ["PyTorch's own (also under aot_eager): " + ", ".join(
                f"{k} ({v})" for k, v in sorted(o["pytorch_ops"].items())), ""]
        if o["fallback_reasons"]:
            lines += ["Region fallbacks (root cause, count):", ""]
            lines += [f"- {k} ({v})" for k, v in o["fallback_reasons"].items()] + [""]
    apart = ("overflow_order", "ill_conditioned")
    every = [f for part in ("programs", "kit", "opinfo")
             for f in (r.get(part) or {}).get("findings", [])]
    findings = [f for f in every if f["kind"] not in (
        "fallback", "precision", "eager_inconsistent", "sdpa_kernels_disagree", *apart)]
    lines += ["## Findings", ""]
    lines += [f"- **{f['kind']}** `{f['case'][:300]}`: {_cause(f['message'])}"
              for f in findings[:40]] or ["none"]
    undetermined = [f for f in every if f["kind"] in apart]
    if undetermined:
        lines += ["", "## Eager's answer not determined (counted apart, see "
                  "benchmarks.fuzz.referee)", ""]
        lines += [f"- **{f['kind']}** `{f['case'][:300]}`: {_cause(f['message'])}"
                  for f in undetermined[:40]]
    return "\n".join(lines) + "\n"


def _cause(message: str) -> str:
    """The line of a traceback that names the error (not Dynamo's trailing advice)."""
    lines = [x.strip() for x in message.strip().splitlines() if x.strip()]
    errs = [x for x in lines if "Error" in x.split(":")[0] or "Error:" in x]
    return (errs[-1] if errs else lines[-1] if lines else "")[:300]
