"""The rule-targeted stream: graphs from the testing kit's vocabulary, and traced attention.

The program stream (:mod:`benchmarks.fuzz.programs`) is traced by ``make_fx``, which already
emits canonical overloads, so several rules never see their input there. This stream builds
graphs out of exactly those inputs: ``mul.Scalar`` and friends (scalar_overloads), the three
cast spellings, ``alias``/``detach`` (alias_removal), ``full`` (constant_folding),
``_safe_softmax`` over fully masked rows (safe_softmax), and SDPA with causal, boolean and
additive masks, custom scale and GQA (sdpa_decomposition). Each graph runs through all
rules and through ``fxpass_bpu``; the original graph, run eagerly, is the expectation.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from benchmarks.fuzz.check import equals_either
from benchmarks.fuzz.programs import MODES, make_tensor
from benchmarks.fuzz.run import Tally, backend_path, judge, undetermined
from fxpass.testing import VOCAB, T, aten_graphs, traced_graphs


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: torch.Tensor,
               causal: bool, scale: float | None, gqa: bool, mask: str) -> torch.Tensor:
    m = rest[0] if rest else None
    if mask == "bool" and m is not None:
        m = m > 0
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal,
                                          scale=scale, enable_gqa=gqa)


@st.composite
def _attention_inputs(draw: Any) -> tuple[list[T], dict]:
    b, h, s, e = (draw(st.integers(1, 2)), draw(st.sampled_from([2, 4])),
                  draw(st.integers(1, 5)), draw(st.sampled_from([2, 4])))
    gqa = draw(st.booleans())
    hk = h // 2 if gqa else h
    mask = draw(st.sampled_from(["none", "bool", "additive"]))
    causal = mask == "none" and draw(st.booleans())
    dt = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    specs = [T((b, h, s, e), dt), T((b, hk, s, e), dt), T((b, hk, s, e), dt)]
    if mask != "none":
        specs.append(T((s, s), dt))
    scale = draw(st.sampled_from([None, 0.5]))
    return specs, {"causal": causal, "scale": scale, "gqa": gqa, "mask": mask}


def kit_graphs() -> st.SearchStrategy:
    return st.one_of(
        aten_graphs(ops=list(VOCAB), dtypes=(torch.float32, torch.float16, torch.bfloat16),
                    max_ops=8),
        traced_graphs(_attention, _attention_inputs()),
    )


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _math_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
               is_causal: bool = False, *, attn_mask: Any = None, scale: Any = None) -> tuple:
    out = torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
        enable_gqa=k.shape[-3] != q.shape[-3])[0]
    return out, torch.empty(0)


def math_control(gm: torch.fx.GraphModule, inputs: list) -> Any:
    """The graph with eager's CPU flash-attention kernel swapped for PyTorch's own math SDPA,
    or None when it has none. The two kernels disagree on NaN/Inf inputs and overflowing
    scores; the SDPA rule decomposes into the math form."""
    g = copy.deepcopy(gm)
    nodes = [n for n in g.graph.nodes if n.target is _FLASH]
    if not nodes:
        return None
    for n in nodes:
        n.target = _math_sdpa
    g.recompile()
    try:
        with torch.no_grad():
            return g(*[x.clone() for x in inputs])
    except Exception:  # noqa: BLE001 - no control then; the strict comparison stands
        return None


def run_graph(gm: torch.fx.GraphModule, modes: list[tuple[str, int]], t: Tally, rules: list,
              options: dict) -> None:
    from fxpass import PassManager

    phs = gm.graph.find_nodes(op="placeholder")
    inputs = [make_tensor(p.meta["val"].dtype, p.meta["val"].shape, m, s)
              for p, (m, s) in zip(phs, modes, strict=False)]
    t.tried += 1
    t.ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    original = copy.deepcopy(gm)
    try:
        with torch.no_grad():
            expected = original(*[x.clone() for x in inputs])
    except Exception:  # noqa: BLE001 - not valid at runtime: not a finding
        t.invalid += 1
        return
    import traceback

    ref = _reference(original, inputs)
    try:
        rep = PassManager(rules, check=True).run(gm)
        t.rewrites.update(rep.rewrites)
        with torch.no_grad():
            got = gm(*[x.clone() for x in inputs])
        msg = _judge_sdpa(original, expected, got, inputs, t, ref)
        if msg:
            t.rules_mismatch += 1
            t.note("rules_mismatch", original.code, msg)
    except Exception:  # noqa: BLE001
        t.rules_crash += 1
        t.note("rules_crash", original.code, traceback.format_exc())
    case = _Case(original.code)
    control = math_control(original, inputs)
    backend_path(copy.deepcopy(original), inputs, expected, ref, case, t, options,
                 control=control, graph=original)


class _Case(str):
    """A finding's case: the graph's code."""


def _reference(gm: torch.fx.GraphModule, inputs: list) -> Any:
    """The graph on float64 inputs (explicit casts in the graph still apply): the referee for
    overflow and rounding, as for programs; None when the graph does not run in float64."""
    try:
        with torch.no_grad():
            return copy.deepcopy(gm)(*[x.double() if x.dtype.is_floating_point else x.clone()
                                       for x in inputs])
    except Exception:  # noqa: BLE001
        return None


def _judge_sdpa(gm: torch.fx.GraphModule, expected: Any, got: Any, inputs: list,
                t: Tally, ref: Any = None) -> str | None:
    msg = judge(expected, got, ref, None, inputs, [], t)
    if msg:
        control = math_control(gm, inputs)
        if control is not None and equals_either(expected, control, got, ref):
            t.eager_inconsistent += 1
            t.note("sdpa_kernels_disagree", gm.code, msg)
            return None
        return undetermined(gm, inputs, [], expected, got, ref, t, msg)
    return msg


@st.composite
def kit_cases(draw: Any) -> tuple[torch.fx.GraphModule, list[tuple[str, int]]]:
    gm = draw(kit_graphs())
    n = len(gm.graph.find_nodes(op="placeholder"))
    modes = [(draw(st.sampled_from(MODES)), draw(st.integers(0, 2**31 - 1))) for _ in range(n)]
    return gm, modes
