"""The fxpass_bpu decode region of ``generate()``, alone and in place.

    python -m benchmarks.probes.decode_region [--model qwen3-4x512] [--repeats 7]

Qwen3 4x512 (``benchmarks.generate``'s model), static cache, fxpass_bpu with the artifact cache
off. The decode region's model and one step's inputs are captured from a real ``generate()``.

1. **Host attention fusion, A/B.** The decode region is compiled twice in one process, with the
   attention fusion (``backends/onnx/host/attention.py``) and without it (every other host fusion on
   in both). Reported: ONNX nodes of each (top level, as the session sees them) and the
   region's time on the captured inputs, the two sessions timed side by side
   (``harness.interleave``, medians).
   **Host rotary fusion, A/B.** Compiled once more with the ``pointwise_before_repeat_cat``
   rule off, so the region never sees the half table and keeps the decomposed rotary
   (``backends/onnx/host/rotary.py``), timed in the same round-robin. Both fusions also as paired
   differences (``_paired``: the sessions back to back, order alternating, median of 300).
   **The products alone:** a model of only the region's top-level Gemm nodes over the same
   weights (``_products_only``), in the same round-robin: what the rest of the region costs.
   **Prepacked or in place, A/B.** Another compile with ``prepack_one_row=False``: the decode
   region reads the parameters in place (``host.shared_weights``) instead of onnxruntime's
   prepacked copies (the default): the region alone, whole ``generate()`` calls (decode ms per
   token), and the products alone in both forms, side by side.
2. **Where the region runs.** The fused region's executor timed in the same process: in a
   tight loop, after a 2 ms idle gap (a decode step's host work between two calls), right after
   a parallel torch op (a 512x512 matmul), and inside ``generate()`` (wrapped executor, median
   over the decode steps).

Writes ``benchmarks/probes/results/decode_region.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.generate import MODELS, PROMPT, _build, _hf_generate

ROOT = Path(__file__).resolve().parents[2]


def _capture(
    name: str, fuse_attention: bool, in_place: bool = False, rotary: bool = True
) -> tuple[Any, tuple, list[float], int, Any]:
    """Compile and run ``generate()``; return (decode executor, its last inputs, its per-call
    seconds during one more generate of 33 tokens, its ONNX node count, the generate run)."""
    import fxpass.backends.onnx.host.build as compile_mod
    import fxpass.backends.onnx.host.prepare as host
    from fxpass.backends.bpu import settle
    from fxpass.backends.onnx.host import ort as rt

    real_passes, real_call, real_fuse = host._passes, rt.OrtExecutor.__call__, host.fuse_for_ort
    counts: list[int] = []
    protos: list[Any] = []

    def fuse(proto: Any, *args: Any) -> Any:
        fused, found = real_fuse(proto, *args)
        counts.append(len(fused.graph.node))
        protos.append(fused)
        return fused, found

    if not fuse_attention:
        host._passes = lambda *a: [p for p in real_passes(*a) if p[0] != "attention"]
    seen: list[Any] = []
    calls: list[tuple[Any, float]] = []

    def call(self: Any, *tensors: torch.Tensor) -> Any:
        if self not in seen:
            seen.append(self)
        self.last_inputs = tensors
        t0 = time.perf_counter()
        out = real_call(self, *tensors)
        calls.append((self, time.perf_counter() - t0))
        return out

    rt.OrtExecutor.__call__, compile_mod.fuse_for_ort = call, fuse
    try:
        model, ids = _build(name)
        model.generation_config.cache_implementation = "static"
        model.generation_config.max_cache_len = PROMPT + 40
        model.forward = torch.compile(
            model.forward, backend="fxpass_bpu", dynamic=False,
            # without the rule the region never sees the half table: no rotary fusion
            # in_place: the decode region reads the weights in place, not prepacked copies
            options={"cache": False, "prepack_one_row": not in_place,
                     "disable": [] if rotary else ["pointwise_before_repeat_cat"]},
        )
        run = _hf_generate(model, ids)
        with contextlib.redirect_stderr(io.StringIO()):
            run(33)  # compiles prefill and decode
            settle()  # the prepacked second tiers are built: the next run is steady state
            calls.clear()
            run(33)
    finally:
        host._passes = real_passes
        rt.OrtExecutor.__call__, compile_mod.fuse_for_ort = real_call, real_fuse
    # the decode region runs once per new token, so it is the executor called most; not the
    # last one seen: a tiered prefill region's second tier is first called after the decode's
    decode = max(seen, key=lambda ex: sum(e is ex for e, _ in calls))
    in_generate = [t for ex, t in calls if ex is decode]
    # the decode region's model: the one whose inputs have the shapes of its last call
    shapes = [tuple(t.shape) for t in decode.last_inputs]
    decode.proto = next(p for p in reversed(protos) if [
        tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in p.graph.input
    ][: len(shapes)] == shapes)
    return decode, decode.last_inputs, in_generate, counts[-1], run


def _products_only(region: Any, prepack: bool) -> tuple[Any, tuple]:
    """An executor running only ``region``'s top-level Gemm nodes on the same weights and a
    random row each: what its products alone cost. ``region`` reads its weights in place;
    ``prepack``: written as initializers (copies) and prepacked, as the default region does."""
    import onnx
    from onnx import helper, numpy_helper

    from fxpass.backends.onnx.host import ort as rt

    proto = region.proto
    inits = {i.name: i for i in proto.graph.initializer}
    declared = {i.name: i for i in proto.graph.input}
    nodes, inputs, outputs, rows, used = [], [], [], {}, set()
    for j, n in enumerate(x for x in proto.graph.node if x.op_type == "Gemm"):
        w = n.input[1]
        if w in inits:
            k = (list(inits[w].dims)[::-1] if _trans_b(n) else list(inits[w].dims))[0]
        else:
            dims = [d.dim_value for d in declared[w].type.tensor_type.shape.dim]
            k = dims[1] if _trans_b(n) else dims[0]
        rows.setdefault(k, f"row{k}")
        if w not in used and w in declared:
            inputs.append(declared[w])
        used.add(w)
        nodes.append(helper.make_node("Gemm", [rows[k], w], [f"y{j}"], transB=_trans_b(n)))
        outputs.append(helper.make_tensor_value_info(f"y{j}", onnx.TensorProto.FLOAT, None))
    row_inputs = [helper.make_tensor_value_info(r, onnx.TensorProto.FLOAT, [1, k])
                  for k, r in rows.items()]
    graph = helper.make_graph(nodes, "products", row_inputs + inputs, outputs,
                              initializer=[inits[w] for w in used if w in inits])
    model = helper.make_model(graph, opset_imports=list(proto.opset_import))
    model.ir_version = proto.ir_version
    shared = {name: region.shared[name] for name in used if name in region.shared}
    missing = [i.name for i in inputs if i.name not in shared]
    if missing:
        raise RuntimeError(f"weights {missing} are region inputs the executor does not feed")
    if prepack:  # the weights as initializers onnxruntime prepacks
        model.graph.initializer.extend(
            numpy_helper.from_array(t.numpy(), name) for name, t in shared.items())
        kept = {i.name for i in model.graph.initializer}
        del model.graph.input[:]
        model.graph.input.extend(row_inputs)
        assert kept >= used
        shared = {}
    ex = rt.OrtExecutor(model.SerializeToString(), list(rows.values()), shared=shared,
                        prepack=prepack)
    return ex, tuple(torch.randn(1, k) for k in rows)


def _trans_b(node: Any) -> int:
    return next((a.i for a in node.attribute if a.name == "transB"), 0)


def _paired(without: Any, with_: Any, pairs: int = 300) -> float:
    """Median over ``pairs`` of t(without) - t(with_), ms, the two run back to back with
    their order alternating (positive: the fusion saves time)."""
    for _ in range(20):
        without(), with_()
    diffs = []
    for i in range(pairs):
        order = (without, with_) if i % 2 else (with_, without)
        t = [time.perf_counter()]
        for fn in order:
            fn()
            t.append(time.perf_counter())
        first, second = t[1] - t[0], t[2] - t[1]
        diffs.append((second - first) if i % 2 == 0 else (first - second))
    return statistics.median(diffs) * 1e3


def measure(name: str, repeats: int) -> dict[str, Any]:
    from fxpass.backends.onnx.host import ort as rt

    fused, args, in_generate, fused_nodes, gen = _capture(name, True)
    plain, plain_args, _, plain_nodes, _ = _capture(name, False)
    no_rot, no_rot_args, _, no_rot_nodes, _ = _capture(name, True, rotary=False)
    in_place, in_place_args, _, _, gen_in_place = _capture(name, True, in_place=True)
    call = rt.OrtExecutor.__call__
    products, product_args = _products_only(in_place, prepack=False)
    packed_products, _ = _products_only(in_place, prepack=True)
    ab = harness.interleave(
        {"fused": lambda: call(fused, *args), "unfused": lambda: call(plain, *plain_args),
         "no rotary": lambda: call(no_rot, *no_rot_args),
         "weights in place": lambda: call(in_place, *in_place_args),
         "products only, in place": lambda: call(products, *product_args),
         "products only, prepacked": lambda: call(packed_products, *product_args)},
        warmup=20, repeats=repeats, budget_s=45.0, min_sample_s=0.05,
    )
    # the fusions' A/Bs as paired differences too: the two sessions called back to back in
    # alternating order, 300 pairs; a median of differences holds still where medians of
    # separate samples moved by more than the effect (0.26 ms the wrong way in one run)
    paired = {
        "attention": _paired(lambda: call(plain, *plain_args), lambda: call(fused, *args)),
        "rotary": _paired(lambda: call(no_rot, *no_rot_args), lambda: call(fused, *args)),
    }
    steps = {}
    for n in (1, 33):  # whole generate() calls, the decode region prepacked vs in place
        st = harness.interleave(
            {"prepacked": lambda n=n: gen(n), "in place": lambda n=n: gen_in_place(n)},
            warmup=2, repeats=3 * repeats, budget_s=90.0, min_repeats=repeats, settle_s=0.05,
        )
        steps[n] = {k: s.median for k, s in st.items()}
    decode_ms = {k: (steps[33][k] - steps[1][k]) / 32 * 1e3 for k in steps[1]}

    def timed(before_call: Any, n: int = 60) -> float:
        ts = []
        for _ in range(n):
            before_call()
            t0 = time.perf_counter()
            call(fused, *args)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    x = torch.randn(512, 512)
    placement = {
        "tight_loop_ms": timed(lambda: None),
        "after_2ms_idle_ms": timed(lambda: time.sleep(0.002)),
        "after_torch_matmul_ms": timed(lambda: x @ x),
        "inside_generate_ms": statistics.median(in_generate) * 1e3,
    }
    return {
        "model": name,
        "onnx_nodes": {"fused": fused_nodes, "unfused": plain_nodes, "no rotary": no_rot_nodes},
        "region_ms": {k: s.median * 1e3 for k, s in ab.items()},
        "paired_saving_ms": paired,
        "shared_inputs": len(in_place.shared),
        "decode_ms_per_token": decode_ms,
        "placement": placement,
    }


def to_markdown(r: dict[str, Any]) -> str:
    rows = [
        {"measure": "decode region ONNX nodes (fused / unfused)",
         "value": f"{r['onnx_nodes']['fused']} / {r['onnx_nodes']['unfused']}"},
        {"measure": "decode region ms alone, side by side (fused / unfused)",
         "value": f"{r['region_ms']['fused']:.2f} / {r['region_ms']['unfused']:.2f}"},
        {"measure": "rotary fusion: ONNX nodes, region ms alone (with / without)",
         "value": f"{r['onnx_nodes']['fused']} / {r['onnx_nodes']['no rotary']}, "
                  f"{r['region_ms']['fused']:.2f} / {r['region_ms']['no rotary']:.2f}"},
        {"measure": "the region's Gemm nodes alone, same weights: ms (prepacked / in place)",
         "value": f"{r['region_ms']['products only, prepacked']:.2f} / "
                  f"{r['region_ms']['products only, in place']:.2f}"},
        *({"measure": f"{k} fusion saves, ms per call (median of 300 paired differences)",
           "value": f"{v:.3f}"} for k, v in r["paired_saving_ms"].items()),
        {"measure": "weights prepacked (default) / read in place "
                    f"({r['shared_inputs']} inputs, prepack_one_row=False): region ms",
         "value": f"{r['region_ms']['fused']:.2f} / {r['region_ms']['weights in place']:.2f}"},
        {"measure": "weights prepacked / read in place: decode ms per token in generate()",
         "value": f"{r['decode_ms_per_token']['prepacked']:.2f} / "
                  f"{r['decode_ms_per_token']['in place']:.2f}"},
        *({"measure": f"fused region ms, {k[:-3].replace('_', ' ')}", "value": f"{v:.2f}"}
          for k, v in r["placement"].items()),
    ]
    return harness.markdown_table(rows, ["measure", "value"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-4x512", choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "probes" / "results"))
    args = ap.parse_args(argv)
    print(f"[decode_region] {args.model} ...", file=sys.stderr, flush=True)
    result = {"env": harness.environment(), **measure(args.model, args.repeats)}
    harness.write_results(args.out, "decode_region", result, to_markdown(result))


if __name__ == "__main__":
    main()
